"""The fuzzing's engine, shared by ``tests/test_fuzz.py`` (hypothesis) and
``benchmarks/fuzz_campaign.py`` (seeded, or driven by atheris): one *valid* checkpoint
(:func:`base_files`), the mutators that damage it (:data:`MUTATORS`, each taking a
:class:`random.Random`, so that hypothesis's shrinkable ``st.randoms()`` and atheris's input
bytes drive the same code), and :func:`run_pipeline`, which opens, plans and loads the files
and classifies how that ended (:class:`Outcome`) without raising."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import struct
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab import AsyncSlabError, Checkpoint, LoadOptions
from asyncslab.testing import SyntheticSpec, write_synthetic
from support.faults import HANG_S

try:
    import uvloop
except ImportError:  # pragma: no cover - platforms without uvloop
    uvloop = None

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
# Small reads: a load of the ~20 KB base checkpoint still takes dozens of awaits.
OPTIONS = LoadOptions(read_size=1024, coalesce_gap=64, io_workers=3, read_timeout=HANG_S)


# --- the valid starting point -----------------------------------------------------------


@functools.lru_cache(maxsize=1)
def base_files() -> dict[str, bytes]:
    """Relative path -> bytes of the valid checkpoint every mutation starts from."""
    spec = SyntheticSpec(
        n_layers=2, first_dense=1, n_experts=2, hidden=16, intermediate=16, n_shards=1, vocab=16
    )
    with tempfile.TemporaryDirectory() as d:
        written = write_synthetic(d, spec)
        tensors: dict[str, torch.Tensor] = {}
        for path in written.files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensors[name] = f.get_tensor(name)
    generator = torch.Generator().manual_seed(7)
    tensors.update(
        {
            "extra.empty": torch.zeros(0, 4, dtype=torch.uint8),
            "extra.scalar": torch.tensor(2.5, dtype=torch.float64),
            "extra.flag": torch.tensor([True, False, True]),
            "extra.i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "extra.f32": torch.randn(5, 3, generator=generator),
            "extra.f16": torch.randn(7, generator=generator).to(torch.float16),
        }
    )
    names = sorted(tensors)
    halves = (names[0::2], names[1::2])  # interleaved: layers and experts straddle files
    out: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        for shard, members in zip(SHARDS, halves, strict=True):
            path = Path(d) / shard
            save_file({n: tensors[n] for n in members}, path, metadata={"format": "pt"})
            out[shard] = path.read_bytes()
            weight_map.update(dict.fromkeys(members, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out[INDEX] = json.dumps(index, indent=2).encode()
    out["README.md"] = b"not a checkpoint file\n"
    return out


# --- JSON that may repeat keys ----------------------------------------------------------


class Obj(list):  # type: ignore[type-arg]
    """A JSON object as an ordered list of ``[key, value]`` pairs; keys may repeat."""


class Raw(str):
    """JSON text spliced in verbatim (a float, a 5000-digit number, ``null``)."""


def loads(text: bytes | str) -> Any:
    return json.loads(text, object_pairs_hook=lambda pairs: Obj([list(p) for p in pairs]))


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def split(blob: bytes) -> tuple[Obj, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return loads(blob[8 : 8 + n]), blob[8 + n :]


def pack(header: Obj | str, payload: bytes) -> bytes:
    text = (header if isinstance(header, str) else dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + payload


def entries(header: Obj) -> list[list[Any]]:
    return [pair for pair in header if pair[0] != "__metadata__"]


# --- mutators: (files, rng) -> description; mutate ``files`` in place ---------------------


def _shard(files: dict[str, bytes], rng: random.Random) -> str:
    return rng.choice([n for n in SHARDS if n in files])


def _interesting_ints(value: int) -> list[Any]:
    return [
        0, 1, -1, value + 1, value - 1, value * 2, value // 2, value + 8, 1 << 31, 1 << 32,
        (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, 10**30,
        Raw("1.0"), Raw("1e3"), Raw('"7"'), Raw("null"), Raw("true"), Raw("-0"), Raw("9" * 5000),
    ]  # fmt: skip


def header_bitflip(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    blob = bytearray(files[name])
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    pos = rng.randrange(header_end)
    blob[pos] ^= 1 << rng.randrange(8)
    files[name] = bytes(blob)
    return f"{name}: flip a bit of byte {pos}"


def payload_bitflip(files: dict[str, bytes], rng: random.Random) -> str:
    # Bytes change, the structure does not: the load must match the reference exactly.
    name = _shard(files, rng)
    blob = bytearray(files[name])
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    pos = rng.randrange(header_end, len(blob))
    blob[pos] ^= 1 << rng.randrange(8)
    files[name] = bytes(blob)
    return f"{name}: flip a payload bit at {pos}"


def truncate(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    cut = rng.randrange(len(files[name]))
    files[name] = files[name][:cut]
    return f"{name}: truncate to {cut} bytes"


def append(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 17)))
    files[name] += extra
    return f"{name}: append {len(extra)} bytes"


def length_prefix(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    blob = files[name]
    n = struct.unpack("<Q", blob[:8])[0]
    value = rng.choice(
        [0, 1, 2, n - 1, n + 1, n - 8, n + 8, n // 2, len(blob) - 8, len(blob) - 7,
         100_000_000, 100_000_001, 1 << 32, (1 << 63), (1 << 64) - 1, rng.randrange(1 << 64)]
    )  # fmt: skip
    files[name] = struct.pack("<Q", value % (1 << 64)) + blob[8:]
    return f"{name}: header length {n} -> {value}"


def number(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    header, payload = split(files[name])
    leaves: list[tuple[list[Any], int, str]] = []
    zero_size: list[tuple[list[Any], int, str]] = []
    for tensor, info in entries(header):
        for pair in info:
            if pair[0] in ("shape", "data_offsets"):
                here = [(pair[1], i, f"{tensor}.{pair[0]}[{i}]") for i in range(len(pair[1]))]
                leaves.extend(here)
                if pair[0] == "shape" and 0 in pair[1]:
                    zero_size.extend(here)
    # A zero dimension hides the others from the byte count: worth a quarter of the tries.
    container, i, where = rng.choice(zero_size if zero_size and rng.random() < 0.25 else leaves)
    old = container[i]
    container[i] = rng.choice(_interesting_ints(old))
    if rng.random() < 0.25 and isinstance(container[i], int):  # some shapes grow a dimension
        container.insert(rng.randrange(len(container) + 1), rng.choice([0, 1, 2]))
    files[name] = pack(header, payload)
    return f"{name}: {where} {old} -> {dumps(container[i])}"


def key_delete(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    header, payload = split(files[name])
    pair = rng.choice(header)
    if pair[0] == "__metadata__" or rng.random() < 0.4:
        header.remove(pair)
        what = f"entry {pair[0]!r}"
    else:
        key = rng.choice(pair[1])
        pair[1].remove(key)
        what = f"{pair[0]}.{key[0]}"
    files[name] = pack(header, payload)
    return f"{name}: delete {what}"


def key_duplicate(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    header, payload = split(files[name])
    pair = rng.choice(header)
    choice = rng.randrange(3)
    if choice == 0:  # the same entry twice
        header.insert(rng.randrange(len(header) + 1), [pair[0], pair[1]])
        what = f"entry {pair[0]!r}"
    elif choice == 1:  # a field twice within an entry, maybe with another value
        key = rng.choice(pair[1])
        pair[1].append([key[0], rng.choice([key[1], Raw("[]"), Raw('"F32"'), Raw("[0,0]")])])
        what = f"{pair[0]}.{key[0]}"
    else:  # the other shard's entry copied in (a tensor in two files, if it parses)
        other = split(files[next(s for s in SHARDS if s != name)])[0] if len(SHARDS) > 1 else header
        donor = rng.choice(entries(other) or header)
        header.append([donor[0], donor[1]])
        what = f"entry {donor[0]!r} from the other shard"
    files[name] = pack(header, payload)
    return f"{name}: duplicate {what}"


_RENAMES = [
    "", "__metadata__", "extra.f32", "model.norm.weight", "x" * 300, "model.layers.\u00e9.w",
    "model.layers.1.mlp.experts.7.gate_proj.trellis",
    "model.layers.1.mlp.experts.0.gate_proj.bogus",
    "model.layers.1.mlp.experts.0.fused_proj.trellis",
    "model.layers.1.mlp.experts.0.gate_proj.rank0.trellis",
    "model.layers.1.mlp.experts.1000.gate_proj.trellis",
    "model.layers." + "9" * 5000 + ".mlp.experts.0.gate_proj.trellis",
    "model.layers.1.mlp.experts." + "9" * 5000 + ".gate_proj.suh",
    "model.layers.0.mlp.experts.0.gate_proj.trellis",
]  # fmt: skip


def key_rename(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    header, payload = split(files[name])
    pair = rng.choice(entries(header))
    old = pair[0]
    pair[0] = rng.choice([*_RENAMES, old + "_", old.replace("experts.0", "experts.1")])
    files[name] = pack(header, payload)
    if rng.random() < 0.5 and INDEX in files:  # keep the index consistent, half the time
        index = loads(files[INDEX])
        for key, value in index:
            if key == "weight_map" and isinstance(value, Obj):
                for entry in value:
                    if entry[0] == old:
                        entry[0] = pair[0]
        files[INDEX] = dumps(index).encode()
    return f"{name}: rename {old[:60]!r} -> {pair[0][:60]!r}"


_DTYPES = [
    *asyncslab.checkpoint._format.DTYPES,
    "F4", "F6_E2M3", "F8_E4M3FNUZ", "f32", "", "F32 ", Raw("5"), Raw("null"), Raw('["F32"]'),
    Raw("{}"),
]  # fmt: skip


def dtype_swap(files: dict[str, bytes], rng: random.Random) -> str:
    name = _shard(files, rng)
    header, payload = split(files[name])
    tensor, info = rng.choice(entries(header))
    field = next((p for p in info if p[0] == "dtype"), None)
    if field is None:
        return f"{name}: no dtype to swap"
    old = field[1]
    field[1] = rng.choice(_DTYPES)
    files[name] = pack(header, payload)
    return f"{name}: {tensor} dtype {old} -> {dumps(field[1])}"


def index_weight_map(index: Any) -> Obj | None:
    if isinstance(index, Obj):
        for key, value in index:
            if key == "weight_map" and isinstance(value, Obj):
                return value
    return None


def index_target(files: dict[str, bytes], rng: random.Random) -> str:
    index = loads(files[INDEX])
    weight_map = index_weight_map(index)
    if not weight_map:
        raise ValueError("no weight_map to mutate")
    entry = rng.choice(weight_map)
    old = entry[1]
    other = next(s for s in SHARDS if s != old)
    entry[1] = rng.choice(
        [
            other, "model-00003-of-00002.safetensors", "/" + old, "/etc/passwd", "../" + old,
            "sub/../" + old, "./" + old, "sub/" + old, "sub", "", ".", "..", INDEX,
            "README.md", old + "\x00", Raw("1"), Raw("null"), Raw('["' + old + '"]'),
            "\u00e9" + old,
        ]
    )  # fmt: skip
    if entry[1] in ("sub/" + old, "sub"):
        files["sub/" + old] = files.get(old, b"")
    files[INDEX] = dumps(index).encode()
    return f"index: {entry[0][:60]!r} -> {dumps(entry[1])[:60]}"


def index_entry(files: dict[str, bytes], rng: random.Random) -> str:
    index = loads(files[INDEX])
    weight_map = index_weight_map(index)
    if not weight_map:
        raise ValueError("no weight_map to mutate")
    entry = rng.choice(weight_map)
    choice = rng.randrange(4)
    if choice == 0:
        weight_map.remove(entry)
        what = f"delete {entry[0][:60]!r}"
    elif choice == 1:
        weight_map.append(["not.in.any.file", entry[1]])
        what = "add a tensor no file has"
    elif choice == 2:
        weight_map.append([entry[0], rng.choice(SHARDS)])
        what = f"duplicate key {entry[0][:60]!r}"
    else:
        entry[0] = entry[0] + ".renamed"
        what = f"rename {entry[0][:60]!r}"
    files[INDEX] = dumps(index).encode()
    return f"index: {what}"


def index_structure(files: dict[str, bytes], rng: random.Random) -> str:
    choice = rng.randrange(8)
    if choice == 0:
        del files[INDEX]  # a directory of shards without an index
        return "index: deleted"
    if choice == 1:
        blob = bytearray(files[INDEX])
        pos = rng.randrange(len(blob))
        blob[pos] ^= 1 << rng.randrange(8)
        files[INDEX] = bytes(blob)
        return f"index: flip a bit of byte {pos}"
    if choice == 2:
        files[INDEX] = files[INDEX][: rng.randrange(len(files[INDEX]))]
        return "index: truncated"
    replacements = [
        b"", b"[]", b'{"metadata": {}}', b'{"weight_map": []}', b'{"weight_map": null}',
        b'{"weight_map": {}}', b"\xff\xfe{}",
    ]  # fmt: skip
    files[INDEX] = rng.choice(replacements)
    return f"index: replaced by {files[INDEX][:40]!r}"


HEADER_MUTATORS: dict[str, Callable[[dict[str, bytes], random.Random], str]] = {
    f.__name__: f
    for f in (
        header_bitflip, payload_bitflip, truncate, append, length_prefix, number, key_delete,
        key_duplicate, key_rename, dtype_swap,
    )
}  # fmt: skip
INDEX_MUTATORS: dict[str, Callable[[dict[str, bytes], random.Random], str]] = {
    f.__name__: f for f in (index_target, index_entry, index_structure)
}
MUTATORS = {**HEADER_MUTATORS, **INDEX_MUTATORS}


def mutate(files: dict[str, bytes], kind: str, rng: random.Random) -> tuple[dict[str, bytes], str]:
    files = dict(files)
    mutator = MUTATORS[kind]
    if kind in INDEX_MUTATORS and INDEX not in files:
        return files, "index: already gone"
    try:
        return files, mutator(files, rng)
    except (ValueError, IndexError, TypeError, AttributeError, struct.error) as err:
        # An earlier mutation left nothing this one can parse; the files stay as they are.
        return files, f"{kind}: not applicable ({type(err).__name__})"


# --- running the pipeline -----------------------------------------------------------------


# Bugs the fuzzing found in files this suite does not own, reported and not yet fixed:
# (id, exception type, text in its message). An outcome matching one is "KNOWN:<id>" rather
# than "BUG", so the properties keep testing everything else; each has a strict xfail test
# in tests/test_fuzz.py that starts failing (XPASS) once it is fixed, as a reminder to
# delete it here.
KNOWN_BUGS: list[tuple[str, type[BaseException], str]] = [
    # Found by this suite and since fixed (each now has a regression test in tests/test_fuzz.py):
    # moe-int-digits (a layer/expert number past int()'s 4,300 digits), index-nul-byte (a
    # NUL in an index file name), moe-huge-expert-index (experts.10**20 sized a partition).
]


def known_bug(err: BaseException) -> str | None:
    for name, kind, text in KNOWN_BUGS:
        if type(err) is kind and text in str(err):
            return name
    return None


@dataclass(frozen=True)
class Outcome:
    """``status``: ``accepted``, an :class:`AsyncSlabError` subclass name, ``KNOWN:<id>``
    (see :data:`KNOWN_BUGS`) or ``BUG``."""

    status: str
    reference: str  # "accepts" / "refuses" / "n/a"
    detail: str

    @property
    def bug(self) -> bool:
        return self.status == "BUG"


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _reference_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor] | str:
    """What safetensors reads from the same files, or why it refuses them."""
    out: dict[str, torch.Tensor] = {}
    try:
        for shard in ckpt.files:
            with safe_open(shard.path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    out[name] = f.get_tensor(name)
    except Exception as err:  # noqa: BLE001 - any refusal by the reference counts
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def run_pipeline(root: Path, loop: str = "asyncio") -> Outcome:
    """Open, plan and load ``root``; classify how it ended (never raises)."""
    factory = uvloop.new_event_loop if loop == "uvloop" and uvloop else asyncio.new_event_loop
    try:
        ckpt = Checkpoint.open(root)
        p = asyncslab.plan(ckpt)
        with asyncio.Runner(loop_factory=factory) as runner:
            slabs = runner.run(asyncslab.load(ckpt, p, options=OPTIONS))
            try:
                views = {r.tensor: slabs.view(r.tensor) for r in p.routes}
                reference = _reference_tensors(ckpt)
                if isinstance(reference, str):
                    return Outcome("accepted", "refuses", reference)
                for name, got in views.items():
                    want = reference.get(name)
                    if (
                        want is None
                        or got.dtype != want.dtype
                        or got.shape != want.shape
                        or not torch.equal(_raw(got), _raw(want))
                    ):
                        return Outcome("BUG", "accepts", f"{name}: differs from the reference")
                if slabs.statistics().state != "complete":
                    return Outcome("BUG", "accepts", f"state {slabs.statistics().state}")
            finally:
                runner.run(slabs.aclose())
        return Outcome("accepted", "accepts", "")
    except AsyncSlabError as err:
        return Outcome(type(err).__name__, "n/a", str(err)[:300])
    except Exception as err:  # noqa: BLE001 - anything else is what the fuzzing looks for
        known = known_bug(err)
        status = f"KNOWN:{known}" if known else "BUG"
        return Outcome(status, "n/a", traceback.format_exc())

"""The hand-written header and index readers against readers built on orjson and msgspec.

    python -m benchmarks.header_parsers [--tensors 1000,290000,1000000] [--rounds 5]
        [--readers orjson,msgspec] [--kinds header,index] [--no-memory]

For each count, writes (in memory) one safetensors header of that many tensors, laid out as
``safetensors.torch.save_file`` writes it (compact JSON, ``__metadata__`` first, entries in
payload order: by dtype, then name; checked against ``safetensors`` itself on a
small sample), and an index of as many entries as transformers writes it (indented, sorted
keys). Then times each reader on the same text, interleaved round by round, with the
collector paused as ``Checkpoint.open`` runs them (median of ``--rounds``), and measures each
reader's peak memory in a child process of its own: Python's allocations (``tracemalloc``)
and the resident set's high-water mark over the text already read (``VmHWM``).

Every library reader gives what the hand-written one gives (the same columns, the same
names and files), with the same acceptance: what it cannot settle (a repeated key, ``-0``,
an escape it would read otherwise) it declines, for the general parser to decide, as the
hand-written one does.

The first row is asyncslab's own fast reader: for the index the hand-written whole-text
reader (``_weight_map_compact``), for a header the hand-written one (``parse_compact``).
Ratios are to that row. (msgspec alone measured even with it on a header, but made
``Checkpoint.open`` slower: benchmarks/runs/2026-12-07-1338-header-parsers.md.)

The readers. headers: asyncslab's, ``general (json)`` (``parse_general``),
``orjson`` (``orjson.loads``, then columns by ``map``), ``msgspec`` (``msgspec.json`` into a
typed ``Struct``, then columns by ``map``); floors: bare ``json.loads``, ``orjson.loads``,
``msgspec.json.decode`` (nothing checked).
index: asyncslab's, ``general (json)`` (``_parse_index``),
``orjson``, ``msgspec`` (typed ``dict[str, str]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import operator
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import orjson
import torch
from safetensors.torch import save

from asyncslab.checkpoint import _header_parse, _index
from asyncslab.checkpoint._header_parse import (
    _ITEMSIZE,
    _U64,
    DTYPES,
    Kind,
    _Columns,
    _numbered,
    parse_general,
)
from asyncslab.checkpoint._index import _parse_index

HERE = Path("<bench>")
PROJS = ("gate_proj", "up_proj", "down_proj")
# EXL3-like: per projection a trellis, two sign vectors and two scalars.
KINDS = {
    "trellis": ("I16", [8, 16, 256]),
    "suh": ("F16", [2048]),
    "svh": ("F16", [1536]),
    "mcg": ("I32", [1]),
    "mul1": ("I32", [1]),
}
# safetensors orders a file's payload by dtype, in the reverse of its Dtype enum's order
# (F32 > I32 > F16 > I16 among these), then by name.
RANK = {"I16": 0, "F16": 1, "I32": 2, "F32": 3}


# --------------------------------------------------------------------------- the texts


def names(total: int) -> list[str]:
    """GLM-5.2-like names: layers x 256 experts x 3 projections x 5 suffixes."""
    out: list[str] = []
    layer = 0
    while len(out) < total:
        for expert in range(256):
            for proj in PROJS:
                for suffix in KINDS:
                    out.append(f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{suffix}")
        layer += 1
    return out[:total]


def header_text(entries: list[tuple[str, str, list[int]]], metadata: dict[str, str]) -> str:
    """The header ``safetensors`` writes for these tensors: payload order is by dtype
    (``RANK``, highest first), then name; compact JSON, metadata first, padded to 8."""
    order = sorted(entries, key=lambda e: (-RANK[e[1]], e[0]))
    obj: dict[str, Any] = {"__metadata__": metadata}
    position = 0
    for name, st, shape in order:
        size = math.prod(shape) * _ITEMSIZE[st]
        obj[name] = {"dtype": st, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    text = json.dumps(obj, separators=(",", ":"))
    return text + " " * (-(len(text) + 8) % 8)


def check_layout() -> None:
    """The synthetic layout is the one ``safetensors`` writes (a small sample)."""
    small = [(f"m.{i}.{s}", st, [2, 3][: i % 3]) for i in range(6) for s, (st, _) in KINDS.items()]
    tensors = {n: torch.zeros(shape, dtype=DTYPES[st]) for n, st, shape in small}
    # One metadata key: safetensors writes several in a hash map's order.
    blob = save(tensors, metadata={"format": "pt"})
    (n,) = struct.unpack("<Q", blob[:8])
    mine = header_text(small, {"format": "pt"})
    assert blob[8 : 8 + n].decode() == mine, "synthetic header differs from safetensors'"


def texts(total: int) -> tuple[str, str]:
    """One header of ``total`` tensors, and an index of as many entries over shards of
    about 9,000 tensors each, as transformers writes it."""
    all_names = names(total)
    entries = [(n, *KINDS[n.rsplit(".", 1)[1]]) for n in all_names]
    header = header_text(entries, {"format": "pt"})  # type: ignore[arg-type]
    files = max(1, round(total / 9000))
    per = -(-total // files)
    weight_map = {
        n: f"model-{i // per + 1:05d}-of-{files:05d}.safetensors" for i, n in enumerate(all_names)
    }
    index = {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}
    return header, json.dumps(index, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- readers


def columns_of(
    metadata: dict[str, str],
    names: list[str],
    keys: list[tuple[str, tuple[int, ...]]],
    begins: list[int],
    ends: list[int],
) -> _Columns | None:
    """Decoded entries to the columns ``parse_general`` gives, checked by whole-column
    operations; ``None`` for anything ``parse_general`` should decide. Keys are hashed
    twice, then entries are numbers."""
    distinct = list(dict.fromkeys(keys))
    kinds: list[Kind] = []
    for st, shape in distinct:
        itemsize = _ITEMSIZE.get(st)
        if itemsize is None or any(type(d) is not int or d < 0 for d in shape):
            return None
        size = math.prod(shape) * itemsize
        if size >= _U64 or math.prod(filter(None, shape)) * itemsize >= _U64:
            return None
        kinds.append((st, DTYPES[st], shape, size))
    if not names:
        return _Columns(metadata, [], [], [], [])
    number = dict(zip(distinct, range(len(distinct)), strict=True))
    ids = list(map(number.__getitem__, keys))
    sizes = [kind[3] for kind in kinds]
    nbytes = list(map(operator.sub, ends, begins))
    if min(begins) < 0 or max(ends) >= _U64 or nbytes != list(map(sizes.__getitem__, ids)):
        return None
    if begins[0] != 0 or begins[1:] != ends[:-1] or 0 in nbytes:
        order = sorted(range(len(names)), key=lambda i: (begins[i], ends[i], names[i]))
        names, ids = list(map(names.__getitem__, order)), list(map(ids.__getitem__, order))
        begins, ends = list(map(begins.__getitem__, order)), list(map(ends.__getitem__, order))
        if begins[0] != 0 or begins[1:] != ends[:-1]:
            return None
        kinds, ids = _numbered(ids, dict(enumerate(kinds)))
    return _Columns(metadata, names, kinds, ids, begins)


_META = json.JSONDecoder(object_pairs_hook=tuple)


def split_metadata(text: str) -> tuple[dict[str, str], str] | None:
    """``__metadata__`` when it comes first (as writers put it), and the rest of the
    object without it."""
    if not text.startswith('{"__metadata__":'):
        return {}, text
    try:
        raw, end = _META.raw_decode(text, 16)
    except ValueError:
        return None
    if type(raw) is not tuple or text[end : end + 1] != ",":
        return None
    metadata = dict(raw)
    if len(metadata) != len(raw) or not all(type(v) is str for v in metadata.values()):
        return None
    return metadata, "{" + text[end + 1 :]


U64 = Annotated[int, msgspec.Meta(ge=0)]  # the 64-bit bound: columns_of


class Entry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    data_offsets: tuple[U64, U64]


_HEADER = msgspec.json.Decoder(dict[str, Entry])
_GET_DTYPE = operator.attrgetter("dtype")
_GET_SHAPE = operator.attrgetter("shape")
_GET_OFFSETS = operator.attrgetter("data_offsets")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def msgspec_header(text: str) -> _Columns | None:
    """msgspec into typed entries. A repeated name or field decodes silently (the last
    wins): with the entries typed, the only objects are the top one and one per entry and
    every entry has three fields, so the text's ``{`` and ``:`` (each at least the number
    outside strings) count exactly ``1 + n`` and ``4n`` only when nothing repeats."""
    if "-0" in text:  # msgspec reads it as the integer 0; the reference refuses it
        return None
    split = split_metadata(text)
    if split is None:
        return None
    metadata, rest = split
    try:
        obj = _HEADER.decode(rest)
    except msgspec.DecodeError:
        return None
    n = len(obj)
    if rest.count("{") != 1 + n or rest.count(":") != 4 * n or "__metadata__" in obj:
        return None
    entries = list(obj.values())
    offsets = list(map(_GET_OFFSETS, entries))
    return columns_of(
        metadata,
        list(obj),
        list(zip(map(_GET_DTYPE, entries), map(_GET_SHAPE, entries), strict=True)),
        list(map(_FIRST, offsets)),
        list(map(_SECOND, offsets)),
    )


_GET_ENTRY = operator.itemgetter("dtype", "shape", "data_offsets")


def orjson_header(text: str) -> _Columns | None:
    """orjson into dicts and lists. orjson reads an integer past 64 bits as a float and
    a repeated key silently (the last wins): types are checked a column at a time, and
    repeats by counting ``{`` and ``:`` as for msgspec."""
    if "-0" in text:
        return None
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    metadata = obj.pop("__metadata__", None)
    keys_meta = 0
    if metadata is not None:
        if type(metadata) is not dict or set(map(type, metadata.values())) - {str}:
            return None
        keys_meta = 1 + len(metadata)
    n = len(obj)
    objects = 1 + n + (metadata is not None)
    if text.count("{") != objects or text.count(":") != 4 * n + keys_meta:
        return None
    entries = list(obj.values())
    if set(map(type, entries)) - {dict}:
        return None
    try:
        triples = list(map(_GET_ENTRY, entries))
    except KeyError:
        return None
    shapes = list(map(_SECOND, triples))
    offsets = list(map(operator.itemgetter(2), triples))
    if set(map(type, shapes)) - {list} or set(map(type, offsets)) - {list}:
        return None
    if set(map(len, offsets)) - {2}:
        return None
    begins = list(map(_FIRST, offsets))
    ends = list(map(_SECOND, offsets))
    if set(map(type, begins)) - {int} or set(map(type, ends)) - {int}:
        return None
    dtypes = list(map(_FIRST, triples))
    if set(map(type, dtypes)) - {str}:
        return None
    return columns_of(
        metadata or {}, list(obj), list(zip(dtypes, map(tuple, shapes), strict=True)), begins, ends
    )


def _keys(value: Any) -> int:
    """How many keys the decoded value holds, nested ones included."""
    if type(value) is dict:
        return len(value) + sum(map(_keys, value.values()))
    if type(value) is list:
        return sum(map(_keys, value))
    return 0


def _weight_map_lists(text: str, top: Any) -> tuple[list[str], list[str]] | None:
    """The decoded index's map as lists, if nothing repeated: every key of the document is
    a ``:`` outside strings, and the text's count is at least that."""
    if type(top) is not dict:
        return None
    weight_map = top.pop("weight_map", None)
    if type(weight_map) is not dict:
        return None
    if text.count(":") != 1 + len(weight_map) + _keys(top):
        return None
    files = list(weight_map.values())
    if set(map(type, files)) - {str}:
        return None
    return list(weight_map), files


def orjson_index(text: str) -> tuple[list[str], list[str]] | None:
    try:
        top = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return _weight_map_lists(text, top)


class IndexDoc(msgspec.Struct):
    weight_map: dict[str, str]
    metadata: Any = None


_INDEX = msgspec.json.Decoder(IndexDoc)


def msgspec_index(text: str) -> tuple[list[str], list[str]] | None:
    """msgspec's typed map; other top-level keys are skipped, so not counted: any such
    key leaves the count short, and the text goes to the general parser."""
    try:
        doc = _INDEX.decode(text)
    except msgspec.DecodeError:
        return None
    wm = doc.weight_map
    if text.count(":") != 1 + len(wm) + (doc.metadata is not None) + _keys(doc.metadata):
        return None
    return list(wm), list(wm.values())


# --------------------------------------------------------------------------- measuring

Reader = Callable[[str], Any]


def general_index(text: str) -> tuple[list[str], list[str]]:
    wm = _parse_index(text, HERE)
    return list(wm), list(wm.values())


_FAST_HEADER: Reader = _header_parse.parse_compact
_FAST_INDEX: Reader = _index._weight_map_compact
OURS = "hand-written"

HEADER_READERS: dict[str, Reader] = {
    OURS: _FAST_HEADER,
    "general (json)": lambda text: parse_general(text, HERE),
    "orjson": orjson_header,
    "msgspec": msgspec_header,
    "bare json.loads": json.loads,
    "bare orjson.loads": orjson.loads,
    "bare msgspec decode": msgspec.json.decode,
}
INDEX_READERS: dict[str, Reader] = {
    OURS: _FAST_INDEX,
    "general (json)": general_index,
    "orjson": orjson_index,
    "msgspec": msgspec_index,
    "bare json.loads": json.loads,
    "bare orjson.loads": orjson.loads,
    "bare msgspec decode": msgspec.json.decode,
}
READERS = {"header": HEADER_READERS, "index": INDEX_READERS}


def check_same(header: str, index: str) -> None:
    """Every reader that is not a floor gives what the general parser gives."""
    want = parse_general(header, HERE)
    for name, read in HEADER_READERS.items():
        if not name.startswith("bare"):
            assert read(header) == want, f"header: {name} differs"
    want_index = general_index(index)
    for name, read in INDEX_READERS.items():
        if not name.startswith("bare"):
            assert read(index) == want_index, f"index: {name} differs"


def time_readers(readers: dict[str, Reader], text: str, rounds: int) -> dict[str, float]:
    """Median seconds of each reader, rounds interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(rounds):
        for name, read in readers.items():
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                result = read(text)
                times[name].append(time.perf_counter() - t0)
            finally:
                gc.enable()
            del result
    return {name: statistics.median(ts) for name, ts in times.items()}


def _hwm_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def child(kind: str, reader: str, path: str) -> None:
    """In a fresh process: one reader once, its peak Python allocations, then (a second
    call) the resident high-water mark it adds over the text."""
    text = Path(path).read_text()
    read = READERS[kind][reader]
    gc.disable()
    base = _hwm_kib()
    result = read(text)
    rss = _hwm_kib() - base
    del result
    tracemalloc.start()
    read(text)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"rss_kib": rss, "traced": peak}))


def memory(kind: str, reader: str, path: Path) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, reader, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def table(kind: str, total: int, text: str, rounds: int, tmp: Path | None) -> list[str]:
    readers = READERS[kind]
    med = time_readers(readers, text, rounds)
    mem = {name: {"traced": 0, "rss_kib": 0} for name in readers}
    if tmp is not None:
        path = tmp / f"{kind}.json"
        path.write_text(text)
        mem = {name: memory(kind, name, path) for name in readers}
    base = med[OURS]
    lines = [
        f"{kind}, {total:,} entries, {len(text) / 1e6:.1f} MB of text, median of {rounds}:",
        f"  {'reader':<20} {'time':>9} {'x ours':>7} {'us/entry':>9} "
        f"{'peak traced':>12} {'x ours':>7} {'peak RSS +':>11}",
    ]
    mbase = mem[OURS]["traced"] or 1
    for name in readers:
        m = mem[name]
        lines.append(
            f"  {name:<20} {med[name] * 1e3:>7.1f}ms {med[name] / base:>7.2f} "
            f"{med[name] / total * 1e6:>9.2f} {m['traced'] / 1e6:>10.1f}MB "
            f"{m['traced'] / mbase:>7.2f} {m['rss_kib'] / 1e3:>9.1f}MB"
        )
    return lines


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="1000,290000,1000000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--readers", default="", help="only these rows (comma-separated names)")
    ap.add_argument("--kinds", default="header,index")
    ap.add_argument("--no-memory", action="store_true", help="time only: no child processes")
    args = ap.parse_args()
    if args.readers:
        keep = {OURS, *args.readers.split(",")}
        for readers in READERS.values():
            for name in [name for name in readers if name not in keep]:
                del readers[name]
    check_layout()
    print(
        f"python {sys.version.split()[0]}, orjson {orjson.__version__}, "
        f"msgspec {msgspec.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="asyncslab-parsers-") as tmp:
        for total in map(int, args.tensors.split(",")):
            header, index = texts(total)
            check_same(header, index)
            for kind, text in (("header", header), ("index", index)):
                if kind not in args.kinds.split(","):
                    continue
                where = None if args.no_memory else Path(tmp)
                print("\n".join(table(kind, total, text, args.rounds, where)), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

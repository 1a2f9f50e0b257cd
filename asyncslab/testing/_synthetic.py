"""Synthetic EXL3-like mixed-tier MoE checkpoints, written with the real ``safetensors``.

Tests, the demo and the benchmarks need checkpoints that look like the ones the
loader meets in the wild (GLM/DeepSeek layer layout, EXL3 trellis tensors with a
per-expert bit width, experts split over shard files, optional tensor-parallel
pre-slicing) without shipping or downloading real weights. Everything here is a
pure function of the :class:`SyntheticSpec`, so two writes of one spec are
byte-identical and a test can recompute what it expects instead of storing it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import random
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

__all__ = [
    "SyntheticCheckpoint",
    "SyntheticSpec",
    "expected_tensors",
    "payload_bytes",
    "spec_for_size",
    "write_synthetic",
]

_MiB = 1 << 20
_GiB = 1 << 30

_PROJS = ("gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

# Share of each MoE layer's experts put on the lowest tier: GLM-4.x EXL3 mixes
# put 148 of 256 experts at 3 bits, so this keeps tier populations realistic.
_LOW_TIER_SHARE = 0.58

# Arbitrary but fixed marker values. They are not randomised so that a loader
# test can check it read the right bytes for the 4-byte marker tensors, which
# are too small to be distinguished reliably by random content.
MCG_MARKER = 0x4AFEF00D
MUL1_MARKER = 0x03DCD12D

# Dtypes the random fill can sample directly (CPU normal_ has no float8 kernel).
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Above this size random fill (torch's samplers, far slower than writing the files)
# becomes the bottleneck, so spec_for_size switches to the pattern fill (rates in
# docs/performance.md).
_PATTERN_ABOVE = 256 * _MiB
# Largest file spec_for_size aims for, so multi-GB checkpoints are written (and
# held in memory) one ~1 GiB shard at a time.
_MAX_SHARD_BYTES = _GiB


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Shape of a synthetic checkpoint.

    Defaults give a ~4.5 MB, three-shard checkpoint: big enough to hit every code
    path (dense and MoE layers, two tiers, experts straddling files), small
    enough for unit tests.
    """

    n_layers: int = 4
    first_dense: int = 1
    n_experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    bits: tuple[int, ...] = (3, 4)
    tp_ranks: int = 1
    n_shards: int = 3
    vocab: int = 512
    shared_experts: bool = True
    markers: bool = True
    seed: int = 0
    fill: Literal["random", "pattern"] = "random"
    dense_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        # Normalise so that lists are accepted and the spec stays hashable.
        object.__setattr__(self, "bits", tuple(self.bits))
        for name in (
            "n_layers",
            "n_experts",
            "hidden",
            "intermediate",
            "tp_ranks",
            "n_shards",
            "vocab",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.first_dense, int) or not 0 <= self.first_dense <= self.n_layers:
            raise ValueError(f"first_dense must be in [0, n_layers], got {self.first_dense!r}")
        if self.hidden % 16:
            raise ValueError(f"hidden must be a multiple of 16 (EXL3 tiles), got {self.hidden}")
        if self.intermediate % (16 * self.tp_ranks):
            raise ValueError(
                f"intermediate must be a multiple of 16 * tp_ranks = {16 * self.tp_ranks}, "
                f"got {self.intermediate}"
            )
        if not self.bits or len(set(self.bits)) != len(self.bits):
            raise ValueError(f"bits must be non-empty and without duplicates, got {self.bits!r}")
        if any(not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8 for k in self.bits):
            raise ValueError(f"each tier in bits must be an int in [1, 8], got {self.bits!r}")
        if self.fill not in ("random", "pattern"):
            raise ValueError(f"fill must be 'random' or 'pattern', got {self.fill!r}")
        if self.dense_dtype not in _DENSE_DTYPES:
            raise ValueError(
                f"dense_dtype must be one of {_DENSE_DTYPES}, got {self.dense_dtype!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        n_tensors = _count_tensors(self)
        if self.n_shards > n_tensors:
            raise ValueError(
                f"n_shards={self.n_shards} exceeds the {n_tensors} tensors to distribute"
            )


@dataclass(frozen=True, slots=True)
class SyntheticCheckpoint:
    """What :func:`write_synthetic` produced, so callers need not re-derive paths or tiers."""

    root: Path
    files: tuple[Path, ...]
    index: Path | None
    tier_map_path: Path
    # Read-only view; excluded from hashing because mapping proxies are unhashable.
    tier_map: Mapping[int, Mapping[int, int]] = field(hash=False)
    spec: SyntheticSpec
    total_bytes: int
    n_tensors: int


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of the layout; ``group``/``proj`` let the sharder find cuts inside an expert."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: Literal["dense", "norm", "trellis", "scale", "mcg", "mul1"]
    group: tuple[int, int] | None = None  # (layer, expert) for routed-expert tensors
    proj: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------- layout


def _moe_layers(spec: SyntheticSpec) -> range:
    return range(spec.first_dense, spec.n_layers)


def _count_tensors(spec: SyntheticSpec) -> int:
    """Closed form of len(expected_tensors(spec)); cheap enough for validation of huge specs."""
    per_expert = 3 * spec.tp_ranks * (5 if spec.markers else 3)
    moe = 1 + (3 if spec.shared_experts else 0) + spec.n_experts * per_expert
    n_moe = spec.n_layers - spec.first_dense
    return 3 + 6 * spec.n_layers + 3 * spec.first_dense + moe * n_moe


def _draw_tiers(spec: SyntheticSpec) -> dict[int, dict[int, int]]:
    """Seeded per-layer tier draw.

    Independent draws per expert (rather than fixed quotas) make tier
    populations vary between layers as in real mixed-precision quants; the
    repair step then guarantees every tier is non-empty per layer, so code
    grouping experts by tier always sees every group.
    """
    rng = random.Random(spec.seed)
    tiers = sorted(spec.bits)
    low, higher = tiers[0], tiers[1:]
    out: dict[int, dict[int, int]] = {}
    for layer in _moe_layers(spec):
        draw = {}
        for expert in range(spec.n_experts):
            if not higher or rng.random() < _LOW_TIER_SHARE:
                draw[expert] = low
            else:
                draw[expert] = rng.choice(higher)
        if spec.n_experts >= len(tiers):
            for tier in tiers:
                if tier in draw.values():
                    continue
                counts = {t: sum(1 for b in draw.values() if b == t) for t in tiers}
                donor = max(tiers, key=lambda t: (counts[t], -t))
                # Pigeonhole: with a tier empty and n_experts >= len(tiers), the
                # donor holds at least two experts, so it stays non-empty.
                victim = rng.choice([e for e, b in draw.items() if b == donor])
                draw[victim] = tier
        out[layer] = draw
    return out


def _layout(spec: SyntheticSpec, tiers: Mapping[int, Mapping[int, int]]) -> Iterator[_Entry]:
    """Tensors in file order: layer by layer, each expert's tensors adjacent, as shard cuts need."""
    H, inter, dd = spec.hidden, spec.intermediate, spec.dense_dtype
    inter_local = inter // spec.tp_ranks
    yield _Entry("model.embed_tokens.weight", dd, (spec.vocab, H), "dense")
    for layer in range(spec.n_layers):
        p = f"model.layers.{layer}"
        yield _Entry(f"{p}.input_layernorm.weight", dd, (H,), "norm")
        for a in _ATTN:
            yield _Entry(f"{p}.self_attn.{a}.weight", dd, (H, H), "dense")
        yield _Entry(f"{p}.post_attention_layernorm.weight", dd, (H,), "norm")
        if layer < spec.first_dense:
            yield _Entry(f"{p}.mlp.gate_proj.weight", dd, (inter, H), "dense")
            yield _Entry(f"{p}.mlp.up_proj.weight", dd, (inter, H), "dense")
            yield _Entry(f"{p}.mlp.down_proj.weight", dd, (H, inter), "dense")
            continue
        yield _Entry(f"{p}.mlp.gate.weight", dd, (spec.n_experts, H), "dense")
        if spec.shared_experts:
            yield _Entry(f"{p}.mlp.shared_experts.gate_proj.weight", dd, (inter, H), "dense")
            yield _Entry(f"{p}.mlp.shared_experts.up_proj.weight", dd, (inter, H), "dense")
            yield _Entry(f"{p}.mlp.shared_experts.down_proj.weight", dd, (H, inter), "dense")
        for expert in range(spec.n_experts):
            k = tiers[layer][expert]
            group = (layer, expert)
            for proj in _PROJS:
                n_in, n_out = (H, inter_local) if proj != "down_proj" else (inter_local, H)
                for rank in range(spec.tp_ranks):
                    base = f"{p}.mlp.experts.{expert}.{proj}"
                    if spec.tp_ranks > 1:
                        base = f"{base}.rank{rank}"
                    yield _Entry(
                        f"{base}.trellis",
                        torch.int16,
                        (n_in // 16, n_out // 16, 16 * k),
                        "trellis",
                        group,
                        proj,
                    )
                    yield _Entry(f"{base}.suh", torch.float16, (n_in,), "scale", group, proj)
                    yield _Entry(f"{base}.svh", torch.float16, (n_out,), "scale", group, proj)
                    if spec.markers:
                        yield _Entry(f"{base}.mcg", torch.int32, (), "mcg", group, proj)
                        yield _Entry(f"{base}.mul1", torch.int32, (1,), "mul1", group, proj)
    yield _Entry("model.norm.weight", dd, (H,), "norm")
    yield _Entry("lm_head.weight", dd, (spec.vocab, H), "dense")


def expected_tensors(spec: SyntheticSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of what :func:`write_synthetic` writes; tests need no fixtures."""
    return {e.name: (e.dtype, e.shape) for e in _layout(spec, _draw_tiers(spec))}


def _bytes_for(spec: SyntheticSpec, bits_sum_per_layer: Sequence[float]) -> float:
    """Closed-form payload size, so spec_for_size can search without materialising layouts.

    ``bits_sum_per_layer[i]`` is the sum of expert bit widths in the i-th MoE layer
    (exact from a tier draw, or an expectation while searching).
    """
    H, inter, tp = spec.hidden, spec.intermediate, spec.tp_ranks
    dsz = spec.dense_dtype.itemsize
    total: float = (2 * spec.vocab * H + H) * dsz
    per_layer_common = (2 * H + 4 * H * H) * dsz
    total += spec.n_layers * per_layer_common
    total += spec.first_dense * 3 * inter * H * dsz
    n_moe = spec.n_layers - spec.first_dense
    moe_fixed = spec.n_experts * H * dsz + (3 * inter * H * dsz if spec.shared_experts else 0)
    # Per expert, over 3 projections and all ranks: suh + svh fp16, plus markers.
    per_expert_fixed = 6 * (tp * H + inter) + (24 * tp if spec.markers else 0)
    total += n_moe * (moe_fixed + spec.n_experts * per_expert_fixed)
    # Trellis: K bits per weight; over ranks each projection holds H * intermediate weights.
    total += sum(3 * H * inter * s / 8 for s in bits_sum_per_layer)
    return total


def payload_bytes(spec: SyntheticSpec) -> int:
    """The tensor bytes :func:`write_synthetic` writes for ``spec``, from its layout alone."""
    tiers = _draw_tiers(spec)
    return int(_bytes_for(spec, [sum(t.values()) for t in tiers.values()]))


# --------------------------------------------------------------------------- sharding


def _shard_cuts(entries: Sequence[_Entry], n_shards: int) -> list[int]:
    """Start index of each shard: roughly equal bytes, preferring cuts inside an expert.

    A loader must cope with one expert's projections living in two files; real
    checkpoints do this by accident, here we make it happen on purpose by
    snapping each ideal cut to the nearest projection boundary inside an expert
    when one lies within an eighth of a shard's worth of bytes.
    """
    n = len(entries)
    cum = [0]
    for e in entries:
        cum.append(cum[-1] + e.nbytes)
    total = cum[-1]
    inner = [
        k
        for k in range(1, n)
        if entries[k].group is not None
        and entries[k].group == entries[k - 1].group
        and entries[k].proj != entries[k - 1].proj
    ]
    inner_pos = [cum[k] for k in inner]
    tolerance = total / n_shards / 8

    def nearest(positions: Sequence[int], target: float) -> int | None:
        j = bisect.bisect_left(positions, target)
        best = [i for i in (j - 1, j) if 0 <= i < len(positions)]
        return min(best, key=lambda i: (abs(positions[i] - target), i)) if best else None

    cuts = [0]
    for i in range(1, n_shards):
        ideal = total * i / n_shards
        j = nearest(inner_pos, ideal)
        if j is not None and abs(inner_pos[j] - ideal) <= tolerance:
            k = inner[j]
        else:
            near = nearest(cum[1:n], ideal)
            k = 1 if near is None else near + 1
        # Every shard must keep at least one tensor.
        k = min(max(k, cuts[-1] + 1), n - (n_shards - i))
        cuts.append(k)
    return cuts


def _shard_names(n_shards: int) -> list[str]:
    if n_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


# --------------------------------------------------------------------------- content

# Odd 64-bit multipliers (golden ratio and a splitmix constant), as signed int64.
_K_WORD = 0x9E3779B97F4A7C15 - (1 << 64)
_K_BLOCK = 0xD1B54A32D192ED03 - (1 << 64)
_PATTERN_BLOCK = 1 << 16  # words; 512 KiB of int64 stays in cache while broadcasting
_pattern_base: torch.Tensor | None = None


def _tensor_key(seed: int, name: str) -> int:
    """64-bit key from (seed, name): stable across processes and platforms, unlike hash()."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _fill_random(entry: _Entry, key: int, dense_dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(key & 0x7FFFFFFFFFFFFFFF)
    if entry.kind == "trellis":
        return torch.randint(-32768, 32768, entry.shape, dtype=torch.int16, generator=g)
    # Sampled straight in the target dtype with mean/std applied by the sampler:
    # no float32 temporaries (fresh pages are costly) and no separate
    # multithreaded scaling pass (its OpenMP barrier stalls on a busy machine).
    if entry.kind == "scale":
        return torch.normal(0.0, 1.0, entry.shape, generator=g, dtype=torch.float16)
    if entry.kind == "norm":
        return torch.normal(1.0, 0.01, entry.shape, generator=g, dtype=dense_dtype)
    return torch.normal(0.0, 0.02, entry.shape, generator=g, dtype=dense_dtype)


def _fill_pattern(entry: _Entry, key: int) -> torch.Tensor:
    """Cheap per-tensor-distinct bytes for multi-GB checkpoints.

    Word j of block i is ``(j * K_WORD) ^ (i * K_BLOCK) ^ key``: one broadcast
    XOR pass (its cost is the page faults of the output), distinct per tensor via the key
    and per block via the block term, so an offset error of a whole block is
    still visible in a byte-exact comparison. Bytes are reinterpreted as the
    target dtype, so float tensors may hold any bit pattern, NaNs included.
    """
    global _pattern_base
    if _pattern_base is None:
        _pattern_base = torch.arange(_PATTERN_BLOCK, dtype=torch.int64) * _K_WORD
    nbytes = entry.nbytes
    word_dtype = next(
        d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0
    )
    n_words = nbytes // word_dtype.itemsize
    base = _pattern_base.view(word_dtype)
    signed_key = key - (1 << 64) if key >= 1 << 63 else key
    key_t = torch.tensor(signed_key, dtype=torch.int64)
    if word_dtype is not torch.int64:
        key_t = key_t.reshape(1).view(word_dtype)[0]
    out = torch.empty(n_words, dtype=word_dtype)
    block = base.numel()
    n_full, rem = divmod(n_words, block)
    if n_full:
        block_keys = (torch.arange(n_full, dtype=torch.int64) * _K_BLOCK).view(-1, 1)
        if word_dtype is not torch.int64:
            block_keys = block_keys.view(word_dtype)[:, :1]
        torch.bitwise_xor(base, block_keys ^ key_t, out=out[: n_full * block].view(n_full, block))
    if rem:
        torch.bitwise_xor(base[:rem], key_t, out=out[n_full * block :])
    return out.view(entry.dtype).reshape(entry.shape)


def _materialise(entry: _Entry, spec: SyntheticSpec) -> torch.Tensor:
    if entry.kind == "mcg":
        return torch.tensor(MCG_MARKER, dtype=torch.int32)
    if entry.kind == "mul1":
        return torch.tensor([MUL1_MARKER], dtype=torch.int32)
    key = _tensor_key(spec.seed, entry.name)
    if spec.fill == "pattern":
        return _fill_pattern(entry, key)
    return _fill_random(entry, key, spec.dense_dtype)


# --------------------------------------------------------------------------- public API


def _save_shard(path: Path, spec: SyntheticSpec, entries: Sequence[_Entry]) -> int:
    tensors = {e.name: _materialise(e, spec) for e in entries}
    save_file(tensors, path, metadata={"format": "pt"})
    return sum(e.nbytes for e in entries)


def _write_shard(job: tuple[str, SyntheticSpec, int, int]) -> int:
    """Shard ``index`` of ``spec``, in a worker process of write_synthetic (with its share
    of the cores for torch's threads); returns its payload bytes."""
    directory, spec, index, threads = job
    torch.set_num_threads(threads)
    entries = list(_layout(spec, _draw_tiers(spec)))
    cuts = [*_shard_cuts(entries, spec.n_shards), len(entries)]
    path = Path(directory) / _shard_names(spec.n_shards)[index]
    return _save_shard(path, spec, entries[cuts[index] : cuts[index + 1]])


def _write_shards(
    root: Path,
    spec: SyntheticSpec,
    entries: Sequence[_Entry],
    cuts: Sequence[int],
    names: Sequence[str],
    workers: int,
) -> int:
    """Every shard written (shard ``i``: ``entries[cuts[i]:cuts[i + 1]]``), ``workers`` at
    once; the bytes written."""
    if workers <= 1:
        # One shard at a time, each dropped before the next is built: peak memory stays
        # one shard.
        return sum(
            _save_shard(root / name, spec, entries[start:stop])
            for name, start, stop in zip(names, cuts, cuts[1:], strict=False)
        )
    threads = max(1, (os.cpu_count() or 1) // workers)
    jobs = [(str(root), spec, i, threads) for i in range(spec.n_shards)]
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return sum(pool.map(_write_shard, jobs))


def write_synthetic(
    directory: str | os.PathLike[str],
    spec: SyntheticSpec = SyntheticSpec(),
    *,
    workers: int = 1,
) -> SyntheticCheckpoint:
    """Write the checkpoint described by ``spec`` into ``directory`` (created if missing).

    Shards are materialised and saved one at a time, so peak memory is about one
    shard even for multi-GB checkpoints; ``workers`` > 1 writes that many shards at once,
    each in a process of its own (byte-identical: every tensor is a pure function of the
    spec and its name). Existing files with the same names are overwritten; nothing else
    in the directory is touched.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tiers = _draw_tiers(spec)
    entries = list(_layout(spec, tiers))
    cuts = _shard_cuts(entries, spec.n_shards) + [len(entries)]
    names = _shard_names(spec.n_shards)

    total = _write_shards(root, spec, entries, cuts, names, workers)
    files = [root / name for name in names]
    weight_map = {
        e.name: names[i] for i in range(spec.n_shards) for e in entries[cuts[i] : cuts[i + 1]]
    }

    index: Path | None = None
    if spec.n_shards > 1:
        index = root / "model.safetensors.index.json"
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")

    tier_map_path = root / "tier_map.json"
    tier_doc = {str(layer): {str(e): k for e, k in draw.items()} for layer, draw in tiers.items()}
    tier_map_path.write_text(json.dumps(tier_doc, indent=2) + "\n")

    frozen = types.MappingProxyType(
        {layer: types.MappingProxyType(dict(d)) for layer, d in tiers.items()}
    )
    return SyntheticCheckpoint(
        root=root,
        files=tuple(files),
        index=index,
        tier_map_path=tier_map_path,
        tier_map=frozen,
        spec=spec,
        total_bytes=total,
        n_tensors=len(entries),
    )


# (hidden, intermediate, n_experts, vocab): from toy up to GLM-4.5-Air / GLM-4.5
# proportions, many experts and H several times the expert intermediate size.
# Every intermediate is a multiple of 128, so tp_ranks up to 8 needs no rounding.
_RUNGS: tuple[tuple[int, int, int, int], ...] = (
    (256, 128, 8, 512),
    (512, 128, 16, 1024),
    (1024, 256, 32, 4096),
    (2048, 512, 64, 8192),
    (4096, 1408, 128, 16384),
    (5120, 1536, 160, 32768),
)
# Prefer the biggest rung that still gives this many layers, so per-layer
# granularity stays fine and the checkpoint has a realistic depth.
_MIN_LAYERS = 6


class _Shapes:
    """The shapes :func:`spec_for_size` searches among: a spec made of a rung, a layer count
    and an expert count, the ``overrides`` kept, and its size estimated (before sharding)."""

    def __init__(self, overrides: Mapping[str, Any], tiers: Sequence[int]) -> None:
        low, higher = tiers[0], tiers[1:]
        self.mean_bits = (
            low
            if not higher
            else _LOW_TIER_SHARE * low + (1 - _LOW_TIER_SHARE) * sum(higher) / len(higher)
        )
        self.tp = overrides.get("tp_ranks", 1)
        self.first_dense = overrides.get("first_dense", 1)
        self.passthrough = {
            k: v
            for k, v in overrides.items()
            if k not in ("n_layers", "n_experts", "n_shards", "fill")
        }
        self.min_layers = max(self.first_dense + 1, 2)

    def make(self, rung: tuple[int, int, int, int], n_layers: int, n_experts: int) -> SyntheticSpec:
        h, i, _, v = rung
        unit = 16 * self.tp
        params: dict[str, Any] = {
            "hidden": h,
            "intermediate": -(-i // unit) * unit,
            "vocab": v,
            "first_dense": self.first_dense,
        }
        params.update(self.passthrough)
        params["n_layers"] = n_layers
        params["n_experts"] = n_experts
        params["n_shards"] = 1
        return SyntheticSpec(**params)

    def estimate(self, spec: SyntheticSpec) -> float:
        n_moe = spec.n_layers - spec.first_dense
        return _bytes_for(spec, [spec.n_experts * self.mean_bits] * n_moe)

    def per_moe_layer(self, rung: tuple[int, int, int, int], n_experts: int) -> tuple[float, float]:
        """The size of the smallest spec of ``rung``, and what one more MoE layer adds."""
        one = self.make(rung, self.min_layers, n_experts)
        more = self.estimate(replace(one, n_layers=self.min_layers + 1))
        return self.estimate(one), more - self.estimate(one)


def spec_for_size(total_bytes: int, **overrides: Any) -> SyntheticSpec:
    """A spec whose checkpoint is close to total_bytes (within ~10%).

    Scales hidden/intermediate/n_experts/n_layers sensibly (GLM-like
    proportions: many experts, H much larger than the per-rank I), uses
    fill='pattern' above ~256 MiB and n_shards so that each file is <= ~1 GiB.

    Benchmarks ask for a size, not a shape; this picks the shape. ``overrides``
    are fixed and the remaining knobs are searched around them (so fixing e.g.
    both n_layers and n_experts can make the target unreachable). n_shards
    defaults to max(3, ceil(size / 1 GiB)) so even small checkpoints exercise
    cross-file experts. Targets below the smallest rung's two layers (~2 MB)
    are not approximated.
    """
    if total_bytes < 1:
        raise ValueError(f"total_bytes must be positive, got {total_bytes}")
    unknown = set(overrides) - set(SyntheticSpec.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown SyntheticSpec fields: {sorted(unknown)}")

    tiers = sorted(set(overrides.get("bits", SyntheticSpec.__dataclass_fields__["bits"].default)))
    shapes = _Shapes(overrides, tiers)
    chosen = _RUNGS[0]
    for rung in reversed(_RUNGS):
        _, per_layer = shapes.per_moe_layer(rung, overrides.get("n_experts", rung[2]))
        if total_bytes / per_layer >= _MIN_LAYERS:
            chosen = rung
            break

    candidates = _candidates(shapes, chosen, tiers, total_bytes, overrides)
    # Keep the rung's (round, model-like) expert count unless moving it buys real accuracy.
    close = [c for c in candidates if c[0] <= 0.02 * total_bytes]
    spec = (
        min(close, key=lambda c: (c[1], c[0]))[2]
        if close
        else min(candidates, key=lambda c: (c[0], c[1]))[2]
    )

    exact = payload_bytes(spec)
    n_shards = overrides.get("n_shards", max(3, math.ceil(exact / _MAX_SHARD_BYTES)))
    fill = overrides.get("fill", "pattern" if total_bytes > _PATTERN_ABOVE else "random")
    return replace(spec, n_shards=n_shards, fill=fill)


def _candidates(
    shapes: _Shapes,
    chosen: tuple[int, int, int, int],
    tiers: Sequence[int],
    total_bytes: int,
    overrides: Mapping[str, Any],
) -> list[tuple[float, int, SyntheticSpec]]:
    """Specs of rung ``chosen`` around ``total_bytes``, each with its error in bytes and
    how far its expert count moved from the rung's."""
    min_layers = shapes.min_layers
    base_experts = overrides.get("n_experts", chosen[2])
    if "n_experts" in overrides:
        expert_range = [base_experts]
    else:
        lo = max(len(tiers), math.ceil(base_experts * 0.75))
        expert_range = list(range(lo, math.floor(base_experts * 1.25) + 1))
    candidates: list[tuple[float, int, SyntheticSpec]] = []
    for n_experts in expert_range:
        if "n_layers" in overrides:
            layer_range: Sequence[int] = [overrides["n_layers"]]
        else:
            floor_bytes, per_layer = shapes.per_moe_layer(chosen, n_experts)
            guess = min_layers + (total_bytes - floor_bytes) / per_layer
            centre = max(min_layers, int(guess))
            layer_range = range(max(min_layers, centre - 1), centre + 3)
        for n_layers in layer_range:
            s = shapes.make(chosen, n_layers, n_experts)
            error = abs(shapes.estimate(s) - total_bytes)
            candidates.append((error, abs(n_experts - base_experts), s))
    return candidates

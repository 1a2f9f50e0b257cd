"""Synthetic EXL3-like mixed-tier MoE checkpoints, written with the real ``safetensors``.

Tests, the demo and the benchmarks need checkpoints that look like the ones the
loader meets in the wild (GLM/DeepSeek layer layout, EXL3 trellis tensors with a
per-expert bit width, experts split over shard files, optional tensor-parallel
pre-slicing) without shipping or downloading real weights. Everything here is a
pure function of the :class:`SyntheticSpec`, so two writes of one spec are
byte-identical and a test can recompute what it expects instead of storing it.

Here: the spec, the layout (which tensors, their shapes, tiers and shards) and the writer.
What each tensor holds is ``_fill``'s; the shape for a size in bytes, ``_sizing``'s.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from ._fill import MCG_MARKER, MUL1_MARKER, Kind, fill_pattern, fill_random, tensor_key

__all__ = [
    "LOW_TIER_SHARE",
    "SyntheticCheckpoint",
    "SyntheticSpec",
    "estimated_bytes",
    "expected_tensors",
    "payload_bytes",
    "write_synthetic",
]

_PROJS = ("gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

# Share of each MoE layer's experts put on the lowest tier: GLM-4.x EXL3 mixes
# put 148 of 256 experts at 3 bits, so this keeps tier populations realistic.
LOW_TIER_SHARE = 0.58

# Dtypes the random fill can sample directly (CPU normal_ has no float8 kernel).
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    kind: Kind
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
            if not higher or rng.random() < LOW_TIER_SHARE:
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


def estimated_bytes(spec: SyntheticSpec, bits_sum_per_layer: Sequence[float]) -> float:
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
    return int(estimated_bytes(spec, [sum(t.values()) for t in tiers.values()]))


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


def _materialise(entry: _Entry, spec: SyntheticSpec) -> torch.Tensor:
    if entry.kind == "mcg":
        return torch.tensor(MCG_MARKER, dtype=torch.int32)
    if entry.kind == "mul1":
        return torch.tensor([MUL1_MARKER], dtype=torch.int32)
    key = tensor_key(spec.seed, entry.name)
    if spec.fill == "pattern":
        return fill_pattern(entry.dtype, entry.shape, key)
    return fill_random(entry.kind, entry.shape, key, spec.dense_dtype)


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

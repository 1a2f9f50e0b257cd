"""Picking a synthetic checkpoint's shape for a size: benchmarks ask for bytes, not shapes.

:func:`spec_for_size` walks a ladder of model-like shapes (toy up to GLM-4.5 proportions)
and returns the :class:`~._synthetic.SyntheticSpec` whose checkpoint comes closest to the
size asked for, with the fill and shard count a checkpoint of that size wants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ._synthetic import LOW_TIER_SHARE, SyntheticSpec, estimated_bytes, payload_bytes

__all__ = ["spec_for_size"]

_MiB = 1 << 20
_GiB = 1 << 30

# Above this size random fill (torch's samplers, far slower than writing the files)
# becomes the bottleneck, so spec_for_size switches to the pattern fill (rates in
# docs/performance.md).
_PATTERN_ABOVE = 256 * _MiB
# Largest file spec_for_size aims for, so multi-GB checkpoints are written (and
# held in memory) one ~1 GiB shard at a time.
_MAX_SHARD_BYTES = _GiB


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
            else LOW_TIER_SHARE * low + (1 - LOW_TIER_SHARE) * sum(higher) / len(higher)
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
        return estimated_bytes(spec, [spec.n_experts * self.mean_bits] * n_moe)

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

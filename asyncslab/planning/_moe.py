"""Mixture-of-experts planning: the tiered expert rule.

Experts quantized at different bit rates ("tiers") cannot share one slab, so each layer's
experts are partitioned into groups, one slab per (group, fused projection, suffix), laid out
``backing[shard_index, group_offset]``. The partition is exact — every expert exactly once,
nothing unknown — and an expert's offset is its rank inside its group, so the layout is a
pure function of the partition (:mod:`._partition`: the partition, and the tier map it is
checked against). Here: the rule that finds a layer's expert tensors and plans their slabs,
and its general path; the columnar one, for the common case, is :mod:`._moe_columnar`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, cast

import torch

from .._heap import frozen_columns
from ..checkpoint import (
    Checkpoint,
    TensorInfo,
    safetensors_dtype,
)
from ..errors import (
    CoverageError,
    DtypeMismatchError,
    PartitionError,
    PlanError,
    UnmatchedTensorError,
)
from ._moe_columnar import ColumnarMoE
from ._partition import ExpertPartition, TierRule, listing, load_tier_map
from ._routes import numbers_of
from ._vocabulary import (
    FILE,
    NAME,
    NBYTES,
    OFFSET,
    Claim,
    Route,
    SlabSpec,
    index_number,
    mode_shape,
)

__all__ = ["TieredMoE", "EXL3_EXPERT_PATTERN"]


#: ``model.layers.L.mlp.experts.E.<proj>[.rank<r>].<suffix>``
EXL3_EXPERT_PATTERN = (
    r"(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)"
    r"\.(?P<expert>\d+)\.(?P<proj>[^.]+)(?:\.rank(?P<rank>\d+))?\.(?P<suffix>[^.]+)"
)


def trellis_bits(shape: tuple[int, ...]) -> int:
    """EXL3 trellis ``(in/16, out/16, 16*K)``: bits per weight K from the last dim."""
    return shape[-1] // 16 if shape else 0


def _k_name(bits: int) -> str:
    return f"K{bits}"


def _layer_unit(layer: int) -> str:
    return f"layers.{layer}"


_ROUTE_COLUMNS = (
    "tensor file src_offset nbytes slab slot dst_offset unit layer expert shard suffix".split()
)


class _Expert(NamedTuple):  # a tuple: one per expert tensor, built at C speed
    info: TensorInfo
    layer: int
    expert: int
    proj: str
    rank: int | None
    suffix: str
    prefix: str


@dataclass(frozen=True, slots=True)
class TieredMoE:
    """Plans a layer's experts into per-tier slabs; every name and rule is a parameter.

    ``pattern`` must have named groups ``prefix``, ``layer``, ``expert``, ``proj`` and
    ``suffix`` (and optionally ``rank``). ``fusion`` maps each fused projection to its
    shards in order (W13 = gate then up). ``schema`` gives each placed suffix its required
    dtype; ``markers`` are suffixes that are dtype-checked and never placed. The tier of an
    expert comes from ``tier_of(shape of its tier_suffix tensor)``, verified against
    ``tier_map`` when one is declared (a mapping, or a JSON file's path, as
    :func:`load_tier_map` reads). ``tier_suffix=None`` puts every expert in one group.
    With ``rank`` set, a rank-sliced checkpoint routes only that rank's slices. With
    ``owns`` set (expert parallelism), only experts for which ``owns(layer, expert)`` holds
    are planned; the others are skipped, never read, and the partition covers the owned ones.
    ``layout="expert_major"`` lays fused projections out ``backing[group_offset,
    shard_index]`` instead — the byte layout of transformers' fused ``gate_up_proj``
    ``(E, 2I, H)`` — for engines whose kernels expect that.
    """

    pattern: str = EXL3_EXPERT_PATTERN
    fusion: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
    )
    schema: Mapping[str, torch.dtype] = field(
        default_factory=lambda: {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16}
    )
    markers: Mapping[str, torch.dtype] = field(
        default_factory=lambda: {"mcg": torch.int32, "mul1": torch.int32}
    )
    tier_suffix: str | None = "trellis"
    tier_of: Callable[[tuple[int, ...]], int] = trellis_bits
    group_name: Callable[[int], str] = _k_name
    tier_map: Mapping[int, Mapping[int, int]] | str | Path | None = None
    rank: int | None = None
    n_experts: int | None = None
    unit_of: Callable[[int], str] = _layer_unit
    owns: Callable[[int, int], bool] | None = None
    layout: Literal["shard_major", "expert_major"] = "shard_major"

    def __post_init__(self) -> None:
        for fused, projs in self.fusion.items():
            if isinstance(projs, str) or not all(isinstance(p, str) for p in projs):
                # ("down_proj") is a string, not a tuple: its letters would be taken for
                # projections (test_tiered_moe_refuses_a_fusion_entry_that_is_a_string).
                raise PlanError(
                    f"TieredMoE fusion[{fused!r}] = {projs!r}: expected a tuple of projection "
                    f"names, like ('down_proj',)"
                )
        listed = [p for projs in self.fusion.values() for p in projs]
        if len(set(listed)) != len(listed):
            twice = sorted({p for p in listed if listed.count(p) > 1})
            raise PlanError(
                f"TieredMoE fusion lists projections {twice} more than once; each "
                f"projection goes to one place (fusion={dict(self.fusion)})"
            )
        if self.layout not in ("shard_major", "expert_major"):
            # A typo ("expert-major") would otherwise plan the default layout, silently
            # the wrong bytes for kernels that expect the other.
            raise PlanError(
                f"TieredMoE layout={self.layout!r}; expected 'shard_major' or 'expert_major'"
            )
        if self.tier_map is not None and self.tier_suffix is None:
            # One group for every expert: a map of tiers would be verified against nothing
            # and ignored, whatever it declares.
            raise PlanError(
                "TieredMoE(tier_suffix=None) puts every expert in one group, so a tier_map "
                "has nothing to declare; pass the tier_suffix whose shape gives each "
                "expert's tier, or no tier_map"
            )
        if self.tier_map is not None:
            # A path, as plan(tier_map=...) takes; a mapping with JSON's string keys. Read
            # as characters, a path declared layers '.', '/', 'a'...
            object.__setattr__(self, "tier_map", load_tier_map(self.tier_map))

    def _tier_rule(self) -> TierRule:
        """What this rule declares of the tiers, with the checks that hold a layer to it."""
        tiers = cast("Mapping[int, Mapping[int, int]] | None", self.tier_map)  # see above
        return TierRule(
            tiers, self.n_experts, self.owns, self.tier_suffix, self.tier_of, self.group_name
        )

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        regex = re.compile(self.pattern)
        lacking = sorted({"prefix", "layer", "expert", "proj", "suffix"} - regex.groupindex.keys())
        if lacking:
            raise PlanError(f"TieredMoE pattern {self.pattern!r} lacks the named groups {lacking}")
        # Each projection's fused slab, its shard there, and whether it is fused at all.
        shard_of = {
            p: (f, i, len(projs) == 1)
            for f, projs in self.fusion.items()
            for i, p in enumerate(projs)
        }
        tier_rule = self._tier_rule()
        numbers = numbers_of(checkpoint, pending)
        if numbers is not None and self.owns is None and self.rank is None:
            fast = ColumnarMoE(self, tier_rule, checkpoint.table, regex, shard_of).claim(numbers)
            if fast is not None:
                return fast
        by_layer = _experts_by_layer(self, pending, regex, shard_of)
        tier_rule.check_declared_layers(by_layer.keys())

        skipped: list[str] = []
        own = _rank_slices(by_layer, self.rank, skipped)
        extent = _extents(own, inferred=self.n_experts is None and self.tier_map is None)
        if self.owns is not None:
            owns = self.owns
            for layer, items in own.items():
                skipped.extend(t.info.name for t in items if not owns(layer, t.expert))
                own[layer] = [t for t in items if owns(layer, t.expert)]
        slabs: list[SlabSpec] = []
        routes: list[Route] = []
        checked: list[str] = []
        partitions: dict[int, ExpertPartition] = {}
        for layer in sorted(own):
            if not own[layer]:  # an expert-parallel rank that owns none of this layer
                continue
            partition, layer_slabs, layer_routes = self._plan_layer(
                layer, own[layer], checked, extent[layer], shard_of, tier_rule
            )
            partitions[layer] = partition
            slabs.extend(layer_slabs)
            routes.extend(layer_routes)
        tiers = {layer: p.sizes() for layer, p in partitions.items()}
        return Claim(
            slabs=tuple(slabs),
            routes=tuple(routes),
            checked=tuple(checked),
            skipped=tuple(skipped),
            extras={"partitions": MappingProxyType(partitions), "tiers": tiers},
        )

    def _plan_layer(
        self,
        layer: int,
        items: list[_Expert],
        checked: list[str],
        extent: int,
        shard_of: Mapping[str, tuple[str, int, bool]],
        tier_rule: TierRule,
    ) -> tuple[ExpertPartition, list[SlabSpec], list[Route]]:
        prefix = _one_prefix(layer, items)
        partition = tier_rule.partition(layer, items, extent)
        placed: dict[tuple[str, str, str], list[tuple[tuple[int, ...], _Expert]]]
        placed = defaultdict(list)
        present: set[tuple[int, str, str]] = set()
        expert_major = self.layout == "expert_major"
        for t in items:
            if t.suffix in self.markers:
                expected = self.markers[t.suffix]
                if t.info.dtype != expected:
                    raise DtypeMismatchError(
                        f"dtype {t.info.st_dtype}, marker {t.suffix!r} must be "
                        f"{safetensors_dtype(expected)} (layer {layer}, expert {t.expert}, "
                        f"shard {t.proj!r})",
                        file=t.info.file,
                        tensor=t.info.name,
                        expected=safetensors_dtype(expected),
                        got=t.info.st_dtype,
                        layer=layer,
                        expert=t.expert,
                        shard=t.proj,
                    )
                checked.append(t.info.name)
                continue
            group, offset = partition.locate(t.expert)
            fused, shard, alone = shard_of[t.proj]
            if alone:
                slot: tuple[int, ...] = (offset,)
            elif expert_major:
                slot = (offset, shard)
            else:
                slot = (shard, offset)
            placed[(group, fused, t.suffix)].append((slot, t))
            present.add((t.expert, t.proj, t.suffix))
        _check_coverage(layer, prefix, partition, self.fusion, self.schema, present)
        slabs, routes = self._layer_slabs(layer, prefix, partition, placed)
        return partition, slabs, routes

    def _layer_slabs(
        self,
        layer: int,
        prefix: str,
        partition: ExpertPartition,
        placed: defaultdict[tuple[str, str, str], list[tuple[tuple[int, ...], _Expert]]],
    ) -> tuple[list[SlabSpec], list[Route]]:
        """A layer's slabs (one per group, fused projection and suffix) and the routes
        into them, from where each expert tensor was placed."""
        slabs: list[SlabSpec] = []
        columns: dict[str, list[Any]] = {f: [] for f in _ROUTE_COLUMNS}
        unit = self.unit_of(layer)
        for group, members in partition.groups.items():
            for fused, shards in self.fusion.items():
                for suffix, dtype in self.schema.items():
                    entries = placed[(group, fused, suffix)]
                    if len(shards) == 1:
                        slot_dims: tuple[int, ...] = (len(members),)
                    elif self.layout == "expert_major":
                        slot_dims = (len(members), len(shards))
                    else:
                        slot_dims = (len(shards), len(members))
                    spec = SlabSpec(
                        name=f"{prefix}.{group}.{fused}.{suffix}",
                        unit=unit,
                        dtype=dtype,
                        slot_dims=slot_dims,
                        item_shape=mode_shape(t.info.shape for _, t in entries),
                        labels={
                            "kind": "experts",
                            "layer": str(layer),
                            "group": group,
                            "projection": fused,
                            "suffix": suffix,
                            "layout": self.layout,
                        },
                    )
                    slabs.append(spec)
                    _add_routes(columns, spec, entries, layer, suffix)
        return slabs, frozen_columns(Route, len(columns["tensor"]), columns, {})


def _experts_by_layer(
    rule: TieredMoE,
    pending: Mapping[str, TensorInfo],
    regex: re.Pattern[str],
    shard_of: Mapping[str, tuple[str, int, bool]],
) -> dict[int, list[_Expert]]:
    """The general path's first step: each pending tensor the pattern matches, by layer
    (an unknown projection or suffix refused), in one loop over the names."""
    by_layer: dict[int, list[_Expert]] = defaultdict(list)
    sliced = "rank" in regex.groupindex
    for name, info in pending.items():
        m = regex.fullmatch(name)
        if m is None:
            continue
        proj, suffix, layer_id, expert_id, prefix = m.group(
            "proj", "suffix", "layer", "expert", "prefix"
        )
        if proj not in shard_of or (suffix not in rule.schema and suffix not in rule.markers):
            what = f"projection {proj!r}" if proj not in shard_of else f"suffix {suffix!r}"
            raise UnmatchedTensorError(
                f"expert tensor with unknown {what}; projections: {sorted(shard_of)}, "
                f"placed suffixes: {sorted(rule.schema)}, markers: {sorted(rule.markers)}",
                file=info.file,
                tensor=name,
            )
        rank = m.group("rank") if sliced else None
        if len(layer_id) < 10 and len(expert_id) < 10:  # the common case, inline
            layer, expert = int(layer_id), int(expert_id)
        else:
            layer = index_number(layer_id, "layer", info)
            expert = index_number(expert_id, "expert", info)
        by_layer[layer].append(
            _Expert(
                info,
                layer,
                expert,
                proj,
                index_number(rank, "rank", info) if rank is not None else None,
                suffix,
                prefix,
            )
        )
    return by_layer


def _rank_slices(
    by_layer: Mapping[int, list[_Expert]], rank: int | None, skipped: list[str]
) -> dict[int, list[_Expert]]:
    """Each layer's tensors of ``rank``, the other ranks' slices skipped; of a checkpoint
    that is not rank-sliced, all of them (and ``rank`` must be ``None``)."""
    ranks = {t.rank for items in by_layer.values() for t in items}
    if not ranks or ranks == {None}:
        if rank is not None:
            raise PlanError(
                f"rank={rank} was given, but the checkpoint's expert tensors are not "
                "rank-sliced ('...<proj>.rank<r>.<suffix>')"
            )
        return dict(by_layer)
    if None in ranks:
        plain = next(t for items in by_layer.values() for t in items if t.rank is None)
        raise PlanError(
            "checkpoint mixes rank-sliced and whole expert tensors",
            file=plain.info.file,
            tensor=plain.info.name,
        )
    n_ranks = max(r for r in ranks if r is not None) + 1
    if rank is None:
        raise PlanError(
            f"checkpoint is rank-sliced into {n_ranks} ranks; pass rank= (0..{n_ranks - 1})",
            ranks=n_ranks,
        )
    if not 0 <= rank < n_ranks:
        raise PlanError(f"rank={rank}, but the checkpoint has ranks 0..{n_ranks - 1}")
    seen: dict[tuple[int, int, str, str], set[int]] = defaultdict(set)
    for items in by_layer.values():
        for t in items:
            assert t.rank is not None
            seen[(t.layer, t.expert, t.proj, t.suffix)].add(t.rank)
    for (layer, expert, proj, suffix), got in seen.items():
        if len(got) != n_ranks:
            missing = sorted(set(range(n_ranks)) - got)
            raise CoverageError(
                f"layer {layer} expert {expert} {proj}.{suffix}: rank slices "
                f"{listing(missing)} missing (checkpoint has ranks 0..{n_ranks - 1})",
                layer=layer,
                expert=expert,
                missing_ranks=missing,
            )
    own: dict[int, list[_Expert]] = {}
    for layer, items in by_layer.items():
        own[layer] = [t for t in items if t.rank == rank]
        skipped.extend(t.info.name for t in items if t.rank != rank)
    return own


def _extents(own: Mapping[int, list[_Expert]], inferred: bool) -> dict[int, int]:
    """Each layer's experts as far as their ids run. Where the expert count is ``inferred``
    from them (no ``n_experts``, no tier map), ids far past the experts present are refused:
    a stray id like 10**20 would allocate a partition that size."""
    extent = {layer: max(t.expert for t in items) + 1 for layer, items in own.items()}
    if inferred:
        for layer, items in own.items():
            present = len({t.expert for t in items})
            if extent[layer] > 2 * present + 64:
                raise PartitionError(
                    f"layer {layer}: expert ids run to {extent[layer] - 1}, but only "
                    f"{present} experts are present; pass n_experts= or a tier map",
                    layer=layer,
                )
    return extent


def _one_prefix(layer: int, items: list[_Expert]) -> str:
    """The prefix a layer's expert tensors share. Slabs, units and tier maps are per layer
    number: two models' (a text and a vision tower's) experts of one layer number would
    share slabs named after one."""
    prefixes = sorted({t.prefix for t in items})
    if len(prefixes) > 1:
        other = next(t for t in items if t.prefix == prefixes[1])
        raise PartitionError(
            f"layer {layer}: expert tensors under {len(prefixes)} prefixes "
            f"({', '.join(map(repr, prefixes[:3]))}) share this layer number; give each "
            "prefix a TieredMoE rule of its own (pattern=...)",
            file=other.info.file,
            tensor=other.info.name,
            layer=layer,
        )
    return items[0].prefix


def _check_coverage(
    layer: int,
    prefix: str,
    partition: ExpertPartition,
    fusion: Mapping[str, tuple[str, ...]],
    schema: Mapping[str, torch.dtype],
    present: set[tuple[int, str, str]],
) -> None:
    """Every expert of the partition has every projection's every placed suffix."""
    missing = [
        f"{prefix}.{e}.{proj}.{suffix}"
        for e in partition.experts
        for projs in fusion.values()
        for proj in projs
        for suffix in schema
        if (e, proj, suffix) not in present
    ]
    if missing:
        raise CoverageError(
            f"layer {layer}: {len(missing)} expert tensors missing: {listing(missing, 5)}",
            layer=layer,
            missing=missing,
        )


def _add_routes(
    columns: dict[str, list[Any]],
    spec: SlabSpec,
    entries: list[tuple[tuple[int, ...], _Expert]],
    layer: int,
    suffix: str,
) -> None:
    """The routes into one slab, appended to ``columns``: the general path's routes a
    column at a time (see frozen_columns), as a large MoE checkpoint holds hundreds of
    thousands of expert tensors, a Route each."""
    # Row-major slot offsets; every slot lies in the slab by construction (the partition
    # placed it), and plan() checks each offset again.
    stride, width = spec.slot_nbytes, spec.slot_dims[-1]
    slots = [slot for slot, _ in entries]
    infos = [t.info for _, t in entries]
    n = len(entries)
    columns["tensor"] += map(NAME, infos)
    columns["file"] += map(FILE, infos)
    columns["src_offset"] += map(OFFSET, infos)
    columns["nbytes"] += map(NBYTES, infos)
    columns["slab"] += [spec.name] * n
    columns["slot"] += slots
    columns["dst_offset"] += [
        (s[0] * width + s[1] if len(s) == 2 else s[0]) * stride for s in slots
    ]
    columns["unit"] += [spec.unit] * n
    columns["layer"] += [layer] * n
    columns["expert"] += [t.expert for _, t in entries]
    columns["shard"] += [t.proj for _, t in entries]
    columns["suffix"] += [suffix] * n

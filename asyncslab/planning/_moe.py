"""Mixture-of-experts planning: exact expert partitions and the tiered expert rule.

Experts quantized at different bit rates ("tiers") cannot share one slab, so each layer's
experts are partitioned into groups, one slab per (group, fused projection, suffix), laid out
``backing[shard_index, group_offset]``. The partition is exact — every expert exactly once,
nothing unknown — and an expert's offset is its rank inside its group, so the layout is a
pure function of the partition.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, cast

import torch

from ..checkpoint._format import Checkpoint, TensorInfo, frozen_columns, safetensors_dtype
from ..errors import (
    CoverageError,
    DtypeMismatchError,
    PartitionError,
    PlanError,
    TierMapError,
    UnmatchedTensorError,
)
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

__all__ = ["ExpertPartition", "TieredMoE", "load_tier_map", "EXL3_EXPERT_PATTERN"]


def _listing(items: Iterable[object], limit: int = 10) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


@dataclass(frozen=True, slots=True)
class ExpertPartition:
    """An exact partition of expert ids into named groups, in group order.

    ``locate(expert) == (group, offset)`` with offset the rank of the id inside its group,
    so two processes that agree on the partition agree on every slot.
    """

    groups: Mapping[str, tuple[int, ...]]
    _where: Mapping[int, tuple[str, int]] = field(compare=False, repr=False, default_factory=dict)

    def __init__(
        self, groups: Mapping[str, Iterable[int]], experts: Iterable[int] | None = None
    ) -> None:
        normalized = {name: tuple(sorted(ids)) for name, ids in groups.items()}
        where: dict[int, tuple[str, int]] = {}
        duplicated: dict[int, list[str]] = defaultdict(list)
        for name, ids in normalized.items():
            if len(set(ids)) != len(ids):
                for e in sorted({e for e in ids if ids.count(e) > 1}):
                    duplicated[e].append(name)
            for offset, expert in enumerate(ids):
                if expert in where and where[expert][0] != name:
                    duplicated[expert].extend([where[expert][0], name])
                where.setdefault(expert, (name, offset))
        problems = []
        if duplicated:
            places = (f"{e} ({', '.join(dict.fromkeys(g))})" for e, g in sorted(duplicated.items()))
            problems.append("experts in more than one place: " + _listing(places))
        if experts is not None:
            universe = set(experts)
            missing = sorted(universe - where.keys())
            unknown = sorted(where.keys() - universe)
            if missing:
                problems.append(f"experts in no group: {_listing(missing)}")
            if unknown:
                problems.append(f"unknown experts: {_listing(unknown)}")
        if problems:
            raise PartitionError("not an exact partition: " + "; ".join(problems))
        object.__setattr__(self, "groups", MappingProxyType(normalized))
        object.__setattr__(self, "_where", MappingProxyType(where))

    @classmethod
    def from_assignment(
        cls,
        assignment: Mapping[int, str],
        experts: Iterable[int] | None = None,
        order: Iterable[str] | None = None,
    ) -> ExpertPartition:
        """From ``expert -> group``; groups in ``order`` (default: sorted names)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for expert, group in assignment.items():
            groups[group].append(expert)
        names = list(order) if order is not None else sorted(groups)
        extra = set(groups) - set(names)
        if extra:
            raise PartitionError(f"groups {sorted(extra)} are not in the given order {names}")
        return cls({name: groups.get(name, ()) for name in names}, experts)

    def locate(self, expert: int) -> tuple[str, int]:
        try:
            return self._where[expert]
        except KeyError:
            raise PartitionError(f"expert {expert} is in no group") from None

    @property
    def experts(self) -> tuple[int, ...]:
        return tuple(sorted(self._where))

    def sizes(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self.groups.items()}


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


def _span(experts: list[int]) -> str:
    """``0..7`` for a run, else the first few."""
    if experts and experts == list(range(experts[0], experts[-1] + 1)):
        return f"{experts[0]}..{experts[-1]}"
    return ", ".join(map(str, experts[:8])) + (" ..." if len(experts) > 8 else "")


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

    @property
    def _tiers(self) -> Mapping[int, Mapping[int, int]] | None:
        return cast("Mapping[int, Mapping[int, int]] | None", self.tier_map)  # see above

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
        by_layer: dict[int, list[_Expert]] = defaultdict(list)
        sliced = "rank" in regex.groupindex
        for name, info in pending.items():
            m = regex.fullmatch(name)
            if m is None:
                continue
            proj, suffix, layer_id, expert_id, prefix = m.group(
                "proj", "suffix", "layer", "expert", "prefix"
            )
            if proj not in shard_of or (suffix not in self.schema and suffix not in self.markers):
                what = f"projection {proj!r}" if proj not in shard_of else f"suffix {suffix!r}"
                raise UnmatchedTensorError(
                    f"expert tensor with unknown {what}; projections: {sorted(shard_of)}, "
                    f"placed suffixes: {sorted(self.schema)}, markers: {sorted(self.markers)}",
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
        if self._tiers is not None:
            extra_layers = sorted(set(self._tiers) - set(by_layer))
            if extra_layers:
                raise TierMapError(
                    f"tier map declares layers {_listing(extra_layers)}, which have no experts "
                    "in the checkpoint"
                )

        skipped: list[str] = []
        own = self._select_rank(by_layer, skipped)
        extent = {layer: max(t.expert for t in items) + 1 for layer, items in own.items()}
        if self.n_experts is None and self.tier_map is None:
            for layer, items in own.items():
                present = len({t.expert for t in items})
                if extent[layer] > 2 * present + 64:
                    # Inferring the expert count from the largest id would make a stray
                    # id like 10**20 allocate a partition that size.
                    raise PartitionError(
                        f"layer {layer}: expert ids run to {extent[layer] - 1}, but only "
                        f"{present} experts are present; pass n_experts= or a tier map",
                        layer=layer,
                    )
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
                layer, own[layer], checked, extent[layer], shard_of
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

    def _select_rank(
        self, by_layer: Mapping[int, list[_Expert]], skipped: list[str]
    ) -> dict[int, list[_Expert]]:
        ranks = {t.rank for items in by_layer.values() for t in items}
        if not ranks or ranks == {None}:
            if self.rank is not None:
                raise PlanError(
                    f"rank={self.rank} was given, but the checkpoint's expert tensors are not "
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
        if self.rank is None:
            raise PlanError(
                f"checkpoint is rank-sliced into {n_ranks} ranks; pass rank= (0..{n_ranks - 1})",
                ranks=n_ranks,
            )
        if not 0 <= self.rank < n_ranks:
            raise PlanError(f"rank={self.rank}, but the checkpoint has ranks 0..{n_ranks - 1}")
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
                    f"{_listing(missing)} missing (checkpoint has ranks 0..{n_ranks - 1})",
                    layer=layer,
                    expert=expert,
                    missing_ranks=missing,
                )
        own: dict[int, list[_Expert]] = {}
        for layer, items in by_layer.items():
            own[layer] = [t for t in items if t.rank == self.rank]
            skipped.extend(t.info.name for t in items if t.rank != self.rank)
        return own

    def _universe(self, layer: int, base: Iterable[int]) -> list[int]:
        return [e for e in base if self.owns is None or self.owns(layer, e)]

    def _partition(self, layer: int, items: list[_Expert], extent: int) -> ExpertPartition:
        seen = sorted({t.expert for t in items})
        observed: dict[int, dict[int, list[TensorInfo]]] = defaultdict(lambda: defaultdict(list))
        if self.tier_suffix is None:
            universe = self._universe(layer, range(self.n_experts or extent))
            try:
                return ExpertPartition({"all": seen}, universe)
            except PartitionError as err:
                raise PartitionError(f"layer {layer}: {err.message}", layer=layer) from None
        for t in items:
            if t.suffix == self.tier_suffix:
                observed[t.expert][self.tier_of(t.info.shape)].append(t.info)
        no_tier = [e for e in seen if e not in observed]
        if no_tier:
            raise CoverageError(
                f"layer {layer}: experts {_listing(no_tier)} have no {self.tier_suffix!r} "
                "tensor, so their tier is unknown",
                layer=layer,
                experts=no_tier,
            )
        for expert, by_bits in observed.items():
            if len(by_bits) > 1:
                detail = "; ".join(
                    f"{infos[0].name} says {bits}" for bits, infos in sorted(by_bits.items())
                )
                raise TierMapError(
                    f"layer {layer} expert {expert}: projections disagree on the tier ({detail})",
                    layer=layer,
                    expert=expert,
                )
        bits_of = {e: next(iter(b)) for e, b in observed.items()}
        if self._tiers is not None:
            declared = self._tiers.get(layer)
            if declared is None:
                raise TierMapError(f"tier map has no entry for MoE layer {layer}", layer=layer)
            if self.n_experts is not None and set(declared) != set(range(self.n_experts)):
                raise TierMapError(
                    f"layer {layer}: the tier map declares experts "
                    f"{_span(sorted(declared))}, n_experts={self.n_experts} says "
                    f"0..{self.n_experts - 1}",
                    layer=layer,
                )
            universe = self._universe(layer, declared.keys())
            wrong = [
                (e, declared[e], bits, observed[e][bits][0].name)
                for e, bits in sorted(bits_of.items())
                if e in declared and declared[e] != bits
            ]
            if wrong:
                e, want, got, name = wrong[0]
                raise TierMapError(
                    f"layer {layer}: tier map declares {len(wrong)} experts at other bit rates "
                    f"than their {self.tier_suffix} shapes; first: expert {e} declared {want}, "
                    f"shape says {got}",
                    tensor=name,
                    layer=layer,
                    expert=e,
                    expected=want,
                    got=got,
                )
        else:
            universe = self._universe(layer, range(self.n_experts or extent))
        try:
            return ExpertPartition.from_assignment(
                {e: self.group_name(b) for e, b in bits_of.items()},
                universe,
                order=[self.group_name(b) for b in sorted(set(bits_of.values()))],
            )
        except PartitionError as err:
            raise PartitionError(f"layer {layer}: {err.message}", layer=layer) from None

    def _plan_layer(
        self,
        layer: int,
        items: list[_Expert],
        checked: list[str],
        extent: int,
        shard_of: Mapping[str, tuple[str, int, bool]],
    ) -> tuple[ExpertPartition, list[SlabSpec], list[Route]]:
        prefixes = sorted({t.prefix for t in items})
        if len(prefixes) > 1:
            # Slabs, units and tier maps are per layer number: two models' (a text and a
            # vision tower's) experts of one layer number would share slabs named after one.
            other = next(t for t in items if t.prefix == prefixes[1])
            raise PartitionError(
                f"layer {layer}: expert tensors under {len(prefixes)} prefixes "
                f"({', '.join(map(repr, prefixes[:3]))}) share this layer number; give each "
                "prefix a TieredMoE rule of its own (pattern=...)",
                file=other.info.file,
                tensor=other.info.name,
                layer=layer,
            )
        partition = self._partition(layer, items, extent)
        prefix = items[0].prefix
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
        missing = [
            f"{prefix}.{e}.{proj}.{suffix}"
            for e in partition.experts
            for projs in self.fusion.values()
            for proj in projs
            for suffix in self.schema
            if (e, proj, suffix) not in present
        ]
        if missing:
            raise CoverageError(
                f"layer {layer}: {len(missing)} expert tensors missing: {_listing(missing, 5)}",
                layer=layer,
                missing=missing,
            )
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
        # The routes a column at a time (see frozen_columns): a large MoE checkpoint holds
        # hundreds of thousands of expert tensors, a Route each.
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
                    # Row-major slot offsets; every slot lies in the slab by construction
                    # (the partition placed it), and plan() checks each offset again.
                    stride, width = spec.slot_nbytes, slot_dims[-1]
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
                    columns["unit"] += [unit] * n
                    columns["layer"] += [layer] * n
                    columns["expert"] += [t.expert for _, t in entries]
                    columns["shard"] += [t.proj for _, t in entries]
                    columns["suffix"] += [suffix] * n
        return slabs, frozen_columns(Route, len(columns["tensor"]), columns, {})


def _tier_key(key: Any, what: str) -> int:
    """A layer or expert number: an integer, or its decimal digits as JSON keys are (1.7 or
    True would silently become 1)."""
    if isinstance(key, str) and key.isascii() and key.isdecimal():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, Integral):
        raise TypeError(f"{what} {key!r} is not a number")
    return int(key)


def _put(entry: dict[int, Any], key: int, value: Any, what: str) -> None:
    if key in entry:  # "1" and "01", or 1 and "1": one would silently win
        raise ValueError(f"{what} {key} is given twice")
    entry[key] = value


def load_tier_map(source: str | Path | Mapping[Any, Any]) -> dict[int, dict[int, int]]:
    """Read a declared tier map: ``{"<layer>": {"<expert>": bits}}`` or
    ``{"<layer>": [bits of expert 0, 1, ...]}``, optionally under a top-level ``"layers"``."""
    where = str(source) if isinstance(source, (str, Path)) else "<tier map>"
    if isinstance(source, (str, Path)):
        try:
            raw: Any = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise TierMapError(f"cannot read tier map: {err}", file=where) from err
    else:
        raw = source
    if isinstance(raw, Mapping) and isinstance(raw.get("layers"), Mapping):
        raw = raw["layers"]
    if not isinstance(raw, Mapping):
        raise TierMapError("tier map must be a JSON object of layers", file=where)
    result: dict[int, dict[int, int]] = {}
    try:
        for layer, experts in raw.items():
            if hasattr(experts, "tolist"):  # a NumPy array (or a tensor) of bits per expert
                experts = experts.tolist()
            if isinstance(experts, list | tuple):
                pairs: Iterable[tuple[Any, Any]] = enumerate(experts)
            elif isinstance(experts, Mapping):
                pairs = experts.items()
            else:
                raise TypeError(f"layer {layer}: expected an object or a list")
            entry: dict[int, int] = {}
            for expert, bits in pairs:
                # Any integer (a NumPy one too), not a bool or a float.
                if isinstance(bits, bool) or not isinstance(bits, Integral) or bits <= 0:
                    raise TypeError(f"layer {layer} expert {expert}: bits must be a positive int")
                what = f"layer {layer}: expert"
                _put(entry, _tier_key(expert, what), int(bits), what)
            _put(result, _tier_key(layer, "layer"), entry, "layer")
    except (TypeError, ValueError) as err:
        raise TierMapError(f"malformed tier map: {err}", file=where) from None
    return result

"""Mixture-of-experts planning: the tiered expert rule.

Experts quantized at different bit rates ("tiers") cannot share one slab, so each layer's
experts are partitioned into groups, one slab per (group, fused projection, suffix), laid out
``backing[shard_index, group_offset]``. The partition is exact — every expert exactly once,
nothing unknown — and an expert's offset is its rank inside its group, so the layout is a
pure function of the partition (:mod:`._partition`: the partition, and the tier map it is
checked against). Here: the rule that finds a layer's expert tensors and plans their slabs,
by a general path and a columnar one for the common case.
"""

from __future__ import annotations

import array
import itertools
import operator
import re
from collections import Counter, defaultdict
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
    TensorTable,
    safetensors_dtype,
)
from ..errors import (
    CoverageError,
    DtypeMismatchError,
    PartitionError,
    PlanError,
    UnmatchedTensorError,
)
from ._partition import ExpertPartition, TierRule, listing, load_tier_map
from ._routes import RouteTable, numbers_of
from ._vocabulary import (
    FILE,
    NAME,
    NBYTES,
    OFFSET,
    Claim,
    Route,
    SlabSpec,
    index_number,
    mode_of_counts,
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


#: Names matched at a time by the columnar path (see ``_Columnar._matched``).
_CHUNK = 16384

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
            fast = _Columnar(self, tier_rule, checkpoint.table, regex, shard_of).claim(numbers)
            if fast is not None:
                return fast
        by_layer = _experts_by_layer(self, pending, regex, shard_of)
        tier_rule.check_declared_layers(by_layer.keys())

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
                    f"{listing(missing)} missing (checkpoint has ranks 0..{n_ranks - 1})",
                    layer=layer,
                    expert=expert,
                    missing_ranks=missing,
                )
        own: dict[int, list[_Expert]] = {}
        for layer, items in by_layer.items():
            own[layer] = [t for t in items if t.rank == self.rank]
            skipped.extend(t.info.name for t in items if t.rank != self.rank)
        return own

    def _plan_layer(
        self,
        layer: int,
        items: list[_Expert],
        checked: list[str],
        extent: int,
        shard_of: Mapping[str, tuple[str, int, bool]],
        tier_rule: TierRule,
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
        partition = tier_rule.partition(layer, items, extent)
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
                f"layer {layer}: {len(missing)} expert tensors missing: {listing(missing, 5)}",
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


class _Columnar:
    """:meth:`TieredMoE.claim` a column at a time, for the common case: the planner's
    pending tensors, no rank slices, no expert ownership.

    Each name is matched once (``map`` of the pattern's ``fullmatch``), its groups taken
    as tuples, each distinct layer or expert number converted once; per layer, slabs and
    slots are numbers computed by ``map`` over those columns, and the routes are a
    :class:`~._routes.RouteTable`. It returns ``None`` wherever the general path would do
    more than succeed (an error to name, rank slices): that path then runs and decides,
    so the two agree (``test_columnar_moe_plans_what_the_general_path_plans``).
    """

    def __init__(
        self,
        rule: TieredMoE,
        tiers: TierRule,
        table: TensorTable,
        regex: re.Pattern[str],
        shard_of: Mapping[str, tuple[str, int, bool]],
    ) -> None:
        self.rule, self.tiers, self.table = rule, tiers, table
        self.regex, self.shard_of = regex, shard_of

    def claim(self, numbers: Mapping[str, int]) -> Claim | None:
        rule, table = self.rule, self.table
        fields = ["proj", "suffix", "layer", "expert", "prefix"]
        if "rank" in self.regex.groupindex:
            fields.append("rank")
        names, columns = self._matched(list(numbers), fields)
        projs, suffixes, layer_texts, expert_texts, prefixes = columns[:5]
        if len(columns) > 5 and set(columns[5]) - {None}:
            return None  # rank-sliced
        known = rule.schema.keys() | rule.markers.keys()
        if not set(projs) <= self.shard_of.keys() or not set(suffixes) <= known:
            return None  # an unknown projection or suffix, to be named
        texts = set(layer_texts) | set(expert_texts)
        if any(len(text) > 9 for text in texts):
            return None  # an absurd number, to be named
        value = {text: int(text) for text in texts}
        layers = list(map(value.__getitem__, layer_texts))
        experts = list(map(value.__getitem__, expert_texts))
        tensor = list(map(numbers.__getitem__, names))
        self.tiers.check_declared_layers(set(layers))
        by_layer = _positions_by_layer(layers)
        extent: dict[int, int] = {}
        for layer, at in by_layer.items():
            mine = list(map(experts.__getitem__, at))
            extent[layer] = max(mine) + 1
            if rule.n_experts is None and rule.tier_map is None:
                present = len(set(mine))
                if extent[layer] > 2 * present + 64:
                    return None  # a stray expert id, to be named
        self.columns = names, projs, suffixes, experts, prefixes, tensor
        self.out: dict[str, Any] = {
            f: array.array("I")
            for f in ("tensor", "slab", "slot", "unit", "expert", "shard", "suffix", "layer")
        }
        self.codes: dict[str, dict[Any, int]] = {
            f: {} for f in ("unit", "expert", "shard", "suffix", "layer")
        }
        self.slabs: list[SlabSpec] = []
        checked: list[str] = []
        partitions: dict[int, ExpertPartition] = {}
        for layer in sorted(by_layer):
            partition = self._layer(layer, by_layer[layer], extent[layer], checked)
            if partition is None:
                return None
            partitions[layer] = partition
        out, codes = self.out, self.codes
        context = {f: (out[f], list(codes[f])) for f in ("layer", "expert", "shard", "suffix")}
        routes = RouteTable(
            table,
            self.slabs,
            out["tensor"],
            out["slab"],
            out["slot"],
            list(codes["unit"]),
            out["unit"],
            context,
        )
        tiers = {layer: p.sizes() for layer, p in partitions.items()}
        return Claim(
            slabs=tuple(self.slabs),
            routes=routes,
            checked=tuple(checked),
            skipped=(),
            extras={"partitions": MappingProxyType(partitions), "tiers": tiers},
        )

    def _matched(self, pending: list[str], fields: list[str]) -> tuple[list[str], list[list[Any]]]:
        """The names the pattern matches, and per field the group's text for each.

        A chunk at a time, each group's texts replaced by one object per distinct text: the
        match objects, group tuples and per-name copies of ``"gate_proj"`` never exist for
        every name at once (they would be several hundred bytes a name at the peak)."""
        # By number: a group looked up by name costs a dict lookup per name and field.
        group = operator.methodcaller("group", *(self.regex.groupindex[f] for f in fields))
        canonical: list[dict[Any, Any]] = [{} for _ in fields]
        names: list[str] = []
        columns: list[list[Any]] = [[] for _ in fields]
        for start in range(0, len(pending), _CHUNK):
            chunk = pending[start : start + _CHUNK]
            matches = list(map(self.regex.fullmatch, chunk))
            found = list(map(operator.is_not, matches, itertools.repeat(None)))
            names += itertools.compress(chunk, found)
            groups = list(map(group, itertools.compress(matches, found)))
            del matches
            for column, texts, same in zip(
                columns, zip(*groups, strict=True), canonical, strict=False
            ):
                column += map(same.setdefault, texts, texts)
        return names, columns

    def _layer(
        self, layer: int, at: range | list[int], extent: int, checked: list[str]
    ) -> ExpertPartition | None:
        rule, table = self.rule, self.table
        if isinstance(at, range):  # the layer's tensors are one run: slices
            names, projs, suffixes, experts, prefixes, tensor = (
                list(column[at.start : at.stop]) for column in self.columns
            )
        else:
            names, projs, suffixes, experts, prefixes, tensor = (
                list(map(column.__getitem__, at)) for column in self.columns
            )
        if len(set(prefixes)) > 1:
            return None  # two models under one layer number, to be named
        kinds = list(map(table.ids.__getitem__, tensor))
        partition = self._partition(layer, names, suffixes, experts, kinds, extent)
        if partition is None:
            return None
        # Markers: dtype-checked (per distinct suffix and kind), never placed.
        is_marker = list(map(rule.markers.__contains__, suffixes))
        for suffix, kind in set(
            zip(
                itertools.compress(suffixes, is_marker),
                itertools.compress(kinds, is_marker),
                strict=True,
            )
        ):
            if table.kinds[kind][1] != rule.markers[suffix]:
                return None  # a marker of the wrong dtype, to be named
        checked.extend(itertools.compress(names, is_marker))
        placed = list(map(operator.not_, is_marker))
        experts, projs, suffixes, tensor, kinds = (
            list(itertools.compress(column, placed))
            for column in (experts, projs, suffixes, tensor, kinds)
        )
        n_projs = sum(map(len, rule.fusion.values()))
        wanted = len(partition.experts) * n_projs * len(rule.schema)
        if len(set(zip(experts, projs, suffixes, strict=True))) != wanted:
            return None  # expert tensors missing, to be named
        slab, slot = self._slots(partition, experts, projs, suffixes)
        base = len(self.slabs)
        unit = rule.unit_of(layer)
        self._add_slabs(layer, prefixes[0], unit, partition, slab, kinds)
        out, codes = self.out, self.codes
        n = len(tensor)
        out["tensor"].extend(tensor)
        out["slab"].extend(map(operator.add, slab, itertools.repeat(base)))
        out["slot"].extend(slot)
        for name, same in (("unit", unit), ("layer", layer)):
            code = codes[name].setdefault(same, len(codes[name]))
            out[name].extend(array.array("I", [code]) * n)
        for name, column in (
            ("expert", experts),
            ("shard", projs),
            ("suffix", suffixes),
        ):
            numbered = codes[name]
            for distinct in dict.fromkeys(column):
                numbered.setdefault(distinct, len(numbered))
            out[name].extend(map(numbered.__getitem__, column))
        return partition

    def _partition(
        self,
        layer: int,
        names: list[str],
        suffixes: list[str],
        experts: list[int],
        kinds: list[int],
        extent: int,
    ) -> ExpertPartition | None:
        """The layer's partition, from the tier tensors' shapes (each distinct kind asked
        once)."""
        rule, table = self.rule, self.table
        if rule.tier_suffix is None:
            return None  # one group for every expert: the general path
        is_tier = list(map(operator.eq, suffixes, itertools.repeat(rule.tier_suffix)))
        tier_experts = list(itertools.compress(experts, is_tier))
        tier_kinds = list(itertools.compress(kinds, is_tier))
        bits_of_kind = {k: rule.tier_of(table.kinds[k][2]) for k in set(tier_kinds)}
        tier_bits = list(map(bits_of_kind.__getitem__, tier_kinds))
        bits_of = dict(zip(tier_experts, tier_bits, strict=True))
        if len(set(zip(tier_experts, tier_bits, strict=True))) != len(bits_of):
            return None  # projections disagree on a tier, to be named
        if not set(experts) <= bits_of.keys():
            return None  # an expert without its tier tensor, to be named

        def first_name(expert: int, bits: int) -> str:
            tier_names = itertools.compress(names, is_tier)
            pairs = zip(tier_experts, tier_bits, tier_names, strict=True)
            return next(n for e, b, n in pairs if (e, b) == (expert, bits))

        return self.tiers.partition_of(layer, bits_of, extent, first_name)

    def _slots(
        self, partition: ExpertPartition, experts: list[int], projs: list[str], suffixes: list[str]
    ) -> tuple[list[int], list[int]]:
        """Each placed tensor's slab (numbered within the layer) and slot (row-major)."""
        rule = self.rule
        fusion, schema = rule.fusion, rule.schema
        # Slab number within the layer: group, then fused projection, then suffix, as the
        # general path orders them; slot: offset * a + c for the expert's group and the
        # projection (its shard's place in the fused slab).
        where = {e: partition.locate(e) for e in dict.fromkeys(experts)}
        group_number = {g: i for i, g in enumerate(partition.groups)}
        fused_number = {f: i for i, f in enumerate(fusion)}
        suffix_number = {x: i for i, x in enumerate(schema)}
        proj_number = {p: i for i, p in enumerate(self.shard_of)}
        n_fused, n_suffixes = len(fusion), len(schema)
        g_of = {e: group_number[g] for e, (g, _) in where.items()}
        offset_of = {e: o for e, (_, o) in where.items()}
        groups = list(map(g_of.__getitem__, experts))
        step = {p: fused_number[f] * n_suffixes for p, (f, _, _) in self.shard_of.items()}
        slab = list(
            map(
                operator.add,
                map(
                    operator.add,
                    map(operator.mul, groups, itertools.repeat(n_fused * n_suffixes)),
                    map(step.__getitem__, projs),
                ),
                map(suffix_number.__getitem__, suffixes),
            )
        )
        expert_major = rule.layout == "expert_major"
        scale: list[int] = []
        shift: list[int] = []
        for members in partition.groups.values():
            for fused, shard, alone in self.shard_of.values():
                width = len(fusion[fused])
                if alone:
                    a, c = 1, 0
                elif expert_major:
                    a, c = width, shard
                else:
                    a, c = 1, shard * len(members)
                scale.append(a)
                shift.append(c)
        gp = list(
            map(
                operator.add,
                map(operator.mul, groups, itertools.repeat(len(proj_number))),
                map(proj_number.__getitem__, projs),
            )
        )
        slot = list(
            map(
                operator.add,
                map(operator.mul, map(offset_of.__getitem__, experts), map(scale.__getitem__, gp)),
                map(shift.__getitem__, gp),
            )
        )
        return slab, slot

    def _add_slabs(
        self,
        layer: int,
        prefix: str,
        unit: str,
        partition: ExpertPartition,
        slab: list[int],
        kinds: list[int],
    ) -> None:
        """The layer's slabs, in the general path's order, each slot's shape the most
        common among its tensors."""
        rule, table = self.rule, self.table
        expert_major = rule.layout == "expert_major"
        shapes: dict[int, Counter[tuple[int, ...]]] = defaultdict(Counter)
        for (code, kind), count in Counter(zip(slab, kinds, strict=True)).items():
            shapes[code][table.kinds[kind][2]] += count
        code = 0
        for group, members in partition.groups.items():
            for fused, shards in rule.fusion.items():
                for suffix, dtype in rule.schema.items():
                    if len(shards) == 1:
                        slot_dims: tuple[int, ...] = (len(members),)
                    elif expert_major:
                        slot_dims = (len(members), len(shards))
                    else:
                        slot_dims = (len(shards), len(members))
                    self.slabs.append(
                        SlabSpec(
                            name=f"{prefix}.{group}.{fused}.{suffix}",
                            unit=unit,
                            dtype=dtype,
                            slot_dims=slot_dims,
                            item_shape=mode_of_counts(shapes[code]),
                            labels={
                                "kind": "experts",
                                "layer": str(layer),
                                "group": group,
                                "projection": fused,
                                "suffix": suffix,
                                "layout": rule.layout,
                            },
                        )
                    )
                    code += 1


def _positions_by_layer(layers: list[int]) -> dict[int, range | list[int]]:
    """Each layer's positions in ``layers``, in order; a checkpoint lists a layer's tensors
    together, so each layer is found as one run, without a step per tensor."""
    n = len(layers)
    if not n:
        return {}
    starts = [0, *itertools.compress(range(1, n), map(operator.ne, layers[1:], layers)), n]
    runs = list(zip(starts, starts[1:], strict=False))
    if len({layers[a] for a, _ in runs}) == len(runs):
        return {layers[a]: range(a, b) for a, b in runs}
    found: dict[int, list[int]] = defaultdict(list)
    for position, layer in enumerate(layers):
        found[layer].append(position)
    return dict(found)

"""The tiered expert rule's claim a column at a time: :class:`ColumnarMoE`.

:class:`~._moe.TieredMoE` plans by one of two paths that must agree. Its general path
(in :mod:`._moe`) makes an object per expert tensor and names every fault; this one, for
the common case, works on columns of numbers (a large MoE checkpoint holds hundreds of
thousands of expert tensors) and declines, handing back to the general path, wherever that
path would do more than succeed.
"""

from __future__ import annotations

import array
import itertools
import operator
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, Protocol

import torch

from ..checkpoint import TensorTable
from ._partition import ExpertPartition, TierRule
from ._routes import RouteTable
from ._vocabulary import Claim, SlabSpec, mode_of_counts

__all__ = ["ColumnarMoE", "MoERule"]

#: Names matched at a time (see ``_matched``).
_CHUNK = 16384


class MoERule(Protocol):
    """What the columnar path reads of its rule (a :class:`~._moe.TieredMoE`)."""

    @property
    def fusion(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def schema(self) -> Mapping[str, torch.dtype]: ...
    @property
    def markers(self) -> Mapping[str, torch.dtype]: ...
    @property
    def tier_suffix(self) -> str | None: ...
    @property
    def tier_of(self) -> Callable[[tuple[int, ...]], int]: ...
    @property
    def tier_map(self) -> object: ...
    @property
    def n_experts(self) -> int | None: ...
    @property
    def unit_of(self) -> Callable[[int], str]: ...
    @property
    def layout(self) -> Literal["shard_major", "expert_major"]: ...


class ColumnarMoE:
    """:meth:`~._moe.TieredMoE.claim` a column at a time, for the common case: the planner's
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
        rule: MoERule,
        tiers: TierRule,
        table: TensorTable,
        regex: re.Pattern[str],
        shard_of: Mapping[str, tuple[str, int, bool]],
    ) -> None:
        self.rule, self.tiers, self.table = rule, tiers, table
        self.regex, self.shard_of = regex, shard_of

    def claim(self, numbers: Mapping[str, int]) -> Claim | None:
        layers = self._read(numbers)
        if layers is None:
            return None
        self.tiers.check_declared_layers(set(layers))
        by_layer = _positions_by_layer(layers)
        extent = self._extents(by_layer)
        if extent is None:
            return None  # a stray expert id, to be named
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
        return self._claim(partitions, checked)

    def _read(self, numbers: Mapping[str, int]) -> list[int] | None:
        """The columns of the names the pattern matches (kept as ``self.columns``), and each
        name's layer; ``None`` where the general path is to decide."""
        rule = self.rule
        fields = ["proj", "suffix", "layer", "expert", "prefix"]
        if "rank" in self.regex.groupindex:
            fields.append("rank")
        names, columns = _matched(self.regex, list(numbers), fields)
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
        self.columns = names, projs, suffixes, experts, prefixes, tensor
        return layers

    def _extents(self, by_layer: Mapping[int, range | list[int]]) -> dict[int, int] | None:
        """Each layer's experts as far as their ids run; ``None`` where the count is
        inferred from them and an id runs far past the experts present."""
        rule, experts = self.rule, self.columns[3]
        extent: dict[int, int] = {}
        for layer, at in by_layer.items():
            mine = list(map(experts.__getitem__, at))
            extent[layer] = max(mine) + 1
            if rule.n_experts is None and rule.tier_map is None:
                present = len(set(mine))
                if extent[layer] > 2 * present + 64:
                    return None
        return extent

    def _claim(self, partitions: dict[int, ExpertPartition], checked: list[str]) -> Claim:
        """The claim of the planned layers: their slabs, and the routes as a table."""
        out, codes = self.out, self.codes
        context = {f: (out[f], list(codes[f])) for f in ("layer", "expert", "shard", "suffix")}
        routes = RouteTable(
            self.table,
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
        is_marker = self._markers(suffixes, kinds)
        if is_marker is None:
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
        slab, slot = _slots(rule, self.shard_of, partition, experts, projs, suffixes)
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

    def _markers(self, suffixes: list[str], kinds: list[int]) -> list[bool] | None:
        """Which tensors are markers: dtype-checked (per distinct suffix and kind), never
        placed; ``None`` if one has the wrong dtype."""
        rule, table = self.rule, self.table
        is_marker = list(map(rule.markers.__contains__, suffixes))
        for suffix, kind in set(
            zip(
                itertools.compress(suffixes, is_marker),
                itertools.compress(kinds, is_marker),
                strict=True,
            )
        ):
            if table.kinds[kind][1] != rule.markers[suffix]:
                return None
        return is_marker

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


def _slots(
    rule: MoERule,
    shard_of: Mapping[str, tuple[str, int, bool]],
    partition: ExpertPartition,
    experts: list[int],
    projs: list[str],
    suffixes: list[str],
) -> tuple[list[int], list[int]]:
    """Each placed tensor's slab (numbered within the layer) and slot (row-major)."""
    fusion, schema = rule.fusion, rule.schema
    # Slab number within the layer: group, then fused projection, then suffix, as the
    # general path orders them; slot: offset * a + c for the expert's group and the
    # projection (its shard's place in the fused slab).
    where = {e: partition.locate(e) for e in dict.fromkeys(experts)}
    group_number = {g: i for i, g in enumerate(partition.groups)}
    fused_number = {f: i for i, f in enumerate(fusion)}
    suffix_number = {x: i for i, x in enumerate(schema)}
    proj_number = {p: i for i, p in enumerate(shard_of)}
    n_fused, n_suffixes = len(fusion), len(schema)
    g_of = {e: group_number[g] for e, (g, _) in where.items()}
    offset_of = {e: o for e, (_, o) in where.items()}
    groups = list(map(g_of.__getitem__, experts))
    step = {p: fused_number[f] * n_suffixes for p, (f, _, _) in shard_of.items()}
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
    scale, shift = _slot_steps(rule, shard_of, partition)
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


def _slot_steps(
    rule: MoERule, shard_of: Mapping[str, tuple[str, int, bool]], partition: ExpertPartition
) -> tuple[list[int], list[int]]:
    """``a`` and ``c`` of ``slot = offset * a + c`` for each group and projection, in that
    order: where a projection's shard lies in its fused slab."""
    expert_major = rule.layout == "expert_major"
    scale: list[int] = []
    shift: list[int] = []
    for members in partition.groups.values():
        for fused, shard, alone in shard_of.values():
            width = len(rule.fusion[fused])
            if alone:
                a, c = 1, 0
            elif expert_major:
                a, c = width, shard
            else:
                a, c = 1, shard * len(members)
            scale.append(a)
            shift.append(c)
    return scale, shift


def _matched(
    regex: re.Pattern[str], pending: list[str], fields: list[str]
) -> tuple[list[str], list[list[Any]]]:
    """The names the pattern matches, and per field the group's text for each.

    A chunk at a time, each group's texts replaced by one object per distinct text: the
    match objects, group tuples and per-name copies of ``"gate_proj"`` never exist for
    every name at once (they would be several hundred bytes a name at the peak)."""
    # By number: a group looked up by name costs a dict lookup per name and field.
    group = operator.methodcaller("group", *(regex.groupindex[f] for f in fields))
    canonical: list[dict[Any, Any]] = [{} for _ in fields]
    names: list[str] = []
    columns: list[list[Any]] = [[] for _ in fields]
    for start in range(0, len(pending), _CHUNK):
        chunk = pending[start : start + _CHUNK]
        matches = list(map(regex.fullmatch, chunk))
        found = list(map(operator.is_not, matches, itertools.repeat(None)))
        names += itertools.compress(chunk, found)
        groups = list(map(group, itertools.compress(matches, found)))
        del matches
        for column, texts, same in zip(columns, zip(*groups, strict=True), canonical, strict=False):
            column += map(same.setdefault, texts, texts)
    return names, columns


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

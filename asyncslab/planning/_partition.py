"""Exact expert partitions, and the tiers a mixture-of-experts rule declares of them.

An expert's tier (its bit rate) decides its group: one slab per group, laid out
``backing[shard_index, group_offset]``. The partition is exact — every expert exactly once,
nothing unknown — and an expert's offset is its rank inside its group, so the layout is a
pure function of the partition. A declared tier map (:func:`load_tier_map`) is checked
against the tiers the checkpoint's tensors show (:class:`TierRule`); the rule that finds
those tensors and plans their slabs is :class:`~._moe.TieredMoE`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from ..checkpoint import TensorInfo
from ..errors import CoverageError, PartitionError, TierMapError

__all__ = ["ExpertPartition", "ExpertTensor", "TierRule", "listing", "load_tier_map", "span"]


def listing(items: Iterable[object], limit: int = 10) -> str:
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
            problems.append("experts in more than one place: " + listing(places))
        if experts is not None:
            universe = set(experts)
            missing = sorted(universe - where.keys())
            unknown = sorted(where.keys() - universe)
            if missing:
                problems.append(f"experts in no group: {listing(missing)}")
            if unknown:
                problems.append(f"unknown experts: {listing(unknown)}")
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


def span(experts: list[int]) -> str:
    """``0..7`` for a run, else the first few."""
    if experts and experts == list(range(experts[0], experts[-1] + 1)):
        return f"{experts[0]}..{experts[-1]}"
    return ", ".join(map(str, experts[:8])) + (" ..." if len(experts) > 8 else "")


class ExpertTensor(Protocol):
    """An expert tensor as :class:`~._moe.TieredMoE`'s general path records it."""

    @property
    def info(self) -> TensorInfo: ...

    @property
    def expert(self) -> int: ...

    @property
    def suffix(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TierRule:
    """What a :class:`~._moe.TieredMoE` rule declares of its layers' tiers (a tier map, the
    expert count, the experts this rank owns, the tensor whose shape gives an expert's tier
    and how, how groups are named), and the checks that hold the tiers a checkpoint shows
    to it."""

    tiers: Mapping[int, Mapping[int, int]] | None
    n_experts: int | None
    owns: Callable[[int, int], bool] | None
    tier_suffix: str | None
    tier_of: Callable[[tuple[int, ...]], int]
    group_name: Callable[[int], str]

    def partition(self, layer: int, items: Sequence[ExpertTensor], extent: int) -> ExpertPartition:
        """The partition of a layer whose expert tensors are ``items``, each expert's tier
        read from its ``tier_suffix`` tensor's shape (one group for all without one)."""
        seen = sorted({t.expert for t in items})
        observed: dict[int, dict[int, list[TensorInfo]]] = defaultdict(lambda: defaultdict(list))
        if self.tier_suffix is None:
            universe = self.universe(layer, range(self.n_experts or extent))
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
                f"layer {layer}: experts {listing(no_tier)} have no {self.tier_suffix!r} "
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
        return self.partition_of(layer, bits_of, extent, lambda e, bits: observed[e][bits][0].name)

    def check_declared_layers(self, layers: Collection[int]) -> None:
        if self.tiers is not None:
            extra_layers = sorted(set(self.tiers) - set(layers))
            if extra_layers:
                raise TierMapError(
                    f"tier map declares layers {listing(extra_layers)}, which have no experts "
                    "in the checkpoint"
                )

    def universe(self, layer: int, base: Iterable[int]) -> list[int]:
        return [e for e in base if self.owns is None or self.owns(layer, e)]

    def partition_of(
        self,
        layer: int,
        bits_of: Mapping[int, int],
        extent: int,
        first_name: Callable[[int, int], str],
    ) -> ExpertPartition:
        """The partition of a layer whose experts have the tiers ``bits_of``, checked against
        the tier map; ``first_name(expert, bits)`` names a tensor that shows the tier."""
        if self.tiers is not None:
            declared = self.tiers.get(layer)
            if declared is None:
                raise TierMapError(f"tier map has no entry for MoE layer {layer}", layer=layer)
            if self.n_experts is not None and set(declared) != set(range(self.n_experts)):
                raise TierMapError(
                    f"layer {layer}: the tier map declares experts "
                    f"{span(sorted(declared))}, n_experts={self.n_experts} says "
                    f"0..{self.n_experts - 1}",
                    layer=layer,
                )
            universe = self.universe(layer, declared.keys())
            wrong = [
                (e, declared[e], bits, first_name(e, bits))
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
            universe = self.universe(layer, range(self.n_experts or extent))
        try:
            return ExpertPartition.from_assignment(
                {e: self.group_name(b) for e, b in bits_of.items()},
                universe,
                order=[self.group_name(b) for b in sorted(set(bits_of.values()))],
            )
        except PartitionError as err:
            raise PartitionError(f"layer {layer}: {err.message}", layer=layer) from None


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

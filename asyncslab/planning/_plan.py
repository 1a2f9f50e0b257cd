"""The planning stage: where every tensor goes, decided and checked before any I/O.

A plan is pure data. Rules (see :mod:`asyncslab.planning._rules` and
:mod:`asyncslab.planning._moe`) claim checkpoint tensors and say which slab and slot each one
lands in; :func:`plan` then checks
the whole result — every slot covered exactly once, every dtype equal to the slab's (which
comes from a schema, never from the first tensor seen), every shape equal to the slot's —
and raises before a byte of payload is read.

The checks themselves are :mod:`._checks`. The vocabulary (slabs, slots, routes, claims)
lives in ``_vocabulary``, a leaf; the default rules are chosen here, at :func:`plan`'s entry,
so no rule module imports this one.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from .._heap import gc_paused
from ..checkpoint import Checkpoint, ShardFile, TensorInfo
from ..errors import (
    CoverageError,
    PlanError,
    UnmatchedTensorError,
)
from ._checks import check_slices, routes_valid, tables_valid, validate_routes
from ._routes import Pending, RouteIndex, RouteTable, route_column
from ._vocabulary import (
    FILE,
    NAME,
    SRC_OFFSET,
    TENSOR,
    Claim,
    Location,
    Route,
    Rule,
    SlabSpec,
)

__all__ = ["Plan", "plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated plan: slabs to allocate and where every checkpoint tensor lands.

    Routes are in payload order (file, then offset), which is the order the scheduler reads
    them. ``files`` records each shard as planned, so a load can refuse a file that changed.
    """

    slabs: Mapping[str, SlabSpec]
    routes: Sequence[Route]
    units: Mapping[str, tuple[str, ...]]
    checked: tuple[str, ...]
    skipped: tuple[str, ...]
    files: tuple[ShardFile, ...]
    extras: Mapping[str, Any] = field(default_factory=dict, compare=False)
    _index: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def where(self, tensor: str) -> Location:
        """Slab and slot of ``tensor``; ``KeyError`` names tensors that are not placed."""
        try:
            route = self.routes[self._index[tensor]]
        except KeyError:
            why = (
                "is checked but not placed"
                if tensor in self.checked
                else "is skipped by this plan"
                if tensor in self.skipped
                else "is not in this plan"
            )
            raise KeyError(f"tensor {tensor!r} {why}") from None
        return Location(route.slab, route.slot)

    def route(self, tensor: str) -> Route:
        self.where(tensor)
        return self.routes[self._index[tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes of every slab together: what a load allocates and writes."""
        return sum(spec.nbytes for spec in self.slabs.values())

    @property
    def layout_fingerprint(self) -> str:
        """Hash of the slab specs alone: two plans with the same layout can share slabs."""
        h = hashlib.sha256()
        # By name: slab order follows the files' payload order, which is not layout.
        for spec in sorted(self.slabs.values(), key=lambda s: s.name):
            # Slot dims too: (2,) + (4, 8) and () + (2, 4, 8) are one shape, but not the
            # same slots (view(), slot() and binding index by them).
            h.update(
                f"{spec.name}|{spec.unit}|{spec.dtype}|{spec.slot_dims}|{spec.item_shape};".encode()
            )
        return h.hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        """Hash of layout and routes: equal on every rank that planned the same load."""
        h = hashlib.sha256(self.layout_fingerprint.encode())
        # By tensor name, so that resharding the same tensors keeps the fingerprint.
        for r in sorted(self.routes, key=lambda r: r.tensor):
            # A slice's position in its tensor tells the ranks' row slices apart.
            part = "" if r.shape is None else f"|{r.slice_start}"
            h.update(f"{r.tensor}|{r.slab}|{r.slot}|{r.nbytes}{part};".encode())
        return h.hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """Slabs, bytes per group and tensors per unit, as JSON-ready data."""
        per_unit: dict[str, dict[str, int]] = {}
        for unit, names in self.units.items():
            per_unit[unit] = {
                "slabs": len(names),
                "bytes": sum(self.slabs[n].nbytes for n in names),
                "tensors": 0,
            }
        for r in self.routes:
            per_unit[r.unit]["tensors"] += 1
        groups: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "slabs": 0})
        for spec in self.slabs.values():
            group = spec.labels.get("group")
            if group is not None:
                groups[group]["bytes"] += spec.nbytes
                groups[group]["slabs"] += 1
        return {
            "files": len(self.files),
            "tensors_routed": len(self.routes),
            "tensors_checked": len(self.checked),
            "tensors_skipped": len(self.skipped),
            "slabs": len(self.slabs),
            "bytes": self.nbytes,
            "units": per_unit,
            "groups": dict(sorted(groups.items())),
            "fingerprint": self.fingerprint,
            **{k: v for k, v in self.extras.items() if k != "partitions"},
        }


def plan(
    checkpoint: Checkpoint,
    rules: Sequence[Rule] | None = None,
    *,
    ignore: Iterable[str] = (),
    unmatched: Literal["error", "ignore"] = "error",
    tier_map: Mapping[int, Mapping[int, int]] | str | Path | None = None,
    rank: int | None = None,
) -> Plan:
    """Plan a whole checkpoint and validate it; raises :class:`PlanError` subclasses.

    ``rules`` default to :func:`asyncslab.default_rules` (tiered MoE experts, then one slab
    per remaining tensor), built with ``tier_map`` and ``rank``. ``ignore`` is a list of
    regular expressions (full match) for tensors deliberately not loaded. Tensors no rule
    claims are an error unless ``unmatched="ignore"`` — never silently dropped.
    """
    # Routes, specs and their tuples are many small objects, none cyclic: the cyclic
    # collector would walk them again and again and free nothing (as when opening, see
    # _format; figures in docs/performance.md). The caller's setting comes back, also on
    # failure (test_planning_pauses_the_cyclic_collector_and_restores_it).
    with gc_paused():
        return _plan(checkpoint, rules, ignore, unmatched, tier_map, rank)


def _plan(
    checkpoint: Checkpoint,
    rules: Sequence[Rule] | None,
    ignore: Iterable[str],
    unmatched: Literal["error", "ignore"],
    tier_map: Mapping[int, Mapping[int, int]] | str | Path | None,
    rank: int | None,
) -> Plan:
    if rules is None:
        from ._rules import default_rules

        rules = default_rules(tier_map=tier_map, rank=rank)
    elif tier_map is not None or rank is not None:
        raise PlanError("tier_map and rank configure the default rules; pass them to your rules")
    if unmatched not in ("error", "ignore"):
        raise PlanError(f"unmatched={unmatched!r}; expected 'error' or 'ignore'")

    patterns = [re.compile(p) for p in ignore]
    table = checkpoint.table
    at = table.numbers_copy()
    pending = Pending(table, at)
    skipped: list[str] = []
    if patterns:
        skipped = [n for n in at if any(p.fullmatch(n) for p in patterns)]
        for name in skipped:
            del at[name]

    slabs: dict[str, SlabSpec] = {}
    parts: list[Sequence[Route]] = []
    checked: list[str] = []
    extras: dict[str, Any] = {}
    for rule in rules:
        claim = rule.claim(checkpoint, pending)
        slabs.update(_new_slabs(slabs, claim.slabs))
        parts.append(_take(checkpoint, rule, claim, at))
        checked.extend(claim.checked)
        skipped.extend(claim.skipped)
        extras.update(claim.extras)

    if at:
        if unmatched == "error":
            raise _unmatched(sorted(at), pending)
        skipped.extend(at)

    routes, index = _checked_routes(checkpoint, slabs, parts)
    units: dict[str, list[str]] = defaultdict(list)
    for spec in slabs.values():
        units[spec.unit].append(spec.name)
    return Plan(
        slabs=MappingProxyType(slabs),
        routes=routes,
        units=MappingProxyType({u: tuple(n) for u, n in units.items()}),
        checked=tuple(checked),
        skipped=tuple(skipped),
        files=checkpoint.files,
        extras=MappingProxyType(extras),
        _index=index,
    )


def _take(checkpoint: Checkpoint, rule: Rule, claim: Claim, at: dict[str, int]) -> Sequence[Route]:
    """The claim's routes, and its tensors taken off the pending ones (``at``); one taken
    already, or not in the checkpoint, is refused."""
    table = checkpoint.table
    claimed = claim.routes
    if isinstance(claimed, RouteTable) and claimed.tensors is not table:
        claimed = tuple(claimed)  # a table over another checkpoint: its routes' names
    placed = route_column(claimed, "tensor")
    # A table routes whole tensors; one named twice is "routed twice" below.
    if not isinstance(claimed, RouteTable) and len(set(placed)) != len(placed):
        claimed = tuple(claimed)
        check_slices(claimed, checkpoint, rule)
        placed = list(dict.fromkeys(placed))
    owned = [*placed, *claim.checked, *claim.skipped]
    # A column at a time, as in routes_valid; the loop below only names a fault.
    popped = list(map(at.pop, owned, itertools.repeat(None)))
    for name in itertools.compress(owned, map(operator.is_, popped, itertools.repeat(None))):
        if name in table:
            raise CoverageError(
                f"routed twice (rule {type(rule).__name__} claims it again)",
                file=table[name].file,
                tensor=name,
            )
        raise PlanError(f"rule {type(rule).__name__} routes unknown tensor {name!r}")
    return claimed


def _new_slabs(slabs: Mapping[str, SlabSpec], claimed: Iterable[SlabSpec]) -> dict[str, SlabSpec]:
    """A claim's slabs by name, none defined twice by it or already by an earlier rule."""
    specs = tuple(claimed)  # read twice below: a rule may have given an iterator
    named = dict(zip(map(NAME, specs), specs, strict=True))
    if len(named) != len(specs) or not slabs.keys().isdisjoint(named):
        seen = set(slabs)
        for spec in specs:
            if spec.name in seen:
                raise CoverageError(f"two rules define slab {spec.name!r}")
            seen.add(spec.name)
    return named


def _unmatched(names: list[str], pending: Mapping[str, TensorInfo]) -> UnmatchedTensorError:
    """The error for tensors no rule claimed (``names``, sorted), the first one named."""
    shown = ", ".join(repr(n) for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    first = pending[names[0]]
    return UnmatchedTensorError(
        f"{len(names)} tensors match no rule: {shown}{more}; add a rule, list them "
        "in ignore=, or pass unmatched='ignore'",
        file=first.file,
        tensor=first.name,
        tensors=names,
    )


def _checked_routes(
    checkpoint: Checkpoint, slabs: Mapping[str, SlabSpec], parts: Sequence[Sequence[Route]]
) -> tuple[Sequence[Route], Mapping[str, int]]:
    """The rules' routes, validated, in payload order, and tensor name -> first route.

    The built-in rules' tables are checked and merged a column at a time; any other routes
    (a custom rule's objects), or tables the column checks refuse, go through the route
    checks, which name the fault."""
    routes: Sequence[Route]
    tables = [part for part in parts if isinstance(part, RouteTable)]
    if len(tables) == len(parts) and tables and tables_valid(tables, slabs):
        routes = _in_payload_order(tables)
        index: Mapping[str, int] = RouteIndex(routes)
    else:
        routes = list(itertools.chain.from_iterable(parts))
        if not routes_valid(checkpoint, slabs, routes):
            validate_routes(checkpoint, slabs, routes)  # raises, naming the first fault
        order = {f.path: i for i, f in enumerate(checkpoint.files)}
        keys = list(
            zip(
                map(order.__getitem__, map(FILE, routes)),
                map(SRC_OFFSET, routes),
                map(TENSOR, routes),
                strict=True,
            )
        )
        if any(map(operator.gt, keys, itertools.islice(keys, 1, None))):
            routes = list(map(routes.__getitem__, sorted(range(len(routes)), key=keys.__getitem__)))
        routes = tuple(routes)
        # A tensor sliced into several routes is found at its first.
        index = MappingProxyType(
            dict(zip(map(TENSOR, reversed(routes)), range(len(routes) - 1, -1, -1), strict=True))
        )
    return routes, index


def _in_payload_order(tables: Sequence[RouteTable]) -> RouteTable:
    """The tables' routes, merged and sorted by file, offset and tensor name, as a plan
    holds them.

    A table's tensor numbers already run in file, then payload order, so sorting by number
    is the same sort, save where a zero-byte tensor shares its offset with another (payload
    order puts the shorter first, a plan the name first): those go by the full key. Rules
    claim in tensor order, so the merge is of sorted runs; where all but the largest table
    are small (a model's dense tensors beside its experts), each of their routes is placed
    by binary search and the columns are cut into runs, with no step per route."""
    table = RouteTable.concat(tables)
    tensors = table.tensors
    column = table.tensor
    zero = {k for k, kind in enumerate(tensors.kinds) if kind[3] == 0}
    if table.cuts or (zero and not zero.isdisjoint(map(tensors.ids.__getitem__, column))):
        keys = list(zip(table.files(), table.src_offsets(), table.names(), strict=True))
        if all(map(operator.le, keys, itertools.islice(keys, 1, None))):
            return table
        return table.permuted(sorted(range(len(keys)), key=keys.__getitem__))
    if all(map(operator.lt, column, itertools.islice(column, 1, None))):
        return table
    runs = _merge_runs([t.tensor for t in tables])
    if runs is not None:
        return table.runs(runs)
    return table.permuted(sorted(range(len(column)), key=column.__getitem__))


def _merge_runs(columns: Sequence[Sequence[int]]) -> list[tuple[int, int]] | None:
    """``[start, stop)`` runs of positions in the concatenation of ``columns`` (each
    increasing) that list it in increasing order, or ``None`` where that would take many
    runs (columns not increasing, or more than one large)."""
    for column in columns:
        if not all(map(operator.lt, column, itertools.islice(column, 1, None))):
            return None
    starts = list(itertools.accumulate(map(len, columns), initial=0))
    big = max(range(len(columns)), key=lambda i: len(columns[i]))
    if 8 * (starts[-1] - len(columns[big])) > starts[-1]:
        return None
    # Every route of the small columns, by tensor, placed among the big one's.
    small = sorted(
        (t, starts[i] + k) for i, c in enumerate(columns) if i != big for k, t in enumerate(c)
    )
    runs: list[tuple[int, int]] = []
    at, base = 0, starts[big]
    for tensor, position in small:
        cut = bisect.bisect_left(columns[big], tensor, at)
        if cut > at:
            runs.append((base + at, base + cut))
        runs.append((position, position + 1))
        at = cut
    if at < len(columns[big]):
        runs.append((base + at, base + len(columns[big])))
    return runs

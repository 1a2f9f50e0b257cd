"""The planning stage: where every tensor goes, decided and checked before any I/O.

A plan is pure data. Rules (see :mod:`asyncslab.planning._rules` and
:mod:`asyncslab.planning._moe`) claim checkpoint tensors and say which slab and slot each one
lands in; :func:`plan` then checks
the whole result — every slot covered exactly once, every dtype equal to the slab's (which
comes from a schema, never from the first tensor seen), every shape equal to the slot's —
and raises before a byte of payload is read.

The vocabulary (slabs, slots, routes, claims) lives in ``_vocabulary``, a leaf; the default
rules are chosen here, at :func:`plan`'s entry, so no rule module imports this one.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import operator
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from .._heap import gc_paused
from ..checkpoint import Checkpoint, ShardFile, TensorInfo, safetensors_dtype
from ..errors import (
    CoverageError,
    DtypeMismatchError,
    PlanError,
    ShapeMismatchError,
    UnmatchedTensorError,
)
from ._routes import Pending, RouteIndex, RouteTable, route_column
from ._vocabulary import (
    DST_OFFSET,
    DTYPE,
    FILE,
    ITEM_SHAPE,
    NAME,
    NBYTES,
    OFFSET,
    SHAPE,
    SLAB,
    SLOT,
    SLOT_DIMS,
    SRC_OFFSET,
    TENSOR,
    Location,
    Route,
    Rule,
    SlabSpec,
    linear_index,
    not_ints,
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
        claimed = claim.routes
        if isinstance(claimed, RouteTable) and claimed.tensors is not table:
            claimed = tuple(claimed)  # a table over another checkpoint: its routes' names
        placed = route_column(claimed, "tensor")
        # A table routes whole tensors; one named twice is "routed twice" below.
        if not isinstance(claimed, RouteTable) and len(set(placed)) != len(placed):
            claimed = tuple(claimed)
            _check_slices(claimed, checkpoint, rule)
            placed = list(dict.fromkeys(placed))
        owned = [*placed, *claim.checked, *claim.skipped]
        # A column at a time, as in _valid; the loop below only names a fault.
        popped = list(map(at.pop, owned, itertools.repeat(None)))
        for name in itertools.compress(owned, map(operator.is_, popped, itertools.repeat(None))):
            if name in table:
                raise CoverageError(
                    f"routed twice (rule {type(rule).__name__} claims it again)",
                    file=table[name].file,
                    tensor=name,
                )
            raise PlanError(f"rule {type(rule).__name__} routes unknown tensor {name!r}")
        parts.append(claimed)
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
    if len(tables) == len(parts) and tables and _valid_tables(tables, slabs):
        routes = _in_payload_order(tables)
        index: Mapping[str, int] = RouteIndex(routes)
    else:
        routes = list(itertools.chain.from_iterable(parts))
        if not _valid(checkpoint, slabs, routes):
            _validate(checkpoint, slabs, routes)  # raises, naming the first fault
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


def _valid_tables(tables: Sequence[RouteTable], slabs: Mapping[str, SlabSpec]) -> bool:
    """Whether the routes of the built-in rules' tables pass every check of
    :func:`_validate`, decided a column at a time over numbers (kinds, slabs, slots).

    A table's routes read their own tensors at their slots' offsets by construction; what
    remains is each tensor's dtype, shape and size against its slab's slot, every slot
    inside its slab, and every slot of every slab taken exactly once. Each table routes only
    into its own slabs, so coverage is checked table by table. A plan this refuses goes
    through the route-by-route checks, which name the fault."""
    covered = 0
    try:
        for table in tables:
            specs = table.slabs
            if table.cuts or any(slabs.get(spec.name) is not spec for spec in specs):
                return False
            covered += len(specs)
            tensors = table.tensors
            signature: dict[tuple[Any, ...], int] = {}
            of_kind = [
                signature.setdefault((dtype, shape, size), len(signature))
                for _, dtype, shape, size in tensors.kinds
            ]
            of_slab = [
                signature.setdefault((s.dtype, s.item_shape, s.slot_nbytes), len(signature))
                for s in specs
            ]
            kinds = map(tensors.ids.__getitem__, table.tensor)
            if list(map(of_kind.__getitem__, kinds)) != list(map(of_slab.__getitem__, table.slab)):
                return False
            n_slots = [spec.n_slots for spec in specs]
            if not all(map(operator.lt, table.slot, map(n_slots.__getitem__, table.slab))):
                return False
            base = list(itertools.accumulate(n_slots, initial=0))
            if len(table) != base[-1]:
                return False
            taken = set(map(operator.add, map(base.__getitem__, table.slab), table.slot))
            if len(taken) != len(table):
                return False
    except TypeError:  # an unhashable shape: judged by the route checker
        return False
    return covered == len(slabs)


def _check_slices(routes: Sequence[Route], checkpoint: Checkpoint, rule: Rule) -> None:
    """A tensor may have several routes of one rule only as slices reading disjoint bytes
    of it (a tensor-parallel rank's columns, row by row): anything else routes it twice."""
    by_tensor: dict[str, list[Route]] = defaultdict(list)
    for route in routes:
        by_tensor[route.tensor].append(route)
    for name, group in by_tensor.items():
        if len(group) == 1:
            continue
        spans = sorted((r.src_offset, r.src_offset + r.nbytes) for r in group)
        disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        if not disjoint or any(r.shape is None for r in group):
            raise CoverageError(
                f"routed twice (rule {type(rule).__name__} routes it {len(group)} times, "
                "not as disjoint slices)",
                file=checkpoint.tensors[name].file if name in checkpoint.tensors else None,
                tensor=name,
            )


def _reads_its_tensor(route: Route, info: TensorInfo) -> bool:
    """Whether ``route`` reads ``info``'s bytes: all of them, or whole rows of them (a
    ``make_route(..., rows=...)`` slice). The loader reads what the route says; a route of
    a custom rule that pointed elsewhere would fill its slot with another tensor's bytes,
    or a header's, and the plan would still count as complete."""
    if route.file != info.file:
        return False
    if route.shape is None:
        return route.src_offset == info.offset and route.nbytes == info.nbytes
    start, rows = route.slice_start, info.shape[0] if info.shape else 0
    row_bytes = info.nbytes // rows if rows else 0
    within = 0 <= start and start + route.nbytes <= info.nbytes
    if not within or route.src_offset != info.offset + start:
        return False
    if tuple(route.shape[1:]) == info.shape[1:]:  # a custom rule may give a list
        return start % row_bytes == 0 if row_bytes else start == 0  # whole rows
    # A flat run of elements (make_route(elements=...)).
    return len(route.shape) == 1 and start % info.dtype.itemsize == 0


def _valid(checkpoint: Checkpoint, slabs: Mapping[str, SlabSpec], routes: Sequence[Route]) -> bool:
    """Whether :func:`_validate` would pass, decided a column at a time.

    Validation is the same few comparisons per route, and a loop of Python statements per
    route is slow for the hundreds of thousands of a large plan. Here each check compares
    whole columns in C; only a plan that fails goes through :func:`_validate`, which finds
    and names the fault. The two must agree on every plan: whatever ``_validate`` accepts,
    this accepts too (``test_property_plan_column_checks_accept_what_the_route_checker_accepts``),
    and a plan this refuses only costs the slower check.
    """
    try:
        return _valid_columns(checkpoint, slabs, routes)
    except (TypeError, PlanError):  # an unhashable shape, a slot outside its slab: judged
        return False  # by the per-route checker


def _valid_columns(
    checkpoint: Checkpoint, slabs: Mapping[str, SlabSpec], routes: Sequence[Route]
) -> bool:
    names = list(map(SLAB, routes))
    specs = list(map(slabs.get, names))
    if any(map(operator.is_, specs, itertools.repeat(None))):
        return False
    tensors = checkpoint.tensors
    infos = list(map(tensors.__getitem__, map(TENSOR, routes)))
    if list(map(DTYPE, infos)) != list(map(DTYPE, specs)):
        return False
    route_shapes = list(map(SHAPE, routes))
    whole = route_shapes.count(None) == len(route_shapes)  # no route carries a slice
    if whole:
        shapes = list(map(SHAPE, infos))
    else:
        shapes = [
            info.shape if shape is None else shape
            for shape, info in zip(route_shapes, infos, strict=True)
        ]
    if shapes != list(map(ITEM_SHAPE, specs)):
        return False
    # Each route reads its own tensor's bytes: files compared by identity first (a rule
    # passes the tensor's own path on), offsets as a column for whole tensors.
    if list(map(FILE, routes)) != list(map(FILE, infos)):
        return False
    if whole:
        if list(map(SRC_OFFSET, routes)) != list(map(OFFSET, infos)):
            return False
    elif not all(map(_reads_its_tensor, routes, infos)):
        return False
    # Slot sizes and counts per distinct shape, not per slab (properties, computed per call).
    # From the specs, not the tensors' sizes: the loader writes a route's nbytes into its
    # slot, which must hold them whatever made the tensor's info.
    kinds = list(zip(map(ITEM_SHAPE, specs), map(DTYPE, specs), strict=True))
    size = {k: math.prod(k[0]) * k[1].itemsize for k in set(kinds)}
    if list(map(NBYTES, routes)) != list(map(size.__getitem__, kinds)):
        return False
    # Each route's byte offset is its slot's, and its slot inside its slab; in slabs of one
    # slot each (a dense checkpoint's), that is slot () at byte 0.
    slots = list(map(SLOT, routes))
    # Only ints index a slot (and 1.0, True are equal to 1 as keys of the table below).
    if not set(map(type, itertools.chain.from_iterable(slots))) <= {int}:
        return False
    offsets = list(map(DST_OFFSET, routes))
    slab_dims = list(map(SLOT_DIMS, specs))
    if slab_dims.count(()) == len(specs) and slots.count(()) == len(slots):
        if offsets.count(0) != len(offsets):
            return False
    else:
        # Per distinct (slot, dims) pair: an expert slab's slots recur in every layer.
        pairs = list(zip(slots, slab_dims, strict=True))
        table = {pair: linear_index(*pair) for pair in set(pairs)}
        linear = list(map(table.__getitem__, pairs))
        if -1 in linear or offsets != list(map(operator.mul, linear, map(size.__getitem__, kinds))):
            return False
    # Exact coverage: as many routes into each slab as it has slots, and no two into one
    # slot (a slot outside the slab's dims would take the place of one left empty).
    dims = list(map(SLOT_DIMS, slabs.values()))
    n_slots = {d: math.prod(d) for d in set(dims)}
    if set(n_slots.values()) <= {1}:
        # Slabs of one slot each (a dense checkpoint's): one route into each, that is as
        # many routes as slabs, into as many distinct slabs (each one of them, checked above).
        return len(names) == len(slabs) and len(set(names)) == len(names)
    counts = Counter(names)
    if list(map(counts.__getitem__, slabs)) != list(map(n_slots.__getitem__, dims)):
        return False
    # With the counts right, only a slab of several slots can take two routes in one.
    several = {name for name, d in zip(slabs, dims, strict=True) if n_slots[d] > 1}
    taken = [(r.slab, r.slot) for r in routes if r.slab in several]
    return len(set(taken)) == len(taken)


def _validate(
    checkpoint: Checkpoint, slabs: Mapping[str, SlabSpec], routes: Sequence[Route]
) -> None:
    """Dtype and shape of every route, then exact coverage of every slab."""
    filled: dict[str, dict[tuple[int, ...], Route]] = defaultdict(dict)
    slot_nbytes: dict[str, int] = {}  # a property computed per call: once per slab here
    tensors = checkpoint.tensors
    for route in routes:
        spec = slabs.get(route.slab)
        if spec is None:
            raise PlanError(f"routes into undefined slab {route.slab!r}", tensor=route.tensor)
        info = tensors[route.tensor]
        if info.dtype != spec.dtype:
            raise _dtype_error(route, info, spec)
        shape = route.shape if route.shape is not None else info.shape
        nbytes = slot_nbytes.get(spec.name)
        if nbytes is None:
            nbytes = slot_nbytes[spec.name] = spec.slot_nbytes
        if shape != spec.item_shape or route.nbytes != nbytes:
            sliced = "" if route.shape is None else f" (a slice of {list(info.shape)})"
            raise ShapeMismatchError(
                f"shape {list(shape)}{sliced}, slot expects {list(spec.item_shape)} "
                f"({route.describe()})",
                file=info.file,
                tensor=info.name,
                expected=spec.item_shape,
                got=shape,
                layer=route.layer,
                expert=route.expert,
                shard=route.shard,
            )
        if not _reads_its_tensor(route, info):
            raise _read_error(route, info)
        # The loader writes at the route's byte offset, not its slot: a custom rule's route
        # whose offset disagrees with its slot, or whose slot lies outside the slab, would
        # write outside its slot, or outside the slabs.
        try:
            start = spec.slot_offset(route.slot)
        except PlanError:
            raise CoverageError(
                f"lands in slot {route.slot}, outside slab {route.slab!r} of slots "
                f"{spec.slot_dims}{not_ints(route.slot)}",
                file=info.file,
                tensor=info.name,
                slab=route.slab,
                slot=route.slot,
            ) from None
        if route.dst_offset != start:
            raise PlanError(
                f"lands at byte {route.dst_offset} of its slab, but {route.describe()} starts "
                f"at byte {start} (make routes with make_route)",
                file=info.file,
                tensor=info.name,
                slab=route.slab,
                slot=route.slot,
            )
        earlier = filled[route.slab].get(route.slot)
        if earlier is not None:
            raise CoverageError(
                f"lands in {route.describe()}, already taken by {earlier.tensor!r}",
                file=info.file,
                tensor=info.name,
                slab=route.slab,
                slot=route.slot,
            )
        filled[route.slab][route.slot] = route
    _check_filled(slabs, filled)


def _dtype_error(route: Route, info: TensorInfo, spec: SlabSpec) -> DtypeMismatchError:
    """The error for a route whose tensor's dtype is not its slab's."""
    expected = safetensors_dtype(spec.dtype)
    return DtypeMismatchError(
        f"dtype {info.st_dtype}, plan expects {expected} ({route.describe()}); "
        "asyncslab never casts",
        file=info.file,
        tensor=info.name,
        expected=expected,
        got=info.st_dtype,
        layer=route.layer,
        expert=route.expert,
        shard=route.shard,
    )


def _read_error(route: Route, info: TensorInfo) -> PlanError:
    """The error for a route whose bytes are not its tensor's (or not a slice of them)."""
    end = route.src_offset + route.nbytes
    what = (
        "its bytes"
        if route.shape is None
        else "a run of its elements"
        if len(route.shape) == 1
        else "whole rows of it"
    )
    return PlanError(
        f"reads bytes [{route.src_offset}, {end}) of {route.file}, not {what}: the "
        f"tensor lies at [{info.offset}, {info.offset + info.nbytes}) of {info.file} "
        f"({route.describe()}; make routes with make_route)",
        file=info.file,
        tensor=info.name,
        expected=(info.offset, info.offset + info.nbytes),
        got=(route.src_offset, end),
    )


def _check_filled(
    slabs: Mapping[str, SlabSpec], filled: Mapping[str, Mapping[tuple[int, ...], Route]]
) -> None:
    """Every slot of every slab has its route (``filled``: slab -> slot -> route)."""
    for spec in slabs.values():
        got = filled.get(spec.name, {})
        if len(got) != spec.n_slots:
            missing = [s for s in _all_slots(spec.slot_dims) if s not in got]
            shown = ", ".join(str(s) for s in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise CoverageError(
                f"slab {spec.name!r} (unit {spec.unit!r}): {len(missing)} of {spec.n_slots} "
                f"slots have no tensor: {shown}{more}",
                slab=spec.name,
                missing=missing,
            )


def _all_slots(dims: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    if not dims:
        yield ()
        return
    for head in range(dims[0]):
        for rest in _all_slots(dims[1:]):
            yield (head, *rest)

"""A plan's checks: each route's dtype, shape and bytes against its slot, every slot of
every slab taken exactly once.

Two checkers that must agree: :func:`routes_valid` decides a column at a time, for the
hundreds of thousands of routes of a large plan; :func:`validate_routes` goes a route at a
time and names the first fault. The built-in rules' tables are decided over numbers by
:func:`tables_valid`.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..checkpoint import Checkpoint, TensorInfo, safetensors_dtype
from ..errors import CoverageError, DtypeMismatchError, PlanError, ShapeMismatchError
from ._routes import RouteTable
from ._vocabulary import (
    DST_OFFSET,
    DTYPE,
    FILE,
    ITEM_SHAPE,
    NBYTES,
    OFFSET,
    SHAPE,
    SLAB,
    SLOT,
    SLOT_DIMS,
    SRC_OFFSET,
    TENSOR,
    Route,
    Rule,
    SlabSpec,
    linear_index,
    not_ints,
)

__all__ = ["check_slices", "routes_valid", "tables_valid", "validate_routes"]


def tables_valid(tables: Sequence[RouteTable], slabs: Mapping[str, SlabSpec]) -> bool:
    """Whether the routes of the built-in rules' tables pass every check of
    :func:`validate_routes`, decided a column at a time over numbers (kinds, slabs, slots).

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


def check_slices(routes: Sequence[Route], checkpoint: Checkpoint, rule: Rule) -> None:
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


def routes_valid(
    checkpoint: Checkpoint, slabs: Mapping[str, SlabSpec], routes: Sequence[Route]
) -> bool:
    """Whether :func:`validate_routes` would pass, decided a column at a time.

    Validation is the same few comparisons per route, and a loop of Python statements per
    route is slow for the hundreds of thousands of a large plan. Here each check compares
    whole columns in C; only a plan that fails goes through :func:`validate_routes`, which
    finds and names the fault. The two must agree on every plan: whatever
    ``validate_routes`` accepts, this accepts too
    (``test_property_plan_column_checks_accept_what_the_route_checker_accepts``), and a plan
    this refuses only costs the slower check.
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
    return _covered_once(slabs, names, routes)


def _covered_once(slabs: Mapping[str, SlabSpec], names: list[str], routes: Sequence[Route]) -> bool:
    """Exact coverage, for :func:`_valid_columns` (``names``: each route's slab): as many
    routes into each slab as it has slots, and no two into one slot (a slot outside the
    slab's dims would take the place of one left empty)."""
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


def validate_routes(
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
            raise _shape_error(route, info, spec, shape)
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


def _shape_error(
    route: Route, info: TensorInfo, spec: SlabSpec, shape: tuple[int, ...]
) -> ShapeMismatchError:
    """The error for a route whose shape (``shape``: its tensor's, or its slice's) or size
    is not its slot's."""
    sliced = "" if route.shape is None else f" (a slice of {list(info.shape)})"
    return ShapeMismatchError(
        f"shape {list(shape)}{sliced}, slot expects {list(spec.item_shape)} ({route.describe()})",
        file=info.file,
        tensor=info.name,
        expected=spec.item_shape,
        got=shape,
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

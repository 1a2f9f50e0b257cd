"""A plan's routes as columns: one number per route per field, a :class:`Route` built only
when one is asked for.

A plan of 300,000 routes held as ``Route`` objects costs about 300 bytes a route (the object,
its slot tuple, its offsets) and a Python call per route to build; as columns it costs a few
arrays. The built-in rules (:class:`~._moe.TieredMoE`, :class:`~._rules.Dense`) claim with a
:class:`RouteTable`, and :func:`~._plan.plan` checks and merges tables a column at a time;
whoever reads ``plan.routes`` still sees a sequence of ``Route`` (equal, not identical, on
each access). A custom rule's routes stay the objects it made.
"""

from __future__ import annotations

import array
import bisect
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, overload

from ..checkpoint import Checkpoint, TensorInfo, TensorTable
from ._vocabulary import Route, SlabSpec

__all__ = ["Cut", "Pending", "RouteIndex", "RouteTable", "numbers_of", "route_column", "unravel"]

#: A route that reads part of its tensor: ``(src_offset, nbytes, shape, slice_start)``.
Cut = tuple[int, int, tuple[int, ...], int]
#: The context fields a route carries for messages, kept as numbers into their values.
_CONTEXT = ("layer", "expert", "shard", "suffix")


def unravel(linear: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The slot of row-major index ``linear`` among ``dims`` (the inverse of
    :func:`~._vocabulary.linear_index`)."""
    if len(dims) == 1:
        return (linear,)
    if not dims:
        return ()
    slot = []
    for extent in reversed(dims):
        linear, index = divmod(linear, extent)
        slot.append(index)
    return tuple(reversed(slot))


class RouteTable(Sequence[Route]):
    """Routes as columns over a checkpoint's :class:`~asyncslab.checkpoint._header.TensorTable`.

    Route ``i`` reads tensor ``tensor[i]`` (all of it, unless ``cuts`` has ``i``) into slot
    ``slot[i]`` (row-major) of ``slabs[slab[i]]``, at that slot's byte offset; its unit is
    ``units[unit[i]]`` and each context field (layer, expert, shard, suffix) is
    ``values[code[i]]`` of ``context[field]`` (absent: ``None``). A table only describes routes
    that read their own tensor's bytes at their slot's offset: the rules that make one
    build them so, and :func:`~._plan.plan` checks the rest (dtype, shape, coverage).
    """

    __slots__ = ("tensors", "slabs", "tensor", "slab", "slot", "units", "unit", "context", "cuts")

    def __init__(
        self,
        tensors: TensorTable,
        slabs: Sequence[SlabSpec],
        tensor: array.array[int],
        slab: array.array[int],
        slot: array.array[int],
        units: Sequence[str],
        unit: array.array[int],
        context: Mapping[str, tuple[array.array[int], Sequence[Any]]],
        cuts: Mapping[int, Cut] | None = None,
    ) -> None:
        n = len(tensor)
        if not len(slab) == len(slot) == len(unit) == n or any(
            len(codes) != n for codes, _ in context.values()
        ):
            raise ValueError("route columns of different lengths")
        self.tensors, self.slabs, self.tensor, self.slab, self.slot = (
            tensors,
            slabs,
            tensor,
            slab,
            slot,
        )
        self.units, self.unit, self.context = units, unit, context
        self.cuts: Mapping[int, Cut] = cuts if cuts is not None else {}

    def __len__(self) -> int:
        return len(self.tensor)

    @overload
    def __getitem__(self, index: int) -> Route: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Route, ...]: ...
    def __getitem__(self, index: int | slice) -> Route | tuple[Route, ...]:
        if isinstance(index, slice):
            return tuple(map(self._route, range(len(self))[index]))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("route index out of range")
        return self._route(index)

    def __iter__(self) -> Iterator[Route]:
        return map(self._route, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RouteTable):
            return len(self) == len(other) and all(map(operator.eq, self, other))
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(map(operator.eq, self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RouteTable({len(self)} routes into {len(self.slabs)} slabs)"

    def _route(self, i: int) -> Route:
        tensors = self.tensors
        t = self.tensor[i]
        spec = self.slabs[self.slab[i]]
        linear = self.slot[i]
        cut = self.cuts.get(i)
        if cut is None:
            src_offset, nbytes = tensors.offsets[t], tensors.kinds[tensors.ids[t]][3]
            shape: tuple[int, ...] | None = None
            start = 0
        else:
            src_offset, nbytes, shape, start = cut
        context = {name: values[codes[i]] for name, (codes, values) in self.context.items()}
        return Route(
            tensor=tensors.names[t],
            file=tensors.paths[tensors.files[t]],
            src_offset=src_offset,
            nbytes=nbytes,
            slab=spec.name,
            slot=unravel(linear, spec.slot_dims),
            dst_offset=linear * spec.slot_nbytes if linear else 0,
            unit=self.units[self.unit[i]],
            shape=shape,
            slice_start=start,
            **context,
        )

    # Columns, for the stages that read every route (scheduling, tracking).

    def names(self) -> list[str]:
        return list(map(self.tensors.names.__getitem__, self.tensor))

    def files(self) -> list[int]:
        """Each route's file number (``plan.files`` order is the table's file order)."""
        return list(map(self.tensors.files.__getitem__, self.tensor))

    def src_offsets(self) -> list[int]:
        offsets = list(map(self.tensors.offsets.__getitem__, self.tensor))
        for i, cut in self.cuts.items():
            offsets[i] = cut[0]
        return offsets

    def nbytes(self) -> list[int]:
        sizes = [kind[3] for kind in self.tensors.kinds]
        nbytes = list(map(sizes.__getitem__, map(self.tensors.ids.__getitem__, self.tensor)))
        for i, cut in self.cuts.items():
            nbytes[i] = cut[1]
        return nbytes

    def dst_offsets(self) -> list[int]:
        if self.slot.count(0) == len(self.slot):  # one slot a slab (a dense checkpoint's)
            return [0] * len(self.slot)
        # Only the slabs routed into at a slot past the first: a property call each.
        strides = [0] * len(self.slabs)
        for number in set(itertools.compress(self.slab, self.slot)):
            strides[number] = self.slabs[number].slot_nbytes
        return list(map(operator.mul, self.slot, map(strides.__getitem__, self.slab)))

    def slab_names(self) -> list[str]:
        return list(map(operator.attrgetter("name"), map(self.slabs.__getitem__, self.slab)))

    def unit_names(self) -> list[str]:
        return list(map(self.units.__getitem__, self.unit))

    def permuted(self, order: Sequence[int]) -> RouteTable:
        """The same routes in ``order`` (route ``order[k]`` becomes route ``k``)."""

        pick = operator.itemgetter(*order) if len(order) > 1 else None

        def take(column: array.array[int]) -> array.array[int]:
            if pick is None:  # itemgetter of one index gives the item, not a tuple
                return array.array(column.typecode, map(column.__getitem__, order))
            return array.array(column.typecode, pick(column))

        where = {old: new for new, old in enumerate(order) if old in self.cuts}
        return self._taken(take, {where[old]: cut for old, cut in self.cuts.items()})

    def runs(self, runs: Sequence[tuple[int, int]]) -> RouteTable:
        """The routes of ``runs`` (``[start, stop)`` of route numbers) in turn: a
        permutation made of few runs costs a slice per run and column, not a step per
        route. The table must have no cuts."""
        if self.cuts:
            raise ValueError("a table with cuts is permuted route by route")

        def take(column: array.array[int]) -> array.array[int]:
            out = array.array(column.typecode)
            for a, b in runs:
                out.extend(column[a:b])
            return out

        return self._taken(take, {})

    def _taken(
        self, take: Callable[[array.array[int]], array.array[int]], cuts: Mapping[int, Cut]
    ) -> RouteTable:
        """This table with ``take`` applied to every per-route column."""
        return RouteTable(
            self.tensors,
            self.slabs,
            take(self.tensor),
            take(self.slab),
            take(self.slot),
            self.units,
            take(self.unit),
            {name: (take(codes), values) for name, (codes, values) in self.context.items()},
            cuts,
        )

    @classmethod
    def concat(cls, tables: Sequence[RouteTable]) -> RouteTable:
        """The routes of ``tables`` in turn; they must share one tensor table."""
        tensors = tables[0].tensors
        slabs: list[SlabSpec] = []
        units: list[str] = []
        unit_number: dict[str, int] = {}
        tensor, slab, slot, unit = (array.array("I") for _ in range(4))
        values: dict[str, list[Any]] = {name: [] for name in _CONTEXT}
        codes: dict[str, array.array[int]] = {name: array.array("I") for name in _CONTEXT}
        cuts: dict[int, Cut] = {}
        for table in tables:
            if table.tensors is not tensors:
                raise ValueError("route tables over different checkpoints")
            n = len(table)
            cuts.update({len(tensor) + i: cut for i, cut in table.cuts.items()})
            tensor.extend(table.tensor)
            slab.extend(map(operator.add, table.slab, itertools.repeat(len(slabs))))
            slabs.extend(table.slabs)
            slot.extend(table.slot)
            renumber = [unit_number.setdefault(u, len(unit_number)) for u in table.units]
            unit.extend(map(renumber.__getitem__, table.unit))
            for name in _CONTEXT:
                found = table.context.get(name)
                if found is None:  # None for every route: one more value
                    codes[name].extend(array.array("I", [len(values[name])]) * n)
                    values[name].append(None)
                else:
                    own, own_values = found
                    codes[name].extend(map(operator.add, own, itertools.repeat(len(values[name]))))
                    values[name].extend(own_values)
        units = list(unit_number)
        context = {name: (codes[name], values[name]) for name in _CONTEXT}
        return cls(tensors, slabs, tensor, slab, slot, units, unit, context, cuts)


class RouteIndex(Mapping[str, int]):
    """Tensor name -> its (first) route's number in a :class:`RouteTable`, without a dict
    of its own: the checkpoint's table numbers the tensor, and a plan's routes come in the
    tensors' order, so a binary search of the table's tensor column finds its route (a
    table in another order gets an array from tensor to route)."""

    __slots__ = ("_tensors", "_column", "_route")

    def __init__(self, table: RouteTable) -> None:
        self._tensors = table.tensors
        column = self._column = table.tensor
        self._route: array.array[int] | None = None
        if not all(map(operator.le, column, itertools.islice(column, 1, None))):
            route = array.array("i", [-1]) * len(table.tensors)
            # Last first, so that a tensor routed twice is found at its first route.
            for number in range(len(column) - 1, -1, -1):
                route[column[number]] = number
            self._route = route

    def __getitem__(self, name: str) -> int:
        t = self._tensors.number(name)
        if self._route is not None:
            number = self._route[t]
        else:
            number = bisect.bisect_left(self._column, t)
            if number == len(self._column) or self._column[number] != t:
                number = -1
        if number < 0:
            raise KeyError(name)
        return number

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(map(self._tensors.names.__getitem__, self._column)))

    def __len__(self) -> int:
        return len(set(self._column))


def route_column(routes: Sequence[Route], field: str) -> list[Any]:
    """One field of every route: from a table's columns, else from the objects."""
    if isinstance(routes, RouteTable):
        getters: dict[str, Callable[[], list[Any]]] = {
            "tensor": routes.names,
            "file": lambda: list(map(routes.tensors.paths.__getitem__, routes.files())),
            "src_offset": routes.src_offsets,
            "nbytes": routes.nbytes,
            "dst_offset": routes.dst_offsets,
            "slab": routes.slab_names,
            "unit": routes.unit_names,
        }
        getter = getters.get(field)
        if getter is not None:
            return getter()
    return list(map(operator.attrgetter(field), routes))


class Pending(Mapping[str, TensorInfo]):
    """The tensors no rule has claimed yet, as the planner hands them to each rule: name ->
    :class:`TensorInfo`, each built when asked for. The built-in rules read the numbers
    (:meth:`numbers`) and the checkpoint's columns instead."""

    __slots__ = ("table", "_at")

    def __init__(self, table: TensorTable, at: dict[str, int]) -> None:
        self.table, self._at = table, at

    def numbers(self) -> Mapping[str, int]:
        """Name -> number in :attr:`table`, read-only, in the checkpoint's order."""
        return MappingProxyType(self._at)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.table.info(self._at[name])

    def __contains__(self, name: object) -> bool:
        return name in self._at

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)


def numbers_of(
    checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]
) -> Mapping[str, int] | None:
    """The numbers of ``pending`` in ``checkpoint.table`` when the planner made it (so its
    tensors are the table's), else ``None``: a rule then reads the objects."""
    if isinstance(pending, Pending) and pending.table is checkpoint.table:
        return pending.numbers()
    return None

"""The plan vocabulary, a leaf every stage shares: slabs, slots, routes, and what a rule
returns. A **slab** is one preallocated backing tensor; a **slot** is an index into its
leading dimensions; a **route** maps one checkpoint tensor (or a slice of it) to ``(slab,
slot)``; a **unit** (normally a layer) is the set of slabs whose completeness gates binding.
Rules (``_rules``, ``_moe``) build these; ``_plan`` checks them.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from ..checkpoint import Checkpoint, TensorInfo
from ..errors import PlanError

# Column getters, shared by the planner and the rules: a plan of 300,000 routes is checked
# and built a column at a time (map over attrgetters), not a route at a time.
TENSOR = operator.attrgetter("tensor")
FILE = operator.attrgetter("file")
SRC_OFFSET = operator.attrgetter("src_offset")
SLAB = operator.attrgetter("slab")
SLOT = operator.attrgetter("slot")
DST_OFFSET = operator.attrgetter("dst_offset")
SHAPE = operator.attrgetter("shape")
NBYTES = operator.attrgetter("nbytes")
DTYPE = operator.attrgetter("dtype")
ITEM_SHAPE = operator.attrgetter("item_shape")
SLOT_DIMS = operator.attrgetter("slot_dims")
NAME = operator.attrgetter("name")
OFFSET = operator.attrgetter("offset")

__all__ = [
    "SlabSpec",
    "Route",
    "Location",
    "Claim",
    "Rule",
    "make_route",
    "as_int",
    "index_number",
    "unit_of_layer",
    "mode_shape",
]


@dataclass(frozen=True, slots=True)
class SlabSpec:
    """One preallocated backing: ``shape == slot_dims + item_shape``.

    Slots are the leading ``slot_dims``; slot ``s`` starts ``linear_index(s) * slot_nbytes`` bytes
    into the backing, so every slot is one contiguous byte range. ``labels`` are for
    humans and summaries (layer, group, projection, suffix); nothing routes by them.
    """

    name: str
    unit: str
    dtype: torch.dtype
    slot_dims: tuple[int, ...]
    item_shape: tuple[int, ...]
    labels: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.slot_dims + self.item_shape

    @property
    def n_slots(self) -> int:
        return math.prod(self.slot_dims)

    @property
    def slot_nbytes(self) -> int:
        return math.prod(self.item_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_nbytes

    def slot_offset(self, slot: tuple[int, ...]) -> int:
        """Byte offset of ``slot`` within the backing."""
        linear = linear_index(slot, self.slot_dims)
        if linear < 0:
            hint = not_ints(slot)
            raise PlanError(f"slot {slot} is outside slab {self.name!r} {self.slot_dims}{hint}")
        return linear * self.slot_nbytes if linear else 0


def not_ints(slot: tuple[int, ...]) -> str:
    """What to add to a message about ``slot`` when its indices are not all ints."""
    return " (a slot is a tuple of ints)" if any(type(i) is not int for i in slot) else ""


def linear_index(slot: tuple[int, ...], dims: tuple[int, ...]) -> int:
    """The row-major index of ``slot`` among ``dims``, or -1 if it lies outside them (or
    is no slot: an index ``1.5`` passes ``0 <= 1.5 < 2`` and would make an offset between
    slots, or past the slab)."""
    if len(slot) != len(dims):
        return -1
    linear = 0  # and 0 for a slab of one tensor (most of a dense checkpoint's)
    for index, extent in zip(slot, dims, strict=True):
        if type(index) is not int or not 0 <= index < extent:
            return -1
        linear = linear * extent + index
    return linear


@dataclass(frozen=True, slots=True)
class Route:
    """One checkpoint tensor, its bytes on disk, and the slot they land in.

    ``layer``, ``expert``, ``shard`` and ``suffix`` are there for messages; an error about
    a route names all that are known. ``shape`` is set when the route carries a slice of its
    tensor (rows of a row-major tensor are one contiguous byte range), which starts
    ``slice_start`` bytes into the tensor.
    """

    tensor: str
    file: Path
    src_offset: int
    nbytes: int
    slab: str
    slot: tuple[int, ...]
    dst_offset: int
    unit: str
    layer: int | None = None
    expert: int | None = None
    shard: str | None = None
    suffix: str | None = None
    shape: tuple[int, ...] | None = None
    slice_start: int = 0

    def describe(self) -> str:
        parts = []
        if self.suffix is not None:
            parts.append(f"suffix {self.suffix!r}")
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.expert is not None:
            parts.append(f"expert {self.expert}")
        if self.shard is not None:
            parts.append(f"shard {self.shard!r}")
        parts.append(f"slab {self.slab!r} slot {self.slot}")
        return ", ".join(parts)


class Location(NamedTuple):
    """Where a tensor lands: ``slab, slot = plan.where(name)``."""

    slab: str
    slot: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Claim:
    """What one rule decided: slabs to allocate, routes into them, and tensors it owns but
    does not place (``checked``: validated markers; ``skipped``: another rank's slices)."""

    slabs: tuple[SlabSpec, ...] = ()
    routes: Sequence[Route] = ()
    checked: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    extras: Mapping[str, Any] = field(default_factory=dict)


class Rule(Protocol):
    """Claims tensors of a checkpoint. ``pending`` holds those no earlier rule claimed."""

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim: ...


def make_route(
    info: TensorInfo,
    spec: SlabSpec,
    slot: tuple[int, ...],
    *,
    rows: tuple[int, int] | None = None,
    elements: tuple[int, int] | None = None,
    **context: Any,
) -> Route:
    """A route for ``info`` (or its ``rows`` ``[start, stop)``, or its flat ``elements``
    ``[start, stop)`` in storage order, as a 1-D slice) into ``slot`` of ``spec``; rules
    call this, :func:`plan` checks it. The slot's indices may be any integers (NumPy's, an
    ``IntEnum``): they are stored as ints; a bool or a float is refused."""
    try:
        slot = tuple(map(_index, slot))
    except TypeError:
        raise PlanError(
            f"slot {slot} of {info.name!r}: a slot is a tuple of ints", tensor=info.name
        ) from None
    offset, nbytes, shape = info.offset, info.nbytes, None
    if rows is not None:
        try:
            start, stop = map(_index, rows)  # a float row would give float offsets
        except TypeError:
            raise PlanError(f"rows {rows}: expected two ints", tensor=info.name) from None
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise PlanError(f"rows {rows} are outside shape {list(info.shape)}", tensor=info.name)
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        offset, nbytes = info.offset + start * row_bytes, (stop - start) * row_bytes
        shape = (stop - start, *info.shape[1:])
        context["slice_start"] = start * row_bytes
    elif elements is not None:
        try:
            start, stop = map(_index, elements)
        except TypeError:
            raise PlanError(f"elements {elements}: expected two ints", tensor=info.name) from None
        if not 0 <= start <= stop <= info.numel:
            raise PlanError(
                f"elements {elements} are outside the {info.numel} of shape {list(info.shape)}",
                tensor=info.name,
            )
        size = info.dtype.itemsize
        offset, nbytes, shape = info.offset + start * size, (stop - start) * size, (stop - start,)
        context["slice_start"] = start * size
    return Route(
        tensor=info.name,
        file=info.file,
        src_offset=offset,
        nbytes=nbytes,
        slab=spec.name,
        slot=slot,
        dst_offset=spec.slot_offset(slot),
        unit=spec.unit,
        shape=shape,
        **context,
    )


def _index(value: Any) -> int:
    if isinstance(value, bool):  # an int to Python; never meant as a slot index
        raise TypeError("a bool")
    return operator.index(value)


def as_int(owner: str, name: str, value: Any) -> int:
    """A rule's integer argument as an int (a NumPy or IntEnum one too). Anything else is
    refused, naming it: ``rank=1.0`` from a float config would plan float offsets the load
    then fails on, and a NumPy count kept as such would give another layout fingerprint
    than the int (``test_stack_count_of_any_integer_plans_the_same_layout``)."""
    try:
        return _index(value)
    except TypeError:
        raise PlanError(f"{owner}({name}={value!r}): expected an int") from None


def index_number(text: str, what: str, info: TensorInfo) -> int:
    """A layer, expert or rank number from a tensor name, refusing absurd ones (Python's
    int() refuses over 4,300 digits with a bare ValueError; far fewer are already wrong)."""
    if len(text) > 9:
        raise PlanError(
            f"{what} number {text[:20]}... is too large", file=info.file, tensor=info.name
        )
    return int(text)


_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def unit_of_layer(name: str) -> str:
    """Default unit: ``layers.N`` for tensors of layer N, ``globals`` for the rest."""
    match = _LAYER.search(name)
    return f"layers.{match.group(1)}" if match else "globals"


def mode_shape(shapes: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """The most common shape; ties go to the smallest, so the result never depends on the
    order tensors were seen in."""
    return mode_of_counts(Counter(shapes))


def mode_of_counts(counts: Mapping[tuple[int, ...], int]) -> tuple[int, ...]:
    """:func:`mode_shape` of shapes already counted."""
    best = max(counts.values())
    return min(s for s, c in counts.items() if c == best)

"""Generic plan rules: one slab per tensor, and stacking same-shaped tensors into one slab."""

from __future__ import annotations

import array
import itertools
import operator
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .._heap import frozen_columns
from ..checkpoint import Checkpoint, TensorInfo, safetensors_dtype
from ..errors import CoverageError, DtypeMismatchError, PlanError
from ._routes import RouteTable, numbers_of
from ._vocabulary import (
    DTYPE,
    FILE,
    NAME,
    NBYTES,
    OFFSET,
    SHAPE,
    Claim,
    Route,
    Rule,
    SlabSpec,
    as_int,
    index_number,
    make_route,
    mode_shape,
    unit_of_layer,
)

__all__ = ["Dense", "Stack", "RowSlice", "default_rules"]


def _check_dtype(dtype: object, where: str) -> None:
    # A name ("bfloat16") would get as far as allocation, and fail there with an
    # AttributeError naming no rule.
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: a torch.dtype, e.g. torch.bfloat16, not {dtype!r}")


# One read-only label mapping for every dense slab, not a dict per slab.
_DENSE: Mapping[str, str] = MappingProxyType({"kind": "dense"})


@dataclass(frozen=True, slots=True)
class Dense:
    """Each matching tensor gets a slab of its own, named like the tensor, one slot.

    Its dtype is the tensor's own unless ``dtypes`` (regex -> dtype, first full match wins)
    requires one, so a checkpoint saved in the wrong precision fails at plan time.
    """

    # (?s): a tensor name may hold a newline (the reference accepts it); "every remaining
    # tensor" must mean it.
    pattern: str = r"(?s).*"
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    unit_of: Callable[[str], str] = unit_of_layer

    def __post_init__(self) -> None:
        for pattern, dtype in self.dtypes.items():
            _check_dtype(dtype, f"Dense(dtypes={{{pattern!r}: ...}})")

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        # A dense checkpoint may hold hundreds of thousands of tensors: a column at a time
        # (see frozen_columns), not a tensor at a time.
        names = list(filter(re.compile(self.pattern).fullmatch, pending))
        numbers = numbers_of(checkpoint, pending)
        if numbers is not None:
            table = checkpoint.table
            tensor = array.array("I", map(numbers.__getitem__, names))
            kinds = list(map(table.kinds.__getitem__, map(table.ids.__getitem__, tensor)))
            dtypes = list(map(operator.itemgetter(1), kinds))
            shapes = list(map(operator.itemgetter(2), kinds))
        else:
            infos = list(map(pending.__getitem__, names))
            dtypes = list(map(DTYPE, infos))
            shapes = list(map(SHAPE, infos))
        if self.dtypes:
            required = [(re.compile(p), dt) for p, dt in self.dtypes.items()]
            dtypes = [
                next((dt for p, dt in required if p.fullmatch(name)), own)
                for name, own in zip(names, dtypes, strict=True)
            ]
        units = list(map(self.unit_of, names))
        n = len(names)
        slabs = frozen_columns(
            SlabSpec,
            n,
            {"name": names, "unit": units, "dtype": dtypes, "item_shape": shapes},
            {"slot_dims": (), "labels": _DENSE},
        )
        if numbers is not None:
            unit_number = {u: i for i, u in enumerate(dict.fromkeys(units))}
            table_routes = RouteTable(
                checkpoint.table,
                slabs,
                tensor,
                array.array("I", range(n)),
                array.array("I", [0]) * n,
                list(unit_number),
                array.array("I", map(unit_number.__getitem__, units)),
                {},
            )
            return Claim(slabs=tuple(slabs), routes=table_routes)
        routes = frozen_columns(
            Route,
            n,
            {
                "tensor": names,
                "file": list(map(FILE, infos)),
                "src_offset": list(map(OFFSET, infos)),
                "nbytes": list(map(NBYTES, infos)),
                "slab": names,
                "unit": units,
            },
            {"slot": (), "dst_offset": 0},
        )
        return Claim(slabs=tuple(slabs), routes=tuple(routes))


@dataclass(frozen=True, slots=True)
class Stack:
    """Stacks tensors that differ only by an index into one slab, ``slab[index]``.

    ``pattern`` is a regex with a named group ``index`` (e.g. the layer number); the slab's
    name is the tensor name with the index replaced by ``*``. Indices must run 0..N-1 with
    none missing (checked by the planner's coverage pass). N is ``count`` if given, else the
    largest index present + 1 — which cannot notice that the *last* ones are missing, so
    pass ``count`` (e.g. the model's layer count) where it is known. Every member must have
    the same dtype — ``dtype`` if given, else the members must agree among themselves.
    """

    pattern: str
    dtype: torch.dtype | None = None
    unit: str | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            _check_dtype(self.dtype, "Stack(dtype=...)")
        if self.count is not None:
            object.__setattr__(self, "count", as_int("Stack", "count", self.count))

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        regex = re.compile(self.pattern)
        if "index" not in regex.groupindex:
            raise PlanError(f"Stack pattern {self.pattern!r} needs a named group 'index'")
        members: dict[str, list[tuple[int, TensorInfo]]] = defaultdict(list)
        for name, info in pending.items():
            match = regex.fullmatch(name)
            if match is None:
                continue
            start, end = match.span("index")
            key = name[:start] + "*" + name[end:]
            members[key].append((index_number(match.group("index"), "index", info), info))
        slabs: list[SlabSpec] = []
        fields = "tensor file src_offset nbytes slab slot dst_offset unit layer".split()
        columns: dict[str, list[Any]] = {f: [] for f in fields}
        for key, items in sorted(members.items()):
            dtype = self.dtype if self.dtype is not None else _agreed_dtype(key, items)
            shape = mode_shape(info.shape for _, info in items)
            extent = max(i for i, _ in items) + 1
            if self.count is not None:
                if extent > self.count:
                    beyond = next(info for i, info in items if i >= self.count)
                    raise CoverageError(
                        f"stacked slab {key!r}: index {extent - 1} is past count={self.count}",
                        tensor=beyond.name,
                    )
                extent = self.count
            elif extent > 2 * len(items) + 64:  # a stray huge index would allocate its size
                raise CoverageError(
                    f"stacked slab {key!r}: indices run to {extent - 1}, but only {len(items)} "
                    "tensors are present",
                    tensor=items[0][1].name,
                )
            spec = SlabSpec(key, self.unit or key, dtype, (extent,), shape, {"kind": "stack"})
            slabs.append(spec)
            indices = [i for i, _ in items]
            spec.slot_offset((min(indices),))  # refuses a negative index, naming the slot
            step = spec.slot_nbytes
            infos = [info for _, info in items]
            columns["tensor"] += map(NAME, infos)
            columns["file"] += map(FILE, infos)
            columns["src_offset"] += map(OFFSET, infos)
            columns["nbytes"] += map(NBYTES, infos)
            columns["slab"] += itertools.repeat(key, len(items))
            columns["slot"] += [(i,) for i in indices]
            columns["dst_offset"] += [i * step for i in indices]
            columns["unit"] += itertools.repeat(spec.unit, len(items))
            columns["layer"] += indices
        routes = frozen_columns(Route, len(columns["tensor"]), columns, {})
        return Claim(slabs=tuple(slabs), routes=tuple(routes))


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Tensor parallelism over a whole-tensor checkpoint: rank ``rank`` of ``world`` gets
    rows ``[rank * n / world, (rank + 1) * n / world)`` of each matching tensor.

    Rows of a row-major tensor are one contiguous byte range, so a rank reads only its own
    rows. The first dimension must divide evenly. (Column slices would need strided reads;
    they are not supported.)
    """

    pattern: str
    rank: int
    world: int
    unit_of: Callable[[str], str] = unit_of_layer

    def __post_init__(self) -> None:
        for name in ("rank", "world"):
            object.__setattr__(self, name, as_int("RowSlice", name, getattr(self, name)))

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        if not 0 <= self.rank < self.world:
            raise PlanError(f"RowSlice rank {self.rank} is outside world size {self.world}")
        regex = re.compile(self.pattern)
        slabs: list[SlabSpec] = []
        routes: list[Route] = []
        for name, info in pending.items():
            if not regex.fullmatch(name):
                continue
            if not info.shape or info.shape[0] % self.world:
                raise PlanError(
                    f"cannot split shape {list(info.shape)} by rows into {self.world} equal parts",
                    file=info.file,
                    tensor=name,
                )
            rows = info.shape[0] // self.world
            shape = (rows, *info.shape[1:])
            spec = SlabSpec(name, self.unit_of(name), info.dtype, (), shape, {"kind": "rows"})
            slabs.append(spec)
            start = self.rank * rows
            routes.append(make_route(info, spec, (), rows=(start, start + rows)))
        return Claim(slabs=tuple(slabs), routes=tuple(routes))


def _agreed_dtype(key: str, items: list[tuple[int, TensorInfo]]) -> torch.dtype:
    by_dtype: dict[torch.dtype, list[str]] = defaultdict(list)
    for _, info in items:
        by_dtype[info.dtype].append(info.name)
    if len(by_dtype) == 1:
        return next(iter(by_dtype))
    listing = "; ".join(
        f"{safetensors_dtype(dt)}: {', '.join(names[:3])}" for dt, names in by_dtype.items()
    )
    raise DtypeMismatchError(
        f"members of stacked slab {key!r} disagree on dtype ({listing}); pass dtype= to say "
        "which is right",
        tensor=items[0][1].name,
    )


def default_rules(
    *,
    tier_map: Mapping[int, Mapping[int, int]] | str | Path | None = None,
    rank: int | None = None,
) -> list[Rule]:
    """Tiered MoE experts (EXL3-like naming), then one slab per remaining tensor."""
    from ._moe import TieredMoE
    from ._partition import load_tier_map

    # Mappings too: JSON-loaded maps have string keys, and the list form needs expanding.
    declared = load_tier_map(tier_map) if tier_map is not None else None
    return [TieredMoE(tier_map=declared, rank=rank), Dense()]

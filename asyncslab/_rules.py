"""Generic plan rules: one slab per tensor, and stacking same-shaped tensors into one slab."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._errors import DtypeMismatchError, PlanError
from ._format import Checkpoint, TensorInfo, safetensors_dtype
from ._plan import Claim, Route, Rule, SlabSpec, make_route, mode_shape, unit_of_layer

__all__ = ["Dense", "Stack", "default_rules"]


@dataclass(frozen=True, slots=True)
class Dense:
    """Each matching tensor gets a slab of its own, named like the tensor, one slot.

    Its dtype is the tensor's own unless ``dtypes`` (regex -> dtype, first full match wins)
    requires one, so a checkpoint saved in the wrong precision fails at plan time.
    """

    pattern: str = r".*"
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    unit_of: Callable[[str], str] = unit_of_layer

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        regex = re.compile(self.pattern)
        required = [(re.compile(p), dt) for p, dt in self.dtypes.items()]
        slabs: list[SlabSpec] = []
        routes: list[Route] = []
        for name, info in pending.items():
            if not regex.fullmatch(name):
                continue
            dtype = next((dt for p, dt in required if p.fullmatch(name)), info.dtype)
            spec = SlabSpec(name, self.unit_of(name), dtype, (), info.shape, {"kind": "dense"})
            slabs.append(spec)
            routes.append(make_route(info, spec, ()))
        return Claim(slabs=tuple(slabs), routes=tuple(routes))


@dataclass(frozen=True, slots=True)
class Stack:
    """Stacks tensors that differ only by an index into one slab, ``slab[index]``.

    ``pattern`` is a regex with a named group ``index`` (e.g. the layer number); the slab's
    name is the tensor name with the index replaced by ``*``. Indices must run 0..N-1 with
    none missing (checked by the planner's coverage pass). Every member must have the same
    dtype — ``dtype`` if given, else the members must agree among themselves.
    """

    pattern: str
    dtype: torch.dtype | None = None
    unit: str | None = None

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
            members[key].append((int(match.group("index")), info))
        slabs: list[SlabSpec] = []
        routes: list[Route] = []
        for key, items in sorted(members.items()):
            dtype = self.dtype if self.dtype is not None else _agreed_dtype(key, items)
            shape = mode_shape(info.shape for _, info in items)
            extent = max(i for i, _ in items) + 1
            spec = SlabSpec(key, self.unit or key, dtype, (extent,), shape, {"kind": "stack"})
            slabs.append(spec)
            routes.extend(make_route(info, spec, (i,), layer=i) for i, info in items)
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
    from ._moe import TieredMoE, load_tier_map

    declared = load_tier_map(tier_map) if isinstance(tier_map, (str, Path)) else tier_map
    return [TieredMoE(tier_map=declared, rank=rank), Dense()]

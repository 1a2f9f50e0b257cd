"""Engines, zero-copy binding. What kernels use is a view of a slab — never a copy.

A module's parameters and buffers are replaced by views of slabs (or of single slots), with
shape and dtype checked; anything left unbound is an error that lists it, so a model never
runs on the random initialisation of a parameter nobody loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import torch

from ..errors import BindError

if TYPE_CHECKING:
    from ..loading import SlabSet

__all__ = ["bind_module", "Target"]

#: A slab name, ``(slab name, slot)`` for one slot of it, or ``(slab name, slot, shape)``
#: to see that slot (``()``: the whole slab) under another shape of the same elements.
Target = str | tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], tuple[int, ...]]


def bind_module(
    module: torch.nn.Module,
    slabs: SlabSet,
    mapping: Mapping[str, Target] | Callable[[str], Target | None],
    *,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Point ``module``'s parameters and buffers at slab views, by name.

    ``mapping`` maps a parameter or buffer name (``"experts.w13_k3"``) to a slab name (the
    whole slab, e.g. a tier's stacked expert weights) or ``(slab, slot)`` (one tensor; a
    prefix of the slot dimensions gives a stacked view), or ``(slab, slot, shape)`` to
    reshape that view — only ever with ``Tensor.view``, so a reshape that would need a copy
    is a :class:`BindError`, never a silent copy. A callable returns the target for
    a name or ``None`` for names it does not bind. With ``strict``, every parameter must be
    bound (buffers may stay). Returns the bound views.

    All or nothing: an unknown name, slab or slot, a shape or dtype mismatch, or (strict) an
    unbound parameter raises :class:`BindError` listing them, and slabs of incomplete units
    raise :class:`IncompleteLoadError` — in every case before anything changes.
    """
    lookup: Callable[[str], Target | None] = (
        mapping if callable(mapping) else lambda name: mapping.get(name)
    )
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    if isinstance(mapping, Mapping):
        unknown = sorted(set(mapping) - params.keys() - buffers.keys())
        if unknown:
            raise BindError(f"mapping names what the module does not have: {unknown[:10]}")

    views: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    unbound: list[str] = []
    targets, aliases = _targets(module, [*params, *buffers], lookup, problems)
    for name, current in [*params.items(), *buffers.items()]:
        if name not in targets:  # an alias of an earlier name
            continue
        target = targets[name]
        if target is None:
            if name in params:
                unbound.append(name)
            continue
        view = _view(slabs, name, current, target)
        if isinstance(view, str):
            problems.append(view)
            continue
        views[name] = view
    if problems:
        raise BindError(f"{len(problems)} cannot be bound: " + "; ".join(problems[:10]))
    if strict and unbound:
        raise BindError(
            f"{len(unbound)} parameters left unbound: {unbound[:10]}; map them or pass strict=False"
        )
    _install(module, views, params.keys())
    return views | {alias: views[first] for alias, first in aliases.items() if first in views}


def _view(slabs: SlabSet, name: str, current: torch.Tensor, target: Target) -> torch.Tensor | str:
    """The view of ``target`` that parameter or buffer ``name`` (now ``current``) is to
    become, or what keeps it from being bound."""
    if isinstance(
        current,
        torch.nn.parameter.UninitializedParameter | torch.nn.parameter.UninitializedBuffer,
    ):
        return f"{name}: uninitialized (lazy) parameter; run a forward pass first"
    resolved = _resolve(slabs, target)
    if isinstance(resolved, str):
        return f"{name}: {resolved}"
    slab_name, slot, shape = resolved
    # Basic indexing by a checked tuple of ints: always a view, never a copy.
    view = slabs.slab(slab_name) if slot is None else slabs.slot(slab_name, slot)
    if shape is not None:
        try:
            view = view.view(shape)
        except RuntimeError as err:
            return f"{name}: {slab_name} cannot be viewed as {list(shape)}: {err}"
    if view.shape != current.shape or view.dtype != current.dtype:
        where = slab_name if slot is None else f"{slab_name}{list(slot)}"
        return (
            f"{name}: module has {tuple(current.shape)} {current.dtype}, "
            f"{where} is {tuple(view.shape)} {view.dtype}"
        )
    return view


def _targets(
    module: torch.nn.Module,
    names: list[str],
    lookup: Callable[[str], Target | None],
    problems: list[str],
) -> tuple[dict[str, Target | None], dict[str, str]]:
    """Each slot's target under the first of its ``names``, and each later name of a slot
    (an alias) -> that first name; two names of one slot mapped apart go to ``problems``.

    A submodule reachable under two names: both names set one slot. Mapped under one,
    bound under both; mapped under both to different targets, the last would have won
    with no word said."""
    targets: dict[str, Target | None] = {}
    first_of: dict[tuple[int, str], str] = {}
    aliases: dict[str, str] = {}
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        place = (id(module.get_submodule(owner_name)), leaf)
        target = lookup(name)
        first = first_of.setdefault(place, name)
        if first != name:
            aliases[name] = first
            earlier = targets[first]
            if target is not None and earlier is not None and target != earlier:
                problems.append(
                    f"{name}: the same slot as {first}, which is mapped to {earlier!r}, "
                    f"not {target!r}"
                )
            targets[first] = earlier if earlier is not None else target
            continue  # bound through its first name
        targets[name] = target
    return targets, aliases


def _install(
    module: torch.nn.Module, views: Mapping[str, torch.Tensor], params: Collection[str]
) -> None:
    """Put each view in its place: a parameter (one of ``params``) or a buffer."""
    for name, view in views.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if name in params:
            # A Parameter made from a view shares its storage: binding copies nothing.
            owner._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
        else:
            owner._buffers[leaf] = view


def _resolve(
    slabs: SlabSet, target: object
) -> tuple[str, tuple[int, ...] | None, tuple[int, ...] | None] | str:
    """``(slab, slot or None)`` for a well-formed target naming a slab of the plan and a slot
    inside it, else what is wrong with it. A slot is a tuple of ints indexing the slab's
    leading slot dimensions (a prefix of them gives a stacked view, e.g. one W13 shard of
    every expert); a list is taken as a tuple, so it can never become an indexing copy."""
    shape: tuple[int, ...] | None = None
    if isinstance(target, str):
        slab_name, slot = target, None
    elif (
        isinstance(target, tuple)
        and len(target) in (2, 3)
        and isinstance(target[0], str)
        and all(_ints(part) for part in target[1:])
    ):
        slab_name, slot = target[0], tuple(target[1])
        if len(target) == 3:
            shape = tuple(target[2])
    else:
        return (
            f"target {target!r} is not a slab name, (slab name, slot) or "
            "(slab name, slot, shape) with tuples of ints"
        )
    spec = slabs.plan.slabs.get(slab_name)
    if spec is None:
        return f"no slab {slab_name!r} in the plan"
    if slot is not None and (
        len(slot) > len(spec.slot_dims)
        or not all(0 <= i < n for i, n in zip(slot, spec.slot_dims, strict=False))
    ):
        dims = list(spec.slot_dims)
        return f"slot {list(slot)} is outside slab {slab_name!r} (slot dims {dims})"
    return slab_name, slot, shape


def _ints(part: object) -> bool:
    return isinstance(part, (tuple, list)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in part
    )

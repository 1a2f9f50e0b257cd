"""Stage 7: zero-copy binding. What kernels use is a view of a slab — never a copy.

A module's parameters and buffers are replaced by views of slabs (or of single slots), with
shape and dtype checked; anything left unbound is an error that lists it, so a model never
runs on the random initialisation of a parameter nobody loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from ._errors import BindError

if TYPE_CHECKING:
    from ._loader import SlabSet

__all__ = ["bind_module", "Target"]

#: A slab name, or ``(slab name, slot)`` for one slot of it.
Target = str | tuple[str, tuple[int, ...]]


def bind_module(
    module: torch.nn.Module,
    slabs: SlabSet,
    mapping: Mapping[str, Target] | Callable[[str], Target | None],
    *,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Point ``module``'s parameters and buffers at slab views, by name.

    ``mapping`` maps a parameter or buffer name (``"experts.w13_k3"``) to a slab name (the
    whole slab, e.g. a tier's stacked expert weights) or ``(slab, slot)`` (one tensor). A
    callable returns the target for a name or ``None`` for names it does not bind. With
    ``strict``, every parameter must be bound (buffers may stay). Returns the bound views.
    Slabs of incomplete units raise :class:`IncompleteLoadError` before anything changes.
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
    for name, current in [*params.items(), *buffers.items()]:
        target = lookup(name)
        if target is None:
            if name in params:
                unbound.append(name)
            continue
        slab_name, slot = (target, None) if isinstance(target, str) else target
        view = slabs.slab(slab_name) if slot is None else slabs.slot(slab_name, slot)
        if view.shape != current.shape or view.dtype != current.dtype:
            problems.append(
                f"{name}: module has {tuple(current.shape)} {current.dtype}, "
                f"{slab_name}{'' if slot is None else list(slot)} is {tuple(view.shape)} {view.dtype}"
            )
            continue
        views[name] = view
    if problems:
        raise BindError(f"{len(problems)} mismatched: " + "; ".join(problems[:10]))
    if strict and unbound:
        raise BindError(
            f"{len(unbound)} parameters left unbound: {unbound[:10]}; map them or pass strict=False"
        )
    for name, view in views.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if name in params:
            # A Parameter made from a view shares its storage: binding copies nothing.
            owner._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
        else:
            owner._buffers[leaf] = view
    return views

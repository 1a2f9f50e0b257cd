"""Where a first load put each checkpoint tensor, kept by name for a reload.

An engine reloading its weights in place (vLLM's ``reload_weights``) runs its loader again
on a fresh iterator of checkpoint tensors; the destinations may be the same tensors or new
ones of the same geometry (vLLM restores a processed layer to the layout its loader writes,
as fresh memory). The first load recorded every destination; a :class:`Placement` keeps
those of the tensors the loader copies whole, as they are, into one place, by the
destination's *name* and byte offset, holding no tensor. At reload a :class:`Placer` looks
each destination up again (the engine's adapter says how), checks its geometry against the
recording, and hands the stream a view of the destination's own bytes to read the tensor
into: the bytes land once, where the loader will copy them from themselves (``copy_`` of a
tensor onto its own memory returns at once). Anything else (a tensor the loader transforms,
splits, or one whose destination is not as recorded) goes through the stream as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..checkpoint import Checkpoint
from ._recording import Capture

__all__ = ["Geometry", "Place", "Placement", "Placer", "placement"]


@dataclass(frozen=True, slots=True)
class Geometry:
    """A tensor as its loader addresses it, and the storage under it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int

    @staticmethod
    def of(tensor: torch.Tensor) -> Geometry:
        return Geometry(
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
            tensor.untyped_storage().nbytes(),
        )


@dataclass(frozen=True, slots=True)
class Place:
    """A checkpoint tensor (``dtype``, ``shape``) copied whole to byte ``offset`` of the
    storage of engine tensor ``target`` (``geometry`` as recorded)."""

    target: str
    offset: int
    geometry: Geometry
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Per name the loader takes (``places``), where the first load put it."""

    places: Mapping[str, Place]


def placement(
    captured: Capture,
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    leave: Iterable[str],
) -> Placement:
    """The places of the tensors ``captured`` shows copied whole and as they are into one
    destination; ``leave`` (checkpoint names: the transformed, the skipped) are not
    placed. ``names`` maps the loader's names to checkpoint names, ``tensors`` are the
    engine's (parameters and buffers) by name."""
    by_name = dict(tensors)
    left = frozenset(leave)
    runs: dict[str, list[tuple[int, int, int, int]]] = {}
    for run in captured.runs:
        runs.setdefault(run.tensor, []).append((run.src, run.nbytes, run.target, run.dst))
    places: dict[str, Place] = {}
    geometries: dict[str, Geometry] = {}  # per destination: an MoE's is shared by hundreds
    for name, found in runs.items():
        ck = names.get(name, name)
        info = checkpoint.tensors.get(ck)
        if info is None or ck in left or len(found) != 1:
            continue  # split (a tensor-parallel rank's rows) or not the checkpoint's
        src, nbytes, target, dst = found[0]
        target_name = captured.targets[target][0]
        engine_tensor = by_name.get(target_name)
        if src != 0 or nbytes != info.nbytes or engine_tensor is None:
            continue
        geometry = geometries.get(target_name)
        if geometry is None:
            geometry = geometries[target_name] = Geometry.of(engine_tensor)
        places[name] = Place(target_name, dst, geometry, info.dtype, tuple(info.shape))
    return Placement(MappingProxyType(places))


#: Looks an engine tensor up by name for a reload: the tensor, or None where it cannot be
#: written now (the engine's adapter decides: vLLM's layer already processed, say).
Resolve = Callable[[str], "torch.Tensor | None"]


@dataclass(slots=True)
class Placer:
    """``place(checkpoint name)`` for :func:`~asyncslab.engines._stream.stream_tensors`:
    a view of the bytes the loader will copy the tensor to, or None (then streamed). Counts
    what it placed, and why it declined the rest."""

    placement: Placement
    checkpoint: Checkpoint
    names: Mapping[str, str]
    resolve: Resolve
    placed: int = 0
    placed_bytes: int = 0
    declined: dict[str, int] = field(default_factory=dict)
    _engine_name: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._engine_name = {ck: name for name, ck in self.names.items()}

    def __call__(self, name: str) -> torch.Tensor | None:
        place = self.placement.places.get(self._engine_name.get(name, name))
        info = self.checkpoint.tensors[name]
        if place is None:
            return self._decline("not recorded whole in one place")
        if (info.dtype, tuple(info.shape)) != (place.dtype, place.shape):
            return self._decline("another dtype or shape than at the first load")
        target = self.resolve(place.target)
        if target is None:
            return self._decline("its destination cannot be written now")
        if Geometry.of(target) != place.geometry:
            return self._decline("its destination changed since the first load")
        flat = torch.empty(0, dtype=torch.uint8, device=target.device)
        flat.set_(target.untyped_storage(), 0, (place.geometry.storage_nbytes,), (1,))
        view = flat[place.offset : place.offset + info.nbytes].view(info.dtype).view(info.shape)
        self.placed += 1
        self.placed_bytes += info.nbytes
        return view

    def _decline(self, why: str) -> torch.Tensor | None:
        self.declined[why] = self.declined.get(why, 0) + 1
        return None

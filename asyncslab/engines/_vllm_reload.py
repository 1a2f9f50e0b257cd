"""vLLM's in-place reload, as asyncslab reads into it: where each parameter is now.

``reload_weights`` (vLLM 0.32, ``model_loader/reload``) first restores every processed
layer to the layout its weight loaders write (``initialize_layerwise_reload``: the
parameters become meta tensors, their loaders wrapped to buffer what they are given); once
a layer has been given all its elements, vLLM materializes it (fresh memory), runs the
buffered loaders into it, processes it and copies the result into the kernel tensors the
engine serves from. The parameters the first load recorded are then, by name and geometry,
the layer's materialized ones.

:func:`resolver` looks a parameter up for a :class:`~asyncslab.engines._placement.Placer`:
a meta parameter of a layer waiting for its weights is materialized here, as vLLM would
materialize it (its ``materialize_layer``), so that the tensor can be read into it; vLLM's
later materialization keeps what is no longer meta. A layer vLLM has processed already, or
a parameter vLLM does not restore (``bias``), is declined: its tensors go through the
stream and vLLM's loaders. Outside a reload (``model.load_weights`` on live parameters)
the parameter itself is the destination, as it is the loader's.

Tensors are placed where the checkpoint is in object storage: there each GET goes straight
into its parameter, where the stream would read it into a window for vLLM to copy. A local
checkpoint's bytes are in the page cache already, and handing them over as views of the
files' mappings (the stream's way, and vLLM's own reader's) for vLLM's one copy measured
faster here than reading them into the parameters (docs/vllm.md, Performance); the loader's
``place_local_files`` places them too (the tests pin the placement inside vLLM with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Generator, Mapping

import torch
from torch import nn
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
from vllm.model_executor.model_loader.reload.meta import materialize_layer

from .._units import format_bytes
from ..checkpoint import Checkpoint
from ..loading import LoadOptions
from ._hugepages import advise_huge_pages
from ._placement import Placement, Placer, Resolve
from ._stream import stream_tensors

__all__ = ["ReloadReport", "reload_tensors", "reloading", "remember", "resolver"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReloadReport:
    """What one ``get_all_weights`` did: of ``tensors``, ``placed`` (``placed_bytes``)
    were read straight into vLLM's parameters; ``declined``: why the rest were not, with
    how many."""

    tensors: int
    placed: int
    placed_bytes: int
    declined: dict[str, int]


# Per model, where its first load put each tensor: vLLM's reload asks a loader made afresh
# (``get_model_loader``), so the model, not the loader, holds it. Weak: the model's end is
# the placement's.
_PLACEMENTS: weakref.WeakKeyDictionary[nn.Module, Placement] = weakref.WeakKeyDictionary()


def remember(model: nn.Module, placement: Placement) -> None:
    _PLACEMENTS[model] = placement


def reload_tensors(
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    model: nn.Module,
    options: LoadOptions,
    log: logging.Logger,
    *,
    place_local_files: bool = False,
) -> Generator[tuple[str, torch.Tensor], None, ReloadReport]:
    """Every tensor of ``checkpoint`` by vLLM's name (``names``: vLLM's -> checkpoint's),
    for ``model.load_weights``: from object storage (or local files, with
    ``place_local_files``), those the first load recorded copied whole into one parameter
    read straight into it (handed over as a view of it, so that vLLM's copy is of the bytes
    onto themselves); the rest streamed. Runs when first iterated, inside vLLM's
    ``load_weights``: its reload has restored the layers by then. Returns (as the
    generator's value, to ``yield from``) what it did."""
    vllm_name = {ck: name for name, ck in names.items()}
    placement = _PLACEMENTS.get(model)
    placer = None
    objects = any(f.source is not None for f in checkpoint.files)
    if placement is not None and (objects or place_local_files):
        placer = Placer(placement, checkpoint, names, resolver(model, reloading(model)))
    # The collector is not paused here, as it is for the first load: the pause would span
    # the yields, and a consumer that dropped this iterator inside a reference cycle would
    # leave it paused for good (only the collector could close the iterator).
    tensors = stream_tensors(checkpoint, list(vllm_name), options=options, place=placer)
    with contextlib.closing(tensors):
        for name, tensor in tensors:
            yield vllm_name[name], tensor
    report = ReloadReport(
        len(vllm_name),
        0 if placer is None else placer.placed,
        0 if placer is None else placer.placed_bytes,
        {} if placer is None else dict(placer.declined),
    )
    if placer is None:
        log.info(
            "asyncslab reload: %d tensors handed to vLLM's loaders from %s",
            report.tensors,
            "object storage" if objects else "views of the files' mappings",
        )
        return report
    log.info(
        "asyncslab reload: %d of %d tensors (%s) read straight into vLLM's parameters%s",
        report.placed,
        report.tensors,
        format_bytes(report.placed_bytes),
        "".join(f"; {n} not: {why}" for why, n in sorted(report.declined.items())),
    )
    return report


def reloading(model: nn.Module) -> bool:
    """Whether ``model`` is inside vLLM's layerwise reload (its layers restored, waiting for
    weights). Asked before the first tensor is handed over: once a layer is processed its
    kernel tensors are back and it looks loaded."""
    return any(_waiting(module) for module in model.modules())


def _waiting(module: nn.Module) -> bool:
    info = LAYERWISE_INFO.get(module)
    return info is not None and info.can_load() and info.kernel_tensors is not None


def resolver(model: nn.Module, in_reload: bool) -> Resolve:
    """``resolve(parameter name)``, for a reload (``in_reload``) or a load into live
    parameters."""
    # Tensors materialized here, by module: what vLLM later finds there (to load the layer
    # and process it) must be these; weak, so that vLLM's freeing them is not delayed.
    ours: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref[torch.Tensor]]] = (
        weakref.WeakKeyDictionary()
    )
    lock = threading.Lock()

    def resolve(name: str) -> torch.Tensor | None:
        module_name, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return None
        # The module's own parameter or buffer only: a wrapper (LoRA's) may show its base
        # layer's weight as an attribute, which is not the module vLLM restores.
        tensor = module._parameters.get(attr, module._buffers.get(attr))
        if not isinstance(tensor, torch.Tensor):
            return None
        if not in_reload:
            return None if tensor.is_meta else tensor
        with lock:
            made = ours.get(module, {})
            if attr in made:
                return tensor if made[attr]() is tensor else None
            if not tensor.is_meta or not _waiting(module):
                return None  # never restored by vLLM (bias), or processed already
            restored = [n for n, t in _own(module) if t.is_meta]
            materialize_layer(module, LAYERWISE_INFO[module])
            made_now = dict(_own(module))
            # Fresh memory, about to be read into: huge pages before its first touch.
            advise_huge_pages(made_now[n] for n in restored if n in made_now)
            ours[module] = {n: weakref.ref(made_now[n]) for n in restored if n in made_now}
            now = made_now.get(attr)
            return now if now is not None and not now.is_meta else None

    return resolve


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]

"""vLLM's processing of a layer's weights (its modules' ``process_weights_after_loading``:
repacking, padding, requantizing) as soon as that layer has landed, while later layers are
still read, instead of after the last byte.

vLLM's own pass (``model_loader.utils.process_weights_after_loading``) processes every
module with a quantization method in module order, then the attention layers it defers,
then the model's own hook. A module is processed here, at its layer's completion, with the
same steps vLLM takes for it (its device context, the method, the parameters' TP status);
vLLM's pass then runs as always, with the method of each module processed here made a
no-op until it ends. Everything vLLM orders across layers stays in its pass, in its order:
retying, attention (KV-cache scales and the deferred processing), the model's hook and
anything outside the layers.

A module is processed early only where that cannot change what it ends with: it lies in
one layer, none of its parameters is also another layer's, its method is its own (not
shared with a module left to vLLM's pass), and the model uses no online quantization,
pre-processed weights or torchao (each of which vLLM processes in its own way).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.model_loader.utils import device_loading_context
from vllm.model_executor.utils import is_weights_pre_processed
from vllm.utils.mem_utils import release_device_memory_under_pressure

from ..planning import unit_of_layer

__all__ = ["LayerProcessing"]

#: A module and its quantization method (``module.quant_method``).
_Module = tuple[nn.Module, QuantizeMethodBase]


class LayerProcessing:
    """The modules of a model that are processed as their layer lands, by unit
    (``layers.N``, as the load names its units); called with a unit, processes its modules.
    :meth:`skipped_by_vllm` then keeps vLLM's pass from processing them again."""

    def __init__(self, modules: dict[str, list[_Module]], target: torch.device) -> None:
        self._modules = modules
        self._target = target
        self._processed: list[_Module] = []

    @staticmethod
    def of(model: nn.Module, model_config: Any, target: torch.device) -> LayerProcessing | None:
        """The model's per-layer processing, or ``None`` where vLLM processes the model in a
        way of its own (every module then waits for vLLM's pass)."""
        if is_weights_pre_processed() or getattr(model_config, "quantization", None) == "torchao":
            return None
        methods: dict[int, set[str]] = defaultdict(set)  # a method's modules' units
        units: dict[int, set[str]] = defaultdict(set)  # a storage's names' units
        candidates: list[tuple[nn.Module, QuantizeMethodBase]] = []
        seen: set[int] = set()
        for name, module in model.named_modules(remove_duplicate=False):
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                continue
            if id(module) in seen:  # one module under two names: its method's units tell
                methods[id(method)].add(unit_of_layer(f"{name}.") if name else "globals")
                continue
            seen.add(id(module))
            if method.uses_meta_device:  # online quantization: vLLM's layerwise path
                return None
            unit = unit_of_layer(f"{name}.") if name else "globals"
            # Attention is vLLM's pass's to order; a method without a __dict__ cannot be
            # made a no-op for that pass.
            if isinstance(method, BaseKVCacheMethod) or not hasattr(method, "__dict__"):
                unit = "globals"
            methods[id(method)].add(unit)
            candidates.append((module, method))
        for name, tensor in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ):
            if tensor.numel() and not tensor.is_meta:
                units[tensor.untyped_storage().data_ptr()].add(unit_of_layer(name))
        modules: dict[str, list[_Module]] = defaultdict(list)
        for module, method in candidates:
            (unit, *others) = methods[id(method)]
            if others or unit == "globals":
                continue
            own = [
                *module.parameters(recurse=False),
                *module.buffers(recurse=False),
            ]
            if all(
                units.get(t.untyped_storage().data_ptr(), {unit}) == {unit}
                for t in own
                if t.numel() and not t.is_meta
            ):
                modules[unit].append((module, method))
        return LayerProcessing(dict(modules), target) if modules else None

    @property
    def processed(self) -> int:
        """Modules processed so far."""
        return len(self._processed)

    def __call__(self, unit: str) -> None:
        """Process the modules of ``unit``, whose every byte has landed, as vLLM's pass
        would process each."""
        for module, method in self._modules.get(unit, ()):
            context = (
                device_loading_context(module, self._target)
                if method.requires_device_loading
                else contextlib.nullcontext()
            )
            with context:
                method.process_weights_after_loading(module)
            # As vLLM's pass does: fresh parameters are stamped with the global rank.
            update = getattr(module, "update_param_tp_status", None)
            if update is not None:
                update()
            release_device_memory_under_pressure(self._target)
            self._processed.append((module, method))

    @contextlib.contextmanager
    def skipped_by_vllm(self) -> Iterator[None]:
        """Inside, vLLM's pass leaves the modules processed here as they are: their
        methods' ``process_weights_after_loading`` does nothing (set on the method itself,
        so that a check of its type, in a model's hook, still sees what it is)."""
        methods = {id(method): method for _, method in self._processed}
        for method in methods.values():
            method.process_weights_after_loading = _processed  # type: ignore[method-assign]
        try:
            yield
        finally:
            for method in methods.values():
                del method.process_weights_after_loading


def _processed(layer: nn.Module) -> None:
    """A method's processing of a module processed already, as its layer landed."""

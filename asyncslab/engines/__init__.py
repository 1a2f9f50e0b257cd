"""The engine stage: binding into modules, recording an engine's own loaders, planning into
its tensors, the engine-neutral load into them, vLLM.

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._binding import Target as Target
from ._binding import bind_module as bind_module

__all__ = [
    "Target",
    "bind_module",
]

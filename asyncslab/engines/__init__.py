"""The engine stage: binding into modules, recording an engine's own loaders, planning into
its tensors, the engine-neutral load into them, vLLM.

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

"""The engine stage: binding into modules, recording an engine's own loaders, planning into its tensors, vLLM.

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

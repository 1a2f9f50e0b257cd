"""The checkpoint stage: safetensors headers and index, validated, and the sources they are
read from (local files, objects).

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

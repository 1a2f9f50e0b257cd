"""The checkpoint stage: safetensors headers and index, validated, and the sources they are
read from (local files, objects: how an object is reached and read belongs to ``_objects``).

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._format import INDEX_SUFFIX as INDEX_SUFFIX
from ._format import Checkpoint as Checkpoint
from ._format import ShardFile as ShardFile
from ._format import TensorInfo as TensorInfo
from ._header import TensorTable as TensorTable
from ._header_parse import safetensors_dtype as safetensors_dtype

__all__ = [
    "Checkpoint",
    "INDEX_SUFFIX",
    "ShardFile",
    "TensorInfo",
    "TensorTable",
    "safetensors_dtype",
]

"""The checkpoint stage: safetensors headers and index, validated, and the sources they are
read from (local files, objects).

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._format import INDEX_SUFFIX as INDEX_SUFFIX
from ._format import Checkpoint as Checkpoint
from ._format import ShardFile as ShardFile
from ._format import TensorInfo as TensorInfo
from ._header import TensorTable as TensorTable
from ._header_parse import safetensors_dtype as safetensors_dtype
from ._object_store import client as client
from ._object_store import endpoint as endpoint
from ._object_store import etag_of as etag_of
from ._object_store import failure_kind as failure_kind
from ._object_store import parse_uri as parse_uri
from ._object_store import pinned as pinned
from ._object_store import redacted as redacted
from ._object_store import refused as refused
from ._object_store import store_spec as store_spec
from ._source import SCHEMES as SCHEMES
from ._source import ObjectPath as ObjectPath

__all__ = [
    "Checkpoint",
    "INDEX_SUFFIX",
    "ObjectPath",
    "SCHEMES",
    "ShardFile",
    "TensorInfo",
    "TensorTable",
    "client",
    "endpoint",
    "etag_of",
    "failure_kind",
    "parse_uri",
    "pinned",
    "redacted",
    "refused",
    "safetensors_dtype",
    "store_spec",
]

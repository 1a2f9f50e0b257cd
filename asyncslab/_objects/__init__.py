"""Objects in a bucket (``s3://``, ``gs://``, ``az://``), through obstore (the Python bindings
of Rust's object_store crate): one part under every stage, as ``_os`` is for files.

What an object is (:class:`ObjectLocation`: its bucket's :class:`StoreSpec`, its key, the ETag
and generation it was found with; its name, an :class:`ObjectPath`), how its bucket is
reached (:func:`client`: settings and credentials from ``storage_options`` and the
environment, :func:`endpoint`, :func:`redacted` for every message), what a failure means
(:func:`failure_kind`, :func:`refused`), how objects are found (:func:`listing`,
:func:`head`) and how their bytes are read: by ranged GETs pinned to the version found,
retried within a deadline with jittered backoff (:class:`Retries`), into the client's
buffer or, presigned, straight into the caller's memory (:class:`ObjectReads`).

Internal: the stages import these names from here, never from the private modules; none of
them takes a checkpoint's, a plan's or a load's types (an object's errors are those a local
file would give). obstore is imported on first use only.
"""

from ._client import client as client
from ._client import failure_kind as failure_kind
from ._client import refused as refused
from ._get import ObjectReads as ObjectReads
from ._get import read_object as read_object
from ._get import read_range as read_range
from ._listing import head as head
from ._listing import listing as listing
from ._location import SCHEMES as SCHEMES
from ._location import ObjectLocation as ObjectLocation
from ._location import ObjectPath as ObjectPath
from ._location import StoreSpec as StoreSpec
from ._location import bucket_of as bucket_of
from ._location import parse_uri as parse_uri
from ._location import store_spec as store_spec
from ._pinning import etag_of as etag_of
from ._presigned import presigns as presigns
from ._retry import Retries as Retries
from ._settings import endpoint as endpoint
from ._settings import redacted as redacted

__all__ = [
    "SCHEMES",
    "ObjectLocation",
    "ObjectPath",
    "ObjectReads",
    "Retries",
    "StoreSpec",
    "bucket_of",
    "client",
    "endpoint",
    "etag_of",
    "failure_kind",
    "head",
    "listing",
    "parse_uri",
    "presigns",
    "read_object",
    "read_range",
    "redacted",
    "refused",
    "store_spec",
]

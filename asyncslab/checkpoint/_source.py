"""Where a checkpoint's bytes come from: the vocabulary every source shares.

A local file and an object in a bucket differ only in the source a shard's reads go
through (Rust's object_store puts every backend behind one trait with ranged reads; PyTorch
DCP has its ``StorageReader``). Headers are read through :class:`ByteSource` at open time;
a shard's :attr:`ShardFile.source <asyncslab.ShardFile>` is ``None`` for a local file and an
:class:`ObjectLocation` for an object, which is how the loader knows to fetch its payload with
ranged GETs. What an object is, and how it is read, belongs to ``asyncslab._objects``; its
names are re-exported here for the stage's own modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .._objects import SCHEMES, ObjectLocation, ObjectPath, StoreSpec

__all__ = ["ByteSource", "ObjectLocation", "ObjectPath", "StoreSpec", "SCHEMES"]


class ByteSource(Protocol):
    """One shard's bytes, read by range while its header is read (``path``: what errors
    name; ``size``: the file's or object's size when it was opened)."""

    path: Path
    size: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` at ``offset`` (raising the checkpoint error that says why not)."""
        ...

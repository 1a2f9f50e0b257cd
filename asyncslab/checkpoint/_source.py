"""Where a checkpoint's bytes come from: the vocabulary every source shares.

A local file and an object in a bucket differ only in the source a shard's reads go
through (Rust's object_store puts every backend behind one trait with ranged reads; PyTorch
DCP has its ``StorageReader``). Headers are read through :class:`ByteSource` at open time;
a shard's :attr:`ShardFile.source <asyncslab.ShardFile>` is ``None`` for a local file and an
:class:`ObjectLocation` for an object, which is how the loader knows to fetch its payload with
ranged GETs. Plain data: no client library is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PosixPath
from typing import Protocol

__all__ = ["ByteSource", "ObjectLocation", "ObjectPath", "StoreSpec", "SCHEMES"]

#: URI schemes opened through the object-store client (``azure://`` and ``abfs://`` name
#: the same service as ``az://``).
SCHEMES = ("s3", "gs", "az", "azure", "abfs")


class ObjectPath(PosixPath):
    """``s3://bucket/key`` as a :class:`~pathlib.Path`: what :attr:`ShardFile.path` and
    :attr:`TensorInfo.file` hold for an object, so that plans, schedules and errors treat
    an object as they treat a file (it hashes, compares and names itself by its URI).

    ``str()`` and ``os.fspath()`` give the URI; ``name`` is the key's last part. It is no
    local file: asking the file system about it finds nothing there."""

    def __str__(self) -> str:
        scheme, *rest = self.parts or ("",)
        if not scheme.endswith(":"):  # a relative part (``relative_to`` the root)
            return "/".join(self.parts)
        return f"{scheme}//{'/'.join(rest)}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    @classmethod
    def of(cls, scheme: str, bucket: str, key: str = "") -> ObjectPath:
        return cls(f"{scheme}:/{bucket}/{key}" if key else f"{scheme}:/{bucket}")


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """How to reach one bucket: its scheme and name, and the client settings given to
    :meth:`Checkpoint.open <asyncslab.Checkpoint.open>` (``storage_options``), which may hold
    secrets: they never appear in a repr or an error."""

    scheme: str
    bucket: str
    options: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def settings(self) -> Mapping[str, str]:
        return dict(self.options)

    def secrets(self) -> list[str]:
        """The values an error must never show (keys, secrets, tokens, signatures)."""
        marks = ("secret", "token", "key", "password", "signature", "sas")
        return [v for k, v in self.options if v and any(m in k.lower() for m in marks)]


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """One object as it was when the checkpoint was opened: its bucket (``store``), its key,
    its ETag and version. Every payload request is pinned to ``etag`` (``If-Match``), so a
    replaced object is refused, never read as a mix of two versions."""

    store: StoreSpec
    key: str
    etag: str | None
    version: str | None = None

    @property
    def uri(self) -> str:
        return f"{self.store.scheme}://{self.store.bucket}/{self.key}"


class ByteSource(Protocol):
    """One shard's bytes, read by range while its header is read (``path``: what errors
    name; ``size``: the file's or object's size when it was opened)."""

    path: Path
    size: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` at ``offset`` (raising the checkpoint error that says why not)."""
        ...

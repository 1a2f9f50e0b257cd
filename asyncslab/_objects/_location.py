"""What an object is: its bucket (:class:`StoreSpec`), its key, and the version it had when
it was found (:class:`ObjectLocation`); its name as a path (:class:`ObjectPath`); a URI read
into them. Plain data: no client library is imported here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PosixPath

from ..errors import CheckpointError

__all__ = [
    "SCHEMES",
    "ObjectLocation",
    "ObjectPath",
    "StoreSpec",
    "bucket_of",
    "parse_uri",
    "store_spec",
]

#: URI schemes read through the object-store client (``azure://`` and ``abfs://`` name the
#: same service as ``az://``).
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
    """One object as it was when it was found: its bucket (``store``), its key, its ETag and
    version (a GCS object's generation). Every request for its bytes is pinned to ``etag``
    (``If-Match``), and to ``version`` where one was recorded, so a replaced object is
    refused, never read as a mix of two versions."""

    store: StoreSpec
    key: str
    etag: str | None
    version: str | None = None

    @property
    def uri(self) -> str:
        return f"{self.store.scheme}://{self.store.bucket}/{self.key}"

    @property
    def path(self) -> ObjectPath:
        """What errors about the object name."""
        return ObjectPath.of(self.store.scheme, self.store.bucket, self.key)


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ``("s3", "bucket", "a/b")``."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise CheckpointError(f"{uri!r} names no bucket: expected {scheme}://bucket/prefix")
    return scheme, bucket, key.strip("/")


def store_spec(scheme: str, bucket: str, options: Mapping[str, object]) -> StoreSpec:
    """The bucket ``scheme://bucket`` with ``options`` (``storage_options``: names to str,
    bool or numbers) as its settings."""
    settings = []
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, (str, bool, int, float)):
            raise TypeError(
                f"storage_options maps names to str, bool or numbers; got {key!r}: "
                f"{type(value).__name__}"
            )
        text = str(value).lower() if isinstance(value, bool) else str(value)
        settings.append((key.lower(), text))
    return StoreSpec(scheme, bucket, tuple(sorted(settings)))


def bucket_of(uri: str, options: Mapping[str, object]) -> tuple[StoreSpec, str]:
    """The bucket ``uri`` names (``azure://`` and ``abfs://`` as ``az://``), with
    ``options`` as its settings, and the key or prefix in it."""
    scheme, bucket, key = parse_uri(uri)
    if scheme in ("azure", "abfs"):
        scheme = "az"
    return store_spec(scheme, bucket, options), key

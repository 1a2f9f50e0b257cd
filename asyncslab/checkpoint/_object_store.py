"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``) opened: a prefix, an
index or one object found (``asyncslab._objects``: listing, clients, pinned GETs), and every
rule a local checkpoint gets applied to them.

Opening lists the prefix (every page of it), reads the index if there is one and each shard's
header with ranged GETs, and applies the header rules, the index's path safety (a name may not
leave the prefix), and each object's size against the data end its header declares. Each
object's ETag is recorded then, and every later request for it (the headers' too) is pinned
to it (and to its generation, on GCS), so an object replaced meanwhile is refused, never read
as a mix of two versions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .._objects import (
    ObjectLocation,
    ObjectPath,
    StoreSpec,
    bucket_of,
    client,
    etag_of,
    head,
    listing,
    read_range,
)
from ..errors import CheckpointError, IndexFileError, MissingFileError
from ._header import INDEX_NAME, INDEX_SUFFIX, ShardFile, TensorInfo, shard_of
from ._index import Index, check_name, choose_index, index_of_text

__all__ = ["Found", "open_objects"]

#: Bytes fetched from each object's start at open: one GET holds the header of nearly every
#: checkpoint (a larger header takes one more).
HEADER_PREFETCH = 1 << 20
#: Header GETs in flight at open.
OPEN_REQUESTS = 16


class _ObjectSource:
    """One object's bytes for :func:`~._header.shard_of` (a :class:`~._source.ByteSource`):
    its first :data:`HEADER_PREFETCH` bytes fetched whole on the first read, every GET
    pinned to the ETag the listing gave (and to the generation the first response named);
    :attr:`location` is final once the first read returned."""

    def __init__(
        self, store: Any, location: ObjectLocation, path: ObjectPath, meta: Mapping[str, Any]
    ) -> None:
        self.store, self.location = store, location
        self.path: Path = path
        self.size = int(meta["size"])
        self.mtime_ns = _nanoseconds(meta.get("last_modified"))
        self._first: bytes | None = None

    def read(self, offset: int, nbytes: int) -> bytes:
        if self._first is None:
            self._first = self._get(0, min(self.size, HEADER_PREFETCH))
        if offset + nbytes <= len(self._first):
            return self._first[offset : offset + nbytes]
        return self._get(offset, offset + nbytes)

    def _get(self, start: int, end: int) -> bytes:
        data, self.location = read_range(self.store, self.location, start, end)
        return data


@dataclass(frozen=True, slots=True)
class Found:
    """An object-store checkpoint's pieces, for :class:`~._format.Checkpoint`."""

    root: ObjectPath
    shards: Sequence[tuple[ShardFile, list[TensorInfo]]]
    index_path: ObjectPath | None
    index: Index | None
    index_files: Mapping[str, Path]


def open_objects(uri: str, storage_options: Mapping[str, object]) -> Found:
    """The checkpoint at ``uri``: a prefix (its ``*.safetensors`` and index), an index, or
    one object."""
    spec, key = bucket_of(uri, storage_options)
    store = client(spec)
    if key.endswith(".json") and not key.endswith(INDEX_SUFFIX):
        raise CheckpointError(
            f"{uri} is a JSON object, not a safetensors file: open a .safetensors object, an "
            "index (*.safetensors.index.json) or the checkpoint's prefix",
            file=ObjectPath.of(spec.scheme, spec.bucket, key),
        )
    if key.endswith(".safetensors"):
        metas = {key: head(store, spec, key)}
        return _of_objects(store, spec, _parent(key), [key], metas, None)
    if key.endswith(INDEX_SUFFIX):
        prefix = _parent(key)
        metas = listing(store, spec, prefix)
        if key not in metas:
            metas[key] = head(store, spec, key)  # raises: the index is not there
        return _of_objects(store, spec, prefix, [], metas, key)
    return _of_prefix(store, spec, key)


def _of_prefix(store: Any, spec: StoreSpec, key: str) -> Found:
    """The checkpoint under the prefix ``key``: its index, else its ``*.safetensors``
    (else the one object ``key`` names, without its suffix)."""
    metas = listing(store, spec, key)
    root = ObjectPath.of(spec.scheme, spec.bucket, key)
    if not metas:
        try:  # one object named without its suffix?
            metas = {key: head(store, spec, key)} if key else {}
        except MissingFileError:
            pass
        if not metas:
            raise MissingFileError("no *.safetensors objects and no index", file=root)
        return _of_objects(store, spec, _parent(key), [key], metas, None)
    children = sorted(k for k in metas if "/" not in k[len(key) + 1 if key else 0 :])
    names = [k.rpartition("/")[2] for k in children]
    index_key = None
    if INDEX_NAME in names:
        index_key = _join(key, INDEX_NAME)
    else:
        others = [n for n in names if n.endswith(INDEX_SUFFIX) and not n.startswith(".")]
        chosen = choose_index(others, root)
        index_key = None if chosen is None else _join(key, chosen)
    if index_key is not None:
        return _of_objects(store, spec, key, [], metas, index_key)
    shards = [k for k, n in zip(children, names, strict=True) if n.endswith(".safetensors")]
    if not shards:
        raise MissingFileError("no *.safetensors objects and no index", file=root)
    return _of_objects(store, spec, key, shards, metas, None)


def _parent(key: str) -> str:
    return key.rpartition("/")[0]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _of_objects(
    store: Any,
    spec: StoreSpec,
    prefix: str,
    keys: list[str],
    metas: Mapping[str, Mapping[str, Any]],
    index_key: str | None,
) -> Found:
    root = ObjectPath.of(spec.scheme, spec.bucket, prefix)
    paths = {k: ObjectPath.of(spec.scheme, spec.bucket, k) for k in keys}
    index = None
    index_path = None
    index_files: dict[str, Path] = {}
    if index_key is not None:
        index_path = ObjectPath.of(spec.scheme, spec.bucket, index_key)
        source = _source(store, spec, index_key, metas[index_key])
        text = _index_text(source)
        index = index_of_text(text, index_path, lambda: _index_text(source))
        keys = []
        for name in dict.fromkeys(index.files):
            key = _join(prefix, str(check_name(root, name, index_path)))
            if key in paths:
                raise IndexFileError(
                    f"{_named(index_files, paths[key])!r} and {name!r} name the same object",
                    file=index_path,
                )
            if key not in metas:
                raise MissingFileError(
                    f"object does not exist (the index {index_path} names {name!r})",
                    file=ObjectPath.of(spec.scheme, spec.bucket, key),
                )
            paths[key] = ObjectPath.of(spec.scheme, spec.bucket, key)
            index_files[name] = paths[key]
            keys.append(key)
    sources = [_source(store, spec, k, metas[k], paths[k]) for k in keys]
    return Found(root, _headers(sources), index_path, index, index_files)


def _named(index_files: Mapping[str, Path], path: Path) -> str:
    return next(name for name, p in index_files.items() if p is path)


def _source(
    store: Any,
    spec: StoreSpec,
    key: str,
    meta: Mapping[str, Any],
    path: ObjectPath | None = None,
) -> _ObjectSource:
    location = ObjectLocation(spec, key, etag_of(meta), meta.get("version"))
    path = path or ObjectPath.of(spec.scheme, spec.bucket, key)
    return _ObjectSource(store, location, path, meta)


def _index_text(source: _ObjectSource) -> str:
    try:
        return source.read(0, source.size).decode("utf-8")
    except UnicodeDecodeError as err:
        raise IndexFileError(f"cannot read index: {err}", file=source.path) from err


def _headers(sources: Sequence[_ObjectSource]) -> list[tuple[ShardFile, list[TensorInfo]]]:
    """Every source's header, :data:`OPEN_REQUESTS` at a time (each waits a round trip; the
    client releases the GIL while it waits)."""
    if len(sources) <= 1:
        return [_header(s) for s in sources]
    workers = min(OPEN_REQUESTS, len(sources))
    with concurrent.futures.ThreadPoolExecutor(workers, "asyncslab-open") as pool:
        return list(pool.map(_header, sources))


def _header(source: _ObjectSource) -> tuple[ShardFile, list[TensorInfo]]:
    shard, tensors = shard_of(source, inode=0, mtime_ns=source.mtime_ns)
    # The location as the reads left it (pinned to the generation they found).
    return dataclasses.replace(shard, source=source.location), tensors


def _nanoseconds(when: datetime | None) -> int:
    return 0 if when is None else int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000

"""Ranged GETs of objects, each pinned to the version found (``_pinning``): one while an
object is opened (:func:`read_range`), and a load's, retried within its deadline
(``_retry``), into the client's buffer (:func:`fetch`, through obstore) or straight into the
caller's memory (:func:`fetch_into`, presigned: ``_presigned``). :class:`ObjectReads` holds
what a set of objects' GETs share: a client per bucket, a signer per client, a connection
per thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CheckpointError
from ._client import client, failure_kind, refused
from ._location import ObjectLocation
from ._pinning import check_etag, etag_of, pinned, with_version
from ._presigned import Connections, Signer, get_into, signer_of
from ._retry import Retries, retried

__all__ = ["ObjectReads", "fetch", "fetch_into", "read_object", "read_range"]


def read_object(store: Any, location: ObjectLocation) -> bytes:
    """The whole of ``location`` in one GET pinned to its ETag, not retried; a refusal
    raises the checkpoint error a local file would."""
    import obstore

    options: dict[str, Any] = {}
    if location.etag is not None:
        options["if_match"] = location.etag
    try:
        return bytes(obstore.get(store, location.key, options=options).bytes())  # type: ignore[arg-type]
    except Exception as err:
        raise refused(err, "reading the object", location.path, location.store) from None


def read_range(
    store: Any, location: ObjectLocation, start: int, end: int
) -> tuple[bytes, ObjectLocation]:
    """Bytes ``[start, end)`` of ``location`` in one GET, not retried (an object being
    opened), and the location pinned to the generation the response named (GCS). A
    replaced, missing or refused object raises the checkpoint error a local file would."""
    import obstore

    what = f"reading bytes {start}-{end - 1}"
    try:
        result = obstore.get(store, location.key, options=pinned(location, start, end))
        meta = result.meta
        data = bytes(result.bytes())
    except Exception as err:
        if location.version is not None and failure_kind(err) == "missing":
            raise _replaced(location, what, None) from None  # that generation is gone
        raise refused(err, what, location.path, location.store) from None
    got = etag_of(meta)
    if location.etag is not None and got is not None and got != location.etag:
        raise _replaced(location, what, got)
    if len(data) != end - start:
        raise CheckpointError(
            f"{what}: got {len(data)} bytes (object truncated?)",
            file=location.path,
            expected=end - start,
            got=len(data),
        )
    return data, with_version(location, meta)


def _replaced(location: ObjectLocation, what: str, got: str | None) -> CheckpointError:
    now = "is gone" if got is None else f"now has ETag {got}"
    return CheckpointError(
        f"{what}: the object changed while it was opened (ETag {location.etag} listed, it {now})",
        file=location.path,
    )


def fetch(
    store: Any,
    location: ObjectLocation,
    offset: int,
    nbytes: int,
    retries: Retries,
    headers_arrived: Callable[[], None] | None = None,
) -> Any:
    """Bytes ``[offset, offset + nbytes)`` of ``location``, in one ranged GET pinned to its
    ETag, retried as ``retries`` says (``store``: from :func:`~._client.client` with
    ``retries.attempt_timeout`` and no retries of its own; ``headers_arrived``: called once
    an attempt's response headers came, before its body is collected). Returns the client's
    buffer (it supports the buffer protocol)."""
    import obstore

    options = pinned(location, offset, offset + nbytes)

    def attempt() -> Any:
        result = obstore.get(store, location.key, options=options)
        check_etag(location, etag_of(result.meta))
        if headers_arrived is not None:
            headers_arrived()
        data = result.bytes()
        if len(data) != nbytes:
            raise ValueError(f"the response held {len(data)} of {nbytes} bytes")
        return data

    return retried(attempt, store, location, offset, nbytes, retries)


def fetch_into(
    connections: Connections,
    worker: int,
    signer: Signer,
    store: Any,
    location: ObjectLocation,
    offset: int,
    regions: Sequence[tuple[int, int]],
    retries: Retries,
) -> None:
    """:func:`fetch`'s twin for a presigned GET: the body read into ``regions``
    (``(address, nbytes)`` pairs, in order), each attempt on ``worker``'s connection; the
    same retries and errors (``store``: to look up a changed object's ETag)."""
    nbytes = sum(size for _, size in regions)
    timeout = retries.attempt_timeout

    def attempt() -> None:
        got = get_into(connections, worker, signer, location, offset, regions, timeout)
        check_etag(location, got)

    retried(attempt, store, location, offset, nbytes, retries)


class ObjectReads:
    """Ranged GETs of ``locations`` (by index) on ``workers`` threads, each retried as
    ``retries`` says: presigned, the body read straight into memory, where ``presigned``
    and the store signs (:meth:`signs`), else through obstore. Each bucket's client is
    made now (a client that cannot be configured fails here), asked to sign once; each
    thread has a connection of its own. :meth:`close` once the threads drained."""

    def __init__(
        self,
        locations: Sequence[ObjectLocation],
        retries: Retries,
        workers: int,
        presigned: bool,
    ) -> None:
        self.locations, self.retries = locations, retries
        self.stores = [client(loc.store, retries.attempt_timeout, retry=False) for loc in locations]
        by_store: dict[int, Signer | None] = {}
        for location, store in zip(locations, self.stores, strict=True):
            if presigned and id(store) not in by_store:
                by_store[id(store)] = signer_of(location, store)
        self.signers = [by_store.get(id(store)) for store in self.stores]
        self.connections = Connections(workers)

    def signs(self, index: int) -> bool:
        """Whether GETs of object ``index`` are presigned (:meth:`fetch_into`)."""
        signer = self.signers[index]
        return signer is not None and signer.signs(self.locations[index].key)

    def fetch(
        self,
        index: int,
        offset: int,
        nbytes: int,
        headers_arrived: Callable[[], None] | None = None,
    ) -> Any:
        """:func:`fetch` of object ``index``: the client's buffer."""
        location, store = self.locations[index], self.stores[index]
        return fetch(store, location, offset, nbytes, self.retries, headers_arrived)

    def fetch_into(
        self, worker: int, index: int, offset: int, regions: Sequence[tuple[int, int]]
    ) -> None:
        """:func:`fetch_into` of object ``index``, on ``worker``'s connection (where
        :meth:`signs`)."""
        signer = self.signers[index]
        assert signer is not None
        location, store = self.locations[index], self.stores[index]
        fetch_into(self.connections, worker, signer, store, location, offset, regions, self.retries)

    def close(self) -> None:
        self.connections.close()

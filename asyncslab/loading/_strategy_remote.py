"""The object-store transfer: the schedule's reads as ranged GETs (shards opened from
``s3://``, ``gs://`` or ``az://``; see ``checkpoint/_object_store``).

The same coalesced reads as a local load, cut at ``LoadOptions.request_size``, each fetched
by one GET pinned to the ETag recorded when the checkpoint was opened (``If-Match``, and the
ETag of every response checked too). ``request_concurrency`` I/O threads each take the next
read themselves (``_read.ReadFeed``), fetch it, and write its bytes once. A GET is made one
of two ways:

- presigned (``_presigned``; ``s3://`` and ``az://`` where the store can sign, the
  default): the standard library's HTTP client reads the body straight into the read's
  slots, as a local direct read scatters (gaps to a scratch buffer), or for a staged load
  into the thread's own staging buffer, then to the device (``_copy``). No client buffer;
- through obstore (:func:`fetch`; ``gs://``, a store that cannot sign, a proxy,
  ``presigned_gets=False``): the client collects the body into a buffer of its own, copied
  into the slots by ``memmove`` on the thread (``_copy.HostCopier``) or into the staging
  buffer.

Either way at most ``request_concurrency`` reads of at most ``request_size`` bytes are in
flight, whatever the checkpoint's size. The client waits with the GIL released, as
``preadv`` does; landing, progress, the ``read_timeout`` watch, cancellation (threads drained
before the load returns) are the local load's, unchanged.

obstore's responses should also be all the memory such a load holds, and the C allocator
decides that: the client collects each body into one buffer, allocated by the thread that
waits for it, and with glibc an arena per thread keeps what that thread frees for reuse. Two
choices make each thread reuse one buffer instead of accumulating several. The reads are cut
at exactly ``request_size`` (``schedule(fill=True)``), so responses have one size and a freed
one always fits the next. And a thread keeps its last response until the next one's headers
have arrived, freeing it just before that body is collected: freed earlier, the small
allocations of the request in between would be carved out of it, and the next body would
no longer fit.

A response cut short, a dropped connection or a 5xx is retried (``request_retries`` times,
backoff doubling from 50 ms); the attempts and the waits between them share ``read_timeout``
(each attempt's share enforced by the client: obstore's limit on the whole request; for a
presigned GET, the same limit on every wait of its socket), so a server that stops answering
fails the load within ``read_timeout`` and no GET outlives the load's drain.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ..checkpoint import ShardFile, client, etag_of, failure_kind, pinned, redacted
from ..errors import FileChangedError, LoadError, ReadError, ReadTimeoutError
from ..planning import Plan
from ._copy import Copier, direct_scatters, host_copy
from ._options import LoadOptions
from ._pinned import StagingBuffers, StagingStatistics, staging_budget
from ._presigned import Connections, Signer, get_into, signer_of
from ._read import byte_view
from ._schedule import ReadOp, schedule
from ._sink import Files, ReadOne, Reads, Sink, named_copy
from ._strategy_staged import staging_buffer

__all__ = [
    "Remote",
    "fetch",
    "fetch_into",
    "reads_objects",
    "request_limits",
    "response_tensor",
    "signers_of",
    "store_of",
]

_T = TypeVar("_T")

_BACKOFF_S = 0.05
_BACKOFF_MAX_S = 1.0


def reads_objects(plan: Plan) -> bool:
    """Whether ``plan``'s shards are objects (all of them; a plan mixing files and objects
    is refused)."""
    remote = [f.source is not None for f in plan.files]
    if any(remote) and not all(remote):
        raise LoadError("a plan mixing local files and objects cannot be loaded")
    return bool(remote) and all(remote)


class Remote:
    """Ranged GETs on ``request_concurrency`` I/O threads (see the module's docstring)."""

    name = "remote"

    def __init__(self, options: LoadOptions, device: torch.device, copier: Copier) -> None:
        self.workers = options.request_concurrency
        self._staged = device.type == "cuda" or options.transfer in ("staged", "mapped")
        self._pin = device.type == "cuda"
        self.read_size = options.request_size
        self.staging_budget = 0
        if self._staged:
            # One staging buffer per thread, as large as a request (or the budget's share).
            budget = min(options.staging_bytes, self.workers * options.request_size)
            self.staging_budget = staging_budget(max(budget, self.workers), self.workers, self._pin)
            self.read_size = self.staging_budget // self.workers
        self._attempts, self._timeout = request_limits(options)
        self._copier = copier
        self._presigned = options.presigned_gets
        self._staging: StagingBuffers | None = None
        self._connections: Connections | None = None
        self._held: list[Any] = []  # each thread's last response (see the module's docstring)

    def plan(self, sink: Sink, gap: int) -> Reads:
        sched = schedule(sink.plan, max_read=self.read_size, gap=gap, fill=True)
        # A presigned GET onto the CPU reads its body straight into the slots, as a local
        # direct read. Worked out whatever the options: a SlabSet keeps one read plan per
        # transfer, read size and gap, and the next load's options may differ.
        scratch = torch.empty(max(1, gap), dtype=torch.uint8)
        scatters = direct_scatters(sched.ops, sink.addresses(), scratch.data_ptr())
        return Reads(sched, scatters, scratch)

    def open(self, reads: Reads, files: Files, sink: Sink) -> ReadOne:
        shards = sink.plan.files
        stores = [store_of(shard, self._timeout) for shard in shards]
        ops, paths, scatters = reads.schedule.ops, files.paths, reads.scatters
        signers = signers_of(shards, stores, self._presigned)
        keys = [shard.source.key if shard.source is not None else "" for shard in shards]
        connections = self._connections = Connections(self.workers)
        attempts, timeout = self._attempts, self._timeout
        copy = named_copy(self._copier.copy, sink, paths)
        staging = None
        if self._staged:
            pin = self._pin
            staging = self._staging = StagingBuffers(
                self.staging_budget, self.workers, lambda size: staging_buffer(size, pin)
            )

        held = self._held = [None] * self.workers
        releases = [functools.partial(held.__setitem__, w, None) for w in range(self.workers)]

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            shard, signer = shards[op.file], signers[op.file]
            if signer is not None and signer.signs(keys[op.file]):
                presigned_read(worker, op, index, shard, signer)
                return op.nbytes
            data = fetch(
                stores[op.file],
                shards[op.file],
                op.offset,
                op.nbytes,
                attempts,
                timeout,
                headers_arrived=releases[worker],  # frees this thread's last response
            )
            response = response_tensor(data, op.nbytes)  # ``data`` lives until the copy returned
            if staging is None:
                copy(op, response, worker)  # each byte written once, into its slot
            else:
                with staging.use(worker) as buffer:
                    if op.nbytes > buffer.numel():  # the copy writes through a raw pointer
                        raise ValueError(
                            f"a read of {op.nbytes} bytes into a {buffer.numel()}-byte buffer"
                        )
                    host_copy(buffer.data_ptr(), response.data_ptr(), op.nbytes)
                    copy(op, buffer, worker)  # returns once the buffer may be reused
            held[worker] = data
            del data, response
            return op.nbytes

        def presigned_read(
            worker: int, op: ReadOp, index: int, shard: ShardFile, signer: Signer
        ) -> None:
            fetch_body = functools.partial(
                fetch_into, connections, worker, signer, stores[op.file], shard, op.offset
            )
            if staging is None:
                assert scatters is not None
                iov = scatters[index].iov
                fetch_body(tuple(zip(iov[0::2], iov[1::2], strict=True)), attempts, timeout)
                return
            with staging.use(worker) as buffer:
                if op.nbytes > buffer.numel():  # the body is read through a raw pointer
                    raise ValueError(
                        f"a read of {op.nbytes} bytes into a {buffer.numel()}-byte buffer"
                    )
                fetch_body(((buffer.data_ptr(), op.nbytes),), attempts, timeout)
                copy(op, buffer, worker)

        return read_one

    def staging(self) -> StagingStatistics | None:
        return None if self._staging is None else self._staging.statistics()

    def close(self) -> None:
        # After the threads drained (or, a read stuck, once it returned): none sets its slot.
        self._held[:] = [None] * len(self._held)
        if self._connections is not None:
            self._connections.close()
        if self._staging is not None:
            self._staging.close()


def request_limits(options: LoadOptions) -> tuple[int, float | None]:
    """The attempts each GET of a load gets, and the seconds each attempt may take: all
    attempts and the waits between them within ``read_timeout`` (the backoff takes at most
    half of it)."""
    attempts = options.request_retries + 1
    timeout = options.read_timeout
    waits = min(sum(_backoff(k) for k in range(1, attempts)), (timeout or 0) / 2)
    return attempts, None if timeout is None else (timeout - waits) / attempts


def response_tensor(data: Any, nbytes: int) -> torch.Tensor:
    """A uint8 view of the client's buffer ``data`` (a response of :func:`fetch`), no copy;
    valid while ``data`` lives."""
    address = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    return torch.frombuffer(byte_view(address, nbytes), dtype=torch.uint8)


def _backoff(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt`` (1: the first retry)."""
    return min(_BACKOFF_S * 2.0 ** (attempt - 1), _BACKOFF_MAX_S)


def store_of(shard: ShardFile, timeout: float | None) -> Any:
    """The client of ``shard``'s bucket for a load's GETs (``timeout``: each attempt's
    limit, from :func:`request_limits`)."""
    if shard.source is None:
        raise LoadError("not an object", file=shard.path)
    return client(shard.source.store, timeout, retry=False)  # fetch() retries, in time


def signers_of(
    shards: Sequence[ShardFile], stores: Sequence[Any], presigned_gets: bool
) -> list[Signer | None]:
    """Each shard's :class:`Signer`, or None where its GETs go through obstore (all of them
    unless ``presigned_gets``, the load's option); one per store (``stores``: each shard's,
    from :func:`store_of`), so that a store is asked to sign once per load."""
    if not presigned_gets:
        return [None] * len(shards)
    by_store: dict[int, Signer | None] = {}
    for shard, store in zip(shards, stores, strict=True):
        if id(store) not in by_store:
            by_store[id(store)] = signer_of(shard, store)
    return [by_store[id(store)] for store in stores]


def fetch(
    store: Any,
    shard: ShardFile,
    offset: int,
    nbytes: int,
    attempts: int,
    timeout: float | None = None,
    headers_arrived: Callable[[], None] | None = None,
) -> Any:
    """Bytes ``[offset, offset + nbytes)`` of the object ``shard``, in one ranged GET pinned
    to its ETag, retried ``attempts - 1`` times after a transient failure (``timeout``: the
    seconds each attempt may take, as ``store`` enforces them; for the message;
    ``headers_arrived``: called once an attempt's response headers came, before its body is
    collected). Returns the client's buffer (it supports the buffer protocol)."""
    import obstore

    location = shard.source
    assert location is not None
    options = pinned(location, offset, offset + nbytes)

    def attempt() -> Any:
        result = obstore.get(store, location.key, options=options)
        _check_etag(shard, etag_of(result.meta))
        if headers_arrived is not None:
            headers_arrived()
        data = result.bytes()
        if len(data) != nbytes:
            raise ValueError(f"the response held {len(data)} of {nbytes} bytes")
        return data

    return _retried(attempt, store, shard, offset, nbytes, attempts, timeout)


def fetch_into(
    connections: Connections,
    worker: int,
    signer: Signer,
    store: Any,
    shard: ShardFile,
    offset: int,
    regions: Sequence[tuple[int, int]],
    attempts: int,
    timeout: float | None = None,
) -> None:
    """:func:`fetch`'s twin for a presigned GET (``_presigned``): the body read into
    ``regions`` (``(address, nbytes)`` pairs, in order), each attempt on ``worker``'s
    connection; the same retries and errors (``store``: to look up a changed object's
    ETag)."""
    nbytes = sum(size for _, size in regions)

    def attempt() -> None:
        _check_etag(shard, get_into(connections, worker, signer, shard, offset, regions, timeout))

    _retried(attempt, store, shard, offset, nbytes, attempts, timeout)


def _check_etag(shard: ShardFile, got: str | None) -> None:
    expected = shard.source.etag if shard.source is not None else None
    if expected is not None and got is not None and got != expected:
        raise _changed(shard, got)


def _retried(
    attempt: Callable[[], _T],
    store: Any,
    shard: ShardFile,
    offset: int,
    nbytes: int,
    attempts: int,
    timeout: float | None,
) -> _T:
    """``attempt()``'s result, retried ``attempts - 1`` times after a transient failure
    (backoff doubling from 50 ms); a changed, missing or refused object ends at once."""
    location = shard.source
    assert location is not None
    span = f"bytes {offset}-{offset + nbytes - 1}"
    last: Exception | None = None
    kind = "transient"
    for number in range(attempts):
        if number:
            time.sleep(_backoff(number))
        try:
            return attempt()
        except FileChangedError:
            raise
        except Exception as err:
            kind = failure_kind(err)
            if kind == "changed" or kind == "missing":
                raise _changed(shard, _current_etag(store, location.key)) from None
            if kind == "denied":
                raise ReadError(
                    f"GET of {span} refused: access denied ({redacted(str(err), location.store)})",
                    file=shard.path,
                    offset=offset,
                ) from None
            last = err
    why = redacted(str(last), location.store)
    if kind == "timeout":
        each = "" if timeout is None else f" of at most {timeout:.3g} s each, within read_timeout"
        raise ReadTimeoutError(
            f"GET of {span} timed out ({attempts} attempts{each}): the server stopped "
            f"answering ({why})",
            file=shard.path,
            offset=offset,
            nbytes=nbytes,
        )
    raise ReadError(
        f"GET of {span} failed after {attempts} attempts: {why}",
        file=shard.path,
        offset=offset,
        nbytes=nbytes,
    )


def _current_etag(store: Any, key: str) -> str | None:
    import obstore

    try:
        return etag_of(obstore.head(store, key))
    except Exception:  # gone, or unreachable: the error says "absent"
        return None


def _changed(shard: ShardFile, got: str | None) -> FileChangedError:
    location = shard.source
    assert location is not None
    now = "is gone" if got is None else f"now has ETag {got}"
    return FileChangedError(
        f"object changed since the checkpoint was opened (bucket {location.store.bucket!r}, "
        f"key {location.key!r}: ETag {location.etag} expected, it {now}); open and plan it "
        "again",
        file=shard.path,
        bucket=location.store.bucket,
        key=location.key,
        expected=location.etag,
        got=got,
    )

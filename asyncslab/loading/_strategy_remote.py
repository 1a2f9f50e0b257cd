"""The object-store transfer: the schedule's reads as ranged GETs (shards opened from
``s3://``, ``gs://`` or ``az://``), made by ``asyncslab._objects``.

The same coalesced reads as a local load, cut at ``LoadOptions.request_size``, each fetched
by one GET pinned to the ETag recorded when the checkpoint was opened (``If-Match``, and the
ETag of every response checked too). ``request_concurrency`` I/O threads each take the next
read themselves (``_read.ReadFeed``), fetch it, and write its bytes once. A GET is made one
of two ways:

- presigned (``s3://`` and ``az://`` where the store can sign, the default): the standard
  library's HTTP client reads the body straight into the read's slots, as a local direct
  read scatters (gaps to a scratch buffer), or for a staged load into the thread's own
  staging buffer, then to the device (``_copy``). No client buffer;
- through obstore (``gs://``, a store that cannot sign, a proxy, ``presigned_gets=False``):
  the client collects the body into a buffer of its own, copied into the slots by
  ``memmove`` on the thread (``_copy.HostCopier``) or into the staging buffer.

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
with jittered backoff); the attempts and the waits between them share ``read_timeout``
(``_objects.Retries``), so a server that stops answering fails the load within
``read_timeout`` and no GET outlives the load's drain.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .._objects import ObjectLocation, ObjectReads, Retries
from .._objects import presigns as presigned_location
from ..checkpoint import ShardFile
from ..errors import LoadError
from ..planning import Plan
from ._copy import Copier, direct_scatters, host_copy
from ._options import LoadOptions
from ._pinned import StagingBuffers, StagingStatistics, staging_budget
from ._read import byte_view
from ._schedule import ReadOp, schedule
from ._sink import Files, ReadOne, Reads, Sink, named_copy
from ._strategy_staged import staging_buffer

__all__ = ["Remote", "presigns", "reads_objects", "response_tensor"]


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
        self._retries = Retries.within(options.request_retries, options.read_timeout)
        self._copier = copier
        self._presigned = options.presigned_gets
        self._staging: StagingBuffers | None = None
        self._gets: ObjectReads | None = None
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
        locations = [_location(shard) for shard in sink.plan.files]
        gets = self._gets = ObjectReads(locations, self._retries, self.workers, self._presigned)
        ops, scatters = reads.schedule.ops, reads.scatters
        copy = named_copy(self._copier.copy, sink, files.paths)
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
            if gets.signs(op.file):
                presigned_read(worker, op, index)
                return op.nbytes
            # Frees this thread's last response once the next one's headers arrived.
            data = gets.fetch(op.file, op.offset, op.nbytes, headers_arrived=releases[worker])
            response = response_tensor(data, op.nbytes)  # ``data`` lives until the copy returned
            if staging is None:
                copy(op, response, worker)  # each byte written once, into its slot
            else:
                with staging.use(worker) as buffer:
                    _fits(op, buffer)  # the copy writes through a raw pointer
                    host_copy(buffer.data_ptr(), response.data_ptr(), op.nbytes)
                    copy(op, buffer, worker)  # returns once the buffer may be reused
            held[worker] = data
            del data, response
            return op.nbytes

        def presigned_read(worker: int, op: ReadOp, index: int) -> None:
            if staging is None:
                assert scatters is not None
                iov = scatters[index].iov
                regions = tuple(zip(iov[0::2], iov[1::2], strict=True))
                gets.fetch_into(worker, op.file, op.offset, regions)
                return
            with staging.use(worker) as buffer:
                _fits(op, buffer)  # the body is read through a raw pointer
                gets.fetch_into(worker, op.file, op.offset, ((buffer.data_ptr(), op.nbytes),))
                copy(op, buffer, worker)

        return read_one

    def staging(self) -> StagingStatistics | None:
        return None if self._staging is None else self._staging.statistics()

    def close(self) -> None:
        # After the threads drained (or, a read stuck, once it returned): none sets its slot.
        self._held[:] = [None] * len(self._held)
        if self._gets is not None:
            self._gets.close()
        if self._staging is not None:
            self._staging.close()


def response_tensor(data: Any, nbytes: int) -> torch.Tensor:
    """A uint8 view of the client's buffer ``data`` (a response of ``ObjectReads.fetch``), no
    copy; valid while ``data`` lives."""
    address = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    return torch.frombuffer(byte_view(address, nbytes), dtype=torch.uint8)


def presigns(shard: ShardFile) -> bool:
    """Whether a load's GETs of ``shard`` are presigned, read straight into their slots
    (with ``LoadOptions.presigned_gets``, and where its store turns out able to sign)."""
    return shard.source is not None and presigned_location(shard.source)


def _location(shard: ShardFile) -> ObjectLocation:
    if shard.source is None:
        raise LoadError("not an object", file=shard.path)
    return shard.source


def _fits(op: ReadOp, buffer: torch.Tensor) -> None:
    if op.nbytes > buffer.numel():
        raise ValueError(f"a read of {op.nbytes} bytes into a {buffer.numel()}-byte buffer")

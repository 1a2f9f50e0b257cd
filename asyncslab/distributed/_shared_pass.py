"""The shared pass of a distributed load (``share_reads=True``), on one rank.

Every rank walks the group's chunk list in the same order: the owner of a chunk reads it
(its :class:`~asyncslab.distributed._chunks.ChunkReader`, at most two ahead), broadcasts it
when other ranks need it, with a status byte that stops the whole group at this chunk when
the owner failed; each rank that needs the chunk copies its overlaps with its routes into
its slabs and lands them, on the event loop, in order. A set-up exchange before the first
chunk says whether every rank allocated its buffers and started its reader.

The pass reports into its rank's side of the load (:class:`RankSide`): this rank's error,
the rank that stopped the group, and the figures the agreement gathers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._failures import first_line
from ..errors import AsyncSlabError, IncompleteLoadError, LoadError
from ..loading import Load, LoadOptions, SlabSet, pinned_bytes
from ..planning import Plan
from ._chunks import Chunk, ChunkReader, RouteIndex, SegmentSource, share_chunks, unpack_ranges
from ._protocol import Abandoned, broadcast, describe

__all__ = ["RankSide", "SharedPass"]

#: Staging buffers per rank: one chunk broadcast while the next is read.
BUFFERS = 2


class RankSide(Protocol):
    """What the pass needs of its rank's side of the load (a distributed session)."""

    rank: int
    group: Any
    comm_cuda: bool
    comm_device: torch.device
    plan: Plan
    options: LoadOptions
    chunk_bytes: int
    loop: asyncio.AbstractEventLoop
    load: Load | None
    source: SegmentSource | None
    abandoned: bool
    abort_reason: str | None
    local_error: BaseException | None
    stopped_by: int | None
    bytes_read: int
    reads: int
    bytes_sent: int
    bytes_received: int

    @property
    def slabs(self) -> SlabSet: ...

    def gather(self, obj: dict[str, Any], step: str) -> list[dict[str, Any]]: ...

    def in_loop(self, fn: Callable[[], Any]) -> Any: ...

    def loop_gone(self) -> None: ...

    def failing(self) -> bool: ...


class SharedPass:
    """One rank's shared pass; runs on the protocol thread, lands on the loop."""

    def __init__(self, side: RankSide) -> None:
        self._side = side
        # Set up by _set_up: the group's chunks, the staging buffers the owner reads into
        # and those the broadcasts go through, this rank's routes by file, its reader.
        self._chunks: list[Chunk] = []
        self._host: list[torch.Tensor] = []
        self._comm: list[torch.Tensor] = []
        self._routes: RouteIndex | None = None
        self._reader: ChunkReader | None = None

    def run(self, hellos: Sequence[dict[str, Any]]) -> dict[int, str]:
        """The pass. Returns the ranks whose set-up failed, with their errors (the same on
        every rank; no chunk was exchanged then), else ``{}``."""
        side = self._side
        try:
            setup_error: Exception | None = None
            try:
                self._set_up(hellos)
            except Exception as err:
                setup_error = side.local_error = err
            failed = self._agree_set_up(setup_error)
            if failed:
                return failed
            self._exchange()
            return {}
        finally:
            self._finish()

    def _set_up(self, hellos: Sequence[dict[str, Any]]) -> None:
        """The chunk list (the same on every rank), the staging buffers, the route index,
        and the reader, started."""
        side = self._side
        # A chunk's broadcast is its payload and a status byte, chunk_bytes in all: a power
        # of two fills the pinned block torch makes of it (a payload of 16 MiB and its byte
        # took 32 MiB pinned, see pinned_bytes).
        self._chunks = chunks = share_chunks(
            [unpack_ranges(h["ranges"]) for h in hellos],
            chunk_bytes=max(1, side.chunk_bytes - 1),
            gap=side.options.coalesce_gap,
        )
        relevant = [c for c in chunks if c.shared or c.owner == side.rank]
        size = max((c.nbytes for c in relevant), default=0) + 1  # + the status byte
        self._host, self._comm = self._buffers(size)
        assert side.load is not None
        self._routes = RouteIndex(side.plan, side.load.sink)
        assert side.source is not None  # opened with the load, before the pre-flight
        self._reader = ChunkReader(
            chunks,
            side.rank,
            self._host,
            BUFFERS,
            side.source,
            failing=side.failing,
            aborted=lambda: side.abort_reason is not None,
        )
        self._reader.start()

    def _agree_set_up(self, error: Exception | None) -> dict[int, str]:
        """The set-up exchange: the ranks whose set-up failed, with their errors. A rank
        whose set-up failed cannot take part in the chunks (it may lack the buffers to
        receive them, and it may own none to stop the group at), and its peers would wait
        for it in the first one until the group's timeout: every rank learns of it here,
        before any chunk."""
        side = self._side
        described = None if error is None else describe(error)
        setups = side.gather({"rank": side.rank, "error": described}, "set-up")
        failed: dict[int, str] = {s["rank"]: s["error"] for s in setups if s["error"]}
        if failed and side.rank not in failed:
            side.stopped_by = min(failed)
        return failed

    def _exchange(self) -> None:
        """Every chunk in the group's order: the ones this rank reads or receives, until
        the end or a chunk the whole group stops at."""
        side, rank, nbuf = self._side, self._side.rank, BUFFERS
        routes, reader = self._routes, self._reader
        # The set-up succeeded.
        assert routes is not None
        assert reader is not None
        # Zero-byte routes lie in no chunk: they land now, as the loader lands them without
        # a read (else their units never complete). Queued before any chunk's landing.
        try:
            side.loop.call_soon_threadsafe(self._begin_landing, routes.empty)
        except RuntimeError:  # the loop is closed
            side.loop_gone()
        for k, chunk in enumerate(self._chunks):
            if chunk.shared or chunk.owner == rank:
                read = reader.take(k) if chunk.owner == rank else None
                host, comm = self._host[k % nbuf], self._comm[k % nbuf]
                if self._chunk(k, chunk, read, host, comm, routes):
                    break
            reader.advance(k)

    def _finish(self) -> None:
        """The reader stopped, its figures kept, and the load ended on the loop."""
        side, reader = self._side, self._reader
        if reader is not None:
            # Aborted with a read still in flight (it may never return), the reader keeps
            # its source and buffers and this goes on to the agreement.
            if reader.finish():
                side.source = None
            side.bytes_read, side.reads = reader.bytes_read, reader.reads
        try:
            side.in_loop(self._settle)
        except Abandoned:
            side.loop_gone()

    def _buffers(self, size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The :data:`BUFFERS` staging buffers of ``size`` bytes the owner reads into (pinned
        where a GPU takes part), and those the broadcasts go through: the same, or device
        buffers under NCCL. What they hold is recorded as the load's staging."""
        side, nbuf = self._side, BUFFERS
        pin = torch.cuda.is_available() and (side.comm_cuda or side.slabs.device.type == "cuda")
        try:
            host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(nbuf)]
        except (RuntimeError, MemoryError) as err:
            raise LoadError(
                f"cannot allocate the staging buffers of the shared reads ({nbuf} x "
                f"{size} bytes{', pinned' if pin else ''}): {first_line(err)}",
                rank=side.rank,
            ) from err
        comm = host
        if side.comm_cuda:
            comm = [
                torch.empty(size, dtype=torch.uint8, device=side.comm_device) for _ in range(nbuf)
            ]
        # What is held: torch pins a power of two (chunk_bytes, unless one chunk is
        # smaller); the device buffers are as asked.
        held = pinned_bytes(size) if pin else size
        assert side.load is not None
        side.load.record_staging(nbuf * (held + (size if side.comm_cuda else 0)))
        return host, comm

    def _chunk(
        self,
        k: int,
        chunk: Chunk,
        read: BaseException | None,
        host: torch.Tensor,
        comm: torch.Tensor,
        routes: RouteIndex,
    ) -> bool:
        """Process chunk ``k`` (``read``: the error of this rank's read of it, if it owns
        it); ``True`` when the whole group stops here."""
        side = self._side
        n = chunk.nbytes
        if chunk.owner == side.rank:
            if read is not None and side.local_error is None:
                side.local_error = read
            if not chunk.shared:
                if not side.failing():
                    self._deliver(chunk, host, routes)
                return False
            status = 1 if side.local_error is not None else 2 if side.failing() else 0
            host[n] = status
            if side.comm_cuda:
                comm[: n + 1].copy_(host[: n + 1])
            broadcast(comm[: n + 1], chunk.owner, side.group, f"chunk {k} broadcast")
            if status:
                return True
            side.bytes_sent += n
            self._deliver(chunk, comm, routes)
            return False
        broadcast(comm[: n + 1], chunk.owner, side.group, f"chunk {k} broadcast")
        if int(comm[n].item()):
            side.stopped_by = chunk.owner
            return True
        side.bytes_received += n
        if not side.failing() and side.rank in chunk.needers:
            self._deliver(chunk, comm, routes)
        return False

    def _deliver(self, chunk: Chunk, buffer: torch.Tensor, routes: RouteIndex) -> None:
        """:meth:`_copy_out`, its failure this rank's error: raised out of the protocol, it
        would skip this rank's remaining collectives and leave the others waiting in them."""
        try:
            self._copy_out(chunk, buffer, routes)
        except Exception as err:
            if self._side.local_error is None:
                self._side.local_error = err

    def _copy_out(self, chunk: Chunk, buffer: torch.Tensor, routes: RouteIndex) -> None:
        """Copy every overlap of the chunk with this rank's routes into its slot, then land
        those bytes (on the loop, in order)."""
        landed: list[tuple[int, int]] = []
        backing = routes.backing
        for seg in chunk.segments:
            for route, src, base, dst, nbytes in routes.overlaps(seg):
                start = seg.at + (src - seg.offset)
                backing.narrow(0, base + dst, nbytes).copy_(buffer.narrow(0, start, nbytes))
                landed.append((route, nbytes))
        if not landed:
            return
        if routes.cuda:
            torch.cuda.current_stream(routes.cuda_device).synchronize()
        if self._side.abandoned:
            return
        try:
            self._side.loop.call_soon_threadsafe(self._land, landed)
        except RuntimeError:  # the loop is closed
            self._side.loop_gone()

    # -- on the loop --

    def _begin_landing(self, empty: Sequence[int]) -> None:
        side = self._side
        if side.abandoned or side.local_error is not None:
            return
        try:
            assert side.load is not None
            side.load.begin(None)  # completes units without routes, as the loader
            for route in empty:
                side.load.land(route, 0)
        except AsyncSlabError as err:
            side.local_error = err

    def _land(self, landed: list[tuple[int, int]]) -> None:
        side = self._side
        if side.abandoned or side.local_error is not None:
            return
        try:
            assert side.load is not None
            land = side.load.land
            for route, nbytes in landed:
                land(route, nbytes)
        except AsyncSlabError as err:
            side.local_error = err

    def _settle(self) -> None:
        side = self._side
        load = side.load
        if load is None:
            return
        load.bytes_read = side.bytes_read
        load.reads = side.reads
        if load.state != "loading":
            return
        if side.local_error is None and side.abort_reason is None and side.stopped_by is None:
            if not load.complete:
                side.local_error = IncompleteLoadError(
                    f"shared load finished with incomplete units {load.missing_units()}"
                )
        if side.abort_reason is not None:
            load.finish("cancelled", asyncio.CancelledError(side.abort_reason))
        elif side.local_error is not None:
            load.finish("failed", side.local_error)
        elif side.stopped_by is not None:
            load.finish(
                "failed",
                LoadError(f"stopped: rank {side.stopped_by} failed (see the load's error)"),
            )
        else:
            load.finish("complete")

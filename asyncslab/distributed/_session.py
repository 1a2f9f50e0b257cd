"""Loading one checkpoint on every rank of a ``torch.distributed`` process group.

Public as :mod:`asyncslab.distributed`. Nothing here coordinates on its own: the process
group (started by ``torchrun`` or ``torch.multiprocessing``; NCCL on GPUs, gloo on CPU) is the
only channel between ranks, and every exchange is an ordinary collective.

* :func:`~._rank_plan.rank_plan` (in ``_rank_plan``) builds this rank's plan from the
  group's rank and size.
* :func:`load` loads each rank's plan, then agrees across ranks: either every rank has its
  slabs complete, or every rank raises :class:`DistributedLoadError` naming the rank that
  failed and its error — a failure on one rank never leaves the others waiting.
* ``share_reads=True`` reads every needed byte range from storage exactly once in the whole
  group: a range one rank needs is read by that rank; a range several ranks need is read by
  one of them and broadcast over the group, chunk by chunk through (at most) two staging
  buffers per rank.

Collectives block, so they run on one thread per load (``asyncslab-dist``), never on the
event loop, in the same order on every rank. A rank that dies makes the others' next
collective fail at once (gloo: "Connection closed by peer"); a rank that hangs makes them
fail after the process group's timeout (``init_process_group(timeout=...)``). Either way
:func:`load` raises :class:`DistributedLoadError`, and the process group must not be used
again (destroy it, or exit).

A shared load is a :class:`~asyncslab.loading._load.Load` begun through the slabs' loads
(:meth:`~asyncslab.loading._loads.Loads.begin_shared`): the chunks' bytes land through its
sink, and it finishes like a local load, so the slabs fill, gate and report alike. The chunk
list, this rank's chunk reader and the landing index live in ``_chunks``; where the reader's
bytes come from (the shards' files, or objects by ranged GETs pinned to their ETags), in
``_sources``; the pass that moves the chunks, in ``_shared_pass``; the collectives and the
protocol thread's calls onto the loop, in ``_protocol``; the plans, in ``_rank_plan``; what the
ranks check in the pre-flight and the outcome they agree to, in ``_agreement``. Here: the
rank's session, which runs the protocol and owns the load. A checkpoint in object storage needs
nothing else here: without ``share_reads`` each rank's ordinary load fetches its plan's
ranges.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._os import peak_rss
from ..checkpoint import Checkpoint
from ..errors import DistributedLoadError, LoadError
from ..loading import Load, LoadOptions, SlabSet
from ..planning import Plan
from ._agreement import (
    DistributedLoad,
    check_chunk_bytes,
    check_hellos,
    checkpoint_identity,
    completed,
    lost,
    ranks_failed,
)
from ._chunks import SegmentSource, needed_ranges, pack_ranges
from ._protocol import (
    ABORTED,
    CANCELLED,
    FAILED,
    OK,
    Abandoned,
    CollectiveFailed,
    call_in_loop,
    describe,
    gather,
)
from ._shared_pass import SharedPass
from ._sources import open_source, versions

__all__ = ["load"]


class _Session:
    """One rank's side of one distributed load. The protocol (two ``all_gather_object``
    exchanges, and in between, when sharing, a third one and the chunk broadcasts) runs on
    one thread in the same order on every rank; the event loop only prepares, lands and
    finishes."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        plan: Plan,
        into: SlabSet | None,
        *,
        device: str | torch.device,
        group: Any,
        share_reads: bool,
        options: LoadOptions,
        chunk_bytes: int,
    ) -> None:
        self.checkpoint = checkpoint
        self.plan = plan
        # Allocated in prepare() unless given: its failure must travel in the pre-flight.
        self._slabs = into
        self.owned = into is None  # freed, not reset, if the load fails
        self.device = device
        self.group = group
        self.share = share_reads
        self.options = options
        self.chunk_bytes = chunk_bytes
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        # gloo carries CPU tensors (also when slabs live on a GPU); NCCL only CUDA ones.
        self.comm_cuda = "nccl" in backend and "gloo" not in backend
        self.comm_device = torch.device("cpu")
        if self.comm_cuda:  # the slabs' device instead, once they exist (prepare)
            self.comm_device = torch.device("cuda", torch.cuda.current_device())
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.abort_reason: str | None = None  # cancelled or timed out (set by the loop side)
        self.abandoned = False
        self.local_error: BaseException | None = None
        self.local_task: asyncio.Task[Any] | None = None
        # The shared load this rank's slabs run (share_reads), once begun.
        self.load: Load | None = None
        self.stopped_by: int | None = None
        # Where this rank's shared reads come from (share_reads): its files or objects.
        self.source: SegmentSource | None = None
        self.started = time.perf_counter()
        self.bytes_read = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.reads = 0

    def where(self) -> str:
        return f"rank {self.rank} of {self.world}"

    @property
    def slabs(self) -> SlabSet:
        """This rank's slabs; only past a pre-flight every rank passed (a rank whose
        allocation failed says so in the pre-flight, and every rank stops there)."""
        if self._slabs is None:
            raise LoadError(f"{self.where()}: the slabs were never allocated")
        return self._slabs

    # -- loop side --

    def prepare(self) -> dict[str, Any]:
        """Local checks and set-up, on the loop; their failure travels in the hello."""
        files, headers = checkpoint_identity(self.checkpoint)
        hello: dict[str, Any] = {
            "rank": self.rank,
            "files": files,
            "headers": headers,
            "fingerprint": self.plan.fingerprint,
            "slices": self.plan.fingerprint,
            "tag": dict(self.plan.extras.get("distributed", {})) or None,
            # What decides the sequence of collectives: it must be the same on every rank.
            "sharing": (self.share, self.chunk_bytes, self.options.coalesce_gap)
            if self.share
            else (False,),
            "ranges": None,
            "versions": versions(self.checkpoint),
            "error": None,
        }
        try:
            # Checked here, not before the pre-flight: a rank refusing on its own would leave
            # the others waiting in it until the group's timeout; the slabs are allocated
            # here for the same reason.
            check_chunk_bytes(self.chunk_bytes)
            if self._slabs is None:
                self._slabs = SlabSet(self.plan, self.device)
            if self.comm_cuda and self.slabs.device.type == "cuda":
                self.comm_device = self.slabs.device
            if self.share:
                hello["ranges"] = pack_ranges(needed_ranges(self.plan))
                # Bytes arrive in the group's chunks ("shared"), landed here.
                self.load = self.slabs.loads.begin_shared(self.checkpoint, self.plan, self.options)
                self.source = open_source(self.plan, self.options)
        except Exception as err:
            self.local_error = err
            hello["error"] = describe(err)
        return hello

    def abort(self, reason: str) -> None:
        with self.lock:
            if self.abort_reason is None:
                self.abort_reason = reason
            task = self.local_task
        if task is not None:
            task.cancel()

    def loop_gone(self) -> None:
        """The event loop can no longer be reached (the awaiting coroutine gave up at its
        deadline, or the loop closed): nothing more lands on this rank. Called on the
        protocol thread, which still finishes the protocol, reporting this rank as
        aborted, because the other ranks wait for it in the remaining collectives."""
        with self.lock:
            if self.abort_reason is None:
                # Only reached when the loop closed under a load nobody cancelled.
                self.abort_reason = "abandoned (its event loop closed)"

    def failing(self) -> bool:
        return self.local_error is not None or self.abort_reason is not None

    def _close_source(self) -> None:
        source, self.source = self.source, None
        if source is not None:
            source.close()

    async def local_settled(self) -> None:
        """This rank's own load (without ``share_reads``) cancelled, and ended."""
        task = self.local_task
        if task is not None and not task.done():
            task.cancel()
            # Its outcome is reported elsewhere; wait() does not raise it (but lets our own
            # cancellation through).
            await asyncio.wait([task])

    async def release(self) -> None:
        """After a failed distributed load: no slab of this rank stays usable."""
        await self.local_settled()
        slabs = self._slabs
        if self.load is not None and self.load.state == "loading":
            self.load.finish("failed", LoadError("distributed load failed"))
        if not self.abandoned:
            # Only left open when the protocol thread never ran; an abandoned one closes its
            # own.
            self._close_source()
        if slabs is None:
            pass  # its allocation failed: nothing to free
        elif self.owned:
            await slabs.aclose()
        elif slabs.loads.closed:
            pass  # closed by its owner meanwhile: nothing is handed out
        elif slabs.state == "complete":
            slabs.reset()
        elif slabs.state in ("failed", "cancelled"):
            # Failed or cancelled: the tracker keeps the units that completed before the
            # break, and slab() would hand them out on this rank alone. Keep the error
            # (ready() raises with it) but no completed unit.
            slabs.loads.void()
        if not self.abandoned:
            # The protocol's threads are done with the slabs; their frames, in the error's
            # traceback, may keep the session: it lets go of the slabs (and of the load,
            # whose sink holds their memory).
            self._slabs = None
            self.load = None

    # -- protocol thread --

    def protocol(self, hello: dict[str, Any]) -> tuple[str, Any]:
        """Returns ``("ok", reports)`` or ``("error", DistributedLoadError)``; the same
        verdict on every rank whose collectives succeeded."""
        try:
            if self.comm_cuda:
                # The CUDA device is per thread; NCCL's object collectives use the current one.
                torch.cuda.set_device(self.comm_device)
            hellos = self.gather(hello, "pre-flight")
            problems = check_hellos(hellos, self.world)
            if problems:
                return "error", self._failed(problems, "ranks disagree before loading")
            if any(h["error"] for h in hellos):
                failed = {h["rank"]: h["error"] for h in hellos if h["error"]}
                return "error", self._failed(failed, "before loading")
            if self.share:
                failed = SharedPass(self).run(hellos)
                if failed:
                    return "error", self._failed(failed, "before the first shared chunk")
            else:
                self._independent()
            reports = self.gather(self._final(), "agreement")
            failed = {
                r["rank"]: r["error"] or r["status"]
                for r in reports
                if r["status"] in (FAILED, CANCELLED)
            }
            if not failed:
                aborted = [r["rank"] for r in reports if r["status"] != OK]
                if aborted:  # cannot happen: an abort always follows someone's failure
                    failed = {r: "stopped without a failing rank" for r in aborted}
            if failed:
                return "error", self._failed(failed, None)
            return "ok", reports
        except CollectiveFailed as err:
            return "error", lost(err, rank=self.rank, world=self.world)
        finally:
            self._close_source()

    def _failed(self, failed: Mapping[int, str], context: str | None) -> DistributedLoadError:
        return ranks_failed(
            failed, context, rank=self.rank, world=self.world, cause=self.local_error
        )

    def gather(self, obj: dict[str, Any], step: str) -> list[dict[str, Any]]:
        return gather(self.group, self.world, obj, step)

    def in_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the event loop (after everything queued before it) and return its
        result."""
        return call_in_loop(self.loop, fn, lambda: self.abandoned)

    def _independent(self) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def start() -> None:
            async def run() -> None:
                await self.slabs.load(self.checkpoint, plan=self.plan, options=self.options)

            def finished(task: asyncio.Task[None]) -> None:
                if task.cancelled():
                    done.cancel()
                elif (exc := task.exception()) is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(None)

            with self.lock:
                if self.abort_reason is not None:
                    done.cancel()
                    return
                task = self.loop.create_task(run(), name="asyncslab-dist-local")
                self.local_task = task
            task.add_done_callback(finished)

        try:
            self.in_loop(start)
        except Abandoned:
            # The agreement still follows: the others wait in it for this rank's verdict.
            self.loop_gone()
            return
        try:
            done.result()
        except concurrent.futures.CancelledError:
            pass  # abort_reason says why
        except BaseException as err:
            self.local_error = err
        stats = self.slabs.statistics() if not self.abandoned else None
        if stats is not None:
            self.bytes_read, self.reads = stats.bytes_read, stats.reads

    def _final(self) -> dict[str, Any]:
        if self.abort_reason is not None:
            status, error = CANCELLED, f"load {self.abort_reason}"
        elif self.local_error is not None:
            status, error = FAILED, describe(self.local_error)
        elif self.stopped_by is not None:
            status, error = ABORTED, None
        else:
            status, error = OK, None
        return {
            "rank": self.rank,
            "status": status,
            "error": error,
            "fingerprint": self.plan.fingerprint,
            "slices": self.plan.fingerprint,
            "bytes_needed": sum(r.nbytes for r in self.plan.routes),
            "bytes_read": self.bytes_read,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "reads": self.reads,
            "elapsed_s": time.perf_counter() - self.started,
            "peak_rss": peak_rss() or 0,
        }


async def load(
    checkpoint: Checkpoint,
    plan: Plan,
    *,
    group: Any = None,
    share_reads: bool = False,
    device: str | torch.device = "cpu",
    options: LoadOptions | None = None,
    into: SlabSet | None = None,
    chunk_bytes: int = 16 << 20,
    # Not asyncio.timeout: cancelling makes this rank finish the protocol (waiting up to the
    # group's timeout) so that the others hear of it; this deadline abandons it instead.
    timeout: float | None = None,  # noqa: ASYNC109
) -> DistributedLoad:
    """Load this rank's ``plan`` and agree with every rank of ``group`` (default: the
    default process group) that all loads completed. Every rank must call it, with its own
    plan of the same checkpoint (e.g. from :func:`rank_plan`) and the same ``share_reads``
    and ``chunk_bytes``.

    Protocol, in the same order on every rank: a pre-flight ``all_gather_object`` (same
    checkpoint files and headers everywhere; plans from :func:`rank_plan` made for this
    rank, world and one mode; replicated plans identical; each rank's local preparation,
    its slabs' allocation included, succeeded), the load, then an agreement
    ``all_gather_object`` of every rank's outcome and figures. If any rank failed, every rank
    raises :class:`DistributedLoadError` naming it (and, where the slabs were allocated here,
    frees them; ``into`` slabs are reset).

    ``share_reads``: read each needed byte range from storage exactly once in the group;
    ranges several ranks need travel by ``dist.broadcast`` in chunks of at most
    ``chunk_bytes`` (payload and a status byte), through two staging buffers per rank (on
    the GPU too under NCCL). A set-up ``all_gather_object`` after the pre-flight says
    whether every rank allocated them (and set up the rest); if not, every rank fails
    there, before the first chunk.
    Without ``share_reads``, every rank reads its own plan with the ordinary loader and
    ``options``.

    ``timeout``: seconds after which this rank stops waiting and raises; the group is
    unusable afterwards. Its protocol thread goes on in the background: it stops landing
    and reading (with ``share_reads``, it leaves behind a read in flight), takes part in
    the remaining collectives and reports the timeout in the agreement, so the other ranks
    raise "failed on rank r: load timed out after ... s" once they get there — provided
    this process lives that long and no collective it waits in is stuck on a hung rank
    (that one ends at the process group's own timeout). ``None``: the process group's
    timeout bounds every wait — a dead rank fails the others at once, a hung one after
    that timeout.
    """
    _check_group(group)
    options = options or LoadOptions()
    if into is not None:
        await into.loads.settled()  # one of these slabs may still be releasing
    session = _Session(
        checkpoint,
        plan,
        into,
        device=device,
        group=group,
        share_reads=share_reads,
        options=options,
        chunk_bytes=chunk_bytes,
    )
    # This frame lies in a failed load's traceback: only the session, which lets go of
    # the slabs when the load fails (see _Session.release), may hold them.
    del into
    try:
        return await _agreed(session, timeout)
    finally:
        del session


def _check_group(group: Any) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise LoadError("torch.distributed is not initialized; call init_process_group first")
    if dist.get_rank(group) < 0:
        raise LoadError("this process is not a member of the given process group")


async def _agreed(
    session: _Session,
    timeout: float | None,  # noqa: ASYNC109 - see load()
) -> DistributedLoad:
    """The load every rank agreed on; else, this rank's slabs released, the error."""
    try:
        hello = session.prepare()
        kind, value = await _drive(session, hello, timeout)
    except BaseException:
        await session.release()
        del session  # this frame lies in the error's traceback (see _Session.release)
        raise
    if kind == "error":
        await session.release()
        del session
        raise value
    return completed(
        value,
        slabs=session.slabs,
        rank=session.rank,
        world=session.world,
        share_reads=session.share,
    )


async def _drive(
    session: _Session,
    hello: dict[str, Any],
    timeout: float | None,  # noqa: ASYNC109 - see load()
) -> tuple[str, Any]:
    """Run the protocol thread and wait for it; on cancellation, finish the protocol first
    (so the other ranks hear about it instead of waiting), then re-raise."""
    future: concurrent.futures.Future[tuple[str, Any]] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(session.protocol(hello))
        except BaseException as err:  # a bug; handed to the awaiting task
            future.set_exception(err)

    thread = threading.Thread(target=run, name="asyncslab-dist", daemon=True)
    thread.start()
    waiter = asyncio.wrap_future(future)
    try:
        if timeout is None:
            return await asyncio.shield(waiter)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(waiter)
    except TimeoutError:
        if waiter.done():  # finished as the deadline passed
            return waiter.result()
        session.abort(f"timed out after {timeout} s")
        await session.local_settled()
        session.abandoned = True
        # Nothing more will land: close out the slabs' state so waiters wake.
        if session.load is not None and session.load.state == "loading":
            session.load.finish("failed", LoadError("distributed load timed out"))
        raise DistributedLoadError(
            f"{session.where()}: distributed load did not finish within timeout={timeout} s "
            "(waiting for the other ranks or the shared reads); the process group is "
            "unusable now",
            ranks=(),
            errors={},
            rank=session.rank,
            world=session.world,
            step="timeout",
        ) from None
    except asyncio.CancelledError:
        session.abort("cancelled")
        while not waiter.done():
            try:
                await asyncio.shield(waiter)
            except asyncio.CancelledError:
                continue
        raise

"""One load, from the open shards to the landed slabs: the per-load object.

A :class:`Load` owns one load's resources (fds, I/O threads, the transfer's staging
buffers or mappings) and its counters, lands bytes through its :class:`~._sink.Sink`,
and releases everything before :meth:`Load.run` returns or raises, also when cancelled
(after waiting for reads already inside a thread). Every task it starts has one owner, a
task group in :meth:`Load.run`; the first failure cancels the rest. It runs start to end
on its own: begun by the SlabSet's :class:`~._loads.Loads`, whose task running it is the
one way it reports back (its end). The reads themselves are ``_read_pass``'s.

The :class:`~._slabs.SlabSet` that made it keeps only what outlives a load: its memory,
its tracker, and this object for its statistics. Nothing here holds the ``SlabSet``, so an
error whose traceback holds these frames never ties the slabs to the ``SlabSet``'s own
references: cycles through a failed load's frames are cut where they form (see
``test_a_dropped_slabset_whose_load_failed_frees_its_slabs_without_the_collector``).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._heap import gc_paused
from ..errors import (
    AsyncSlabError,
    FileChangedError,
    IncompleteLoadError,
    LoadError,
    ReadError,
)
from ..planning import Plan, route_column
from ._options import LoadOptions, LoadStatistics, ProgressCallback, State, UnitCallback
from ._read import IoPool
from ._read_pass import read_all, refuse_awaitable
from ._schedule import Schedule
from ._sink import Files, ReadOne, Reads, Sink, TransferStrategy
from ._tracker import Tracker

__all__ = [
    "Health",
    "Load",
    "check_files",
    "check_progress",
    "map_checked",
    "open_checked",
    "uncancellable",
]

T = TypeVar("T")


@dataclass(slots=True)
class Health:
    """What a load learns of its slabs that outlives it. ``broken``: why they cannot be
    reused (a read stuck past ``read_timeout`` may still write into them)."""

    broken: str | None = None


class Load:
    """One load into ``sink`` (``strategy`` None: the bytes are moved by someone else, a
    distributed load's chunk protocol, through :meth:`land`). ``state`` is ``"empty"`` for
    the idle object a SlabSet reports before its first load. ``clock`` times each read in
    flight against ``read_timeout`` (see ReadFeed)."""

    def __init__(
        self,
        plan: Plan,
        sink: Sink,
        options: LoadOptions,
        strategy: TransferStrategy | None,
        *,
        transfer: str,
        read_plans: dict[tuple[str, int, int], Reads],
        health: Health,
        state: State = "loading",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.plan = plan
        self.clock = clock
        self.sink = sink
        self.tracker: Tracker = sink.tracker
        self.options = options
        self.strategy = strategy
        self.transfer = transfer
        self.health = health
        self._read_plans = read_plans
        self.state: State = state
        self.error: str | None = None
        # Counters; bytes landed are the sink's.
        self.bytes_needed = sum(route_column(plan.routes, "nbytes")) if state == "loading" else 0
        self.bytes_read = 0
        self.reads = 0
        self.started = time.perf_counter() if state == "loading" else 0.0
        self.ended: float | None = None
        self.staging_budget = 0
        self.staging_peak = 0
        self._staging_live = False
        # A later load began (its state is the SlabSet's now): this one reports no more.
        self.superseded = False
        # The unit callbacks running (aclose() must not be awaited from one).
        self.callbacks: set[asyncio.Task[None]] = set()

    # --- the sink side, for whoever moves the bytes ------------------------------------

    def begin(self, on_complete: Callable[[str], None] | None) -> None:
        """Start counting (units without routes complete now)."""
        self.tracker.begin(on_complete)

    def land(self, route: int, nbytes: int) -> None:
        self.sink.land(route, nbytes)

    def record_staging(self, nbytes: int) -> None:
        """Buffers of ``nbytes`` held for the whole load (a distributed load's chunks)."""
        self.staging_budget = self.staging_peak = nbytes

    @property
    def complete(self) -> bool:
        return all(self.tracker.is_complete(u) for u in self.plan.units)

    def missing_units(self, limit: int = 5) -> list[str]:
        return [u for u in self.plan.units if not self.tracker.is_complete(u)][:limit]

    def finish(self, state: State, error: BaseException | None = None) -> None:
        self.state = state
        self.error = None if error is None else (str(error) or type(error).__name__)
        self.ended = time.perf_counter()
        if error is None:
            self.tracker.finish()
        else:
            self.tracker.fail(error)

    def void(self) -> None:
        """No unit of this failed load stays usable, its error kept for ``ready()``: on
        one rank of a distributed load, its units alone would be a partial model."""
        error = self.tracker.error or LoadError("distributed load failed")
        self.tracker.reset()
        self.tracker.fail(error)

    def statistics(self, device: torch.device) -> LoadStatistics:
        staging = self.strategy.staging() if self.strategy and self._staging_live else None
        return LoadStatistics(
            state=self.state,
            device=str(device),
            files=len(self.plan.files),
            tensors=len(self.plan.routes),
            tensors_landed=self.tracker.landed_routes,
            units=len(self.plan.units),
            units_complete=self.tracker.complete_units,
            bytes_total=self.plan.nbytes,
            bytes_needed=self.bytes_needed,
            bytes_read=self.bytes_read,
            bytes_landed=self.sink.bytes_landed,
            reads=self.reads,
            elapsed_s=(self.ended or time.perf_counter()) - self.started if self.started else 0.0,
            staging_budget=self.staging_budget,
            staging_peak=staging.peak_in_use if staging else self.staging_peak,
            unit_completed_at={
                u: s.completed_at
                for u, s in self.tracker.states().items()
                if s.completed_at is not None
            },
            error=self.error,
            transfer=self.transfer,
        )

    # --- a load the loader runs --------------------------------------------------------

    async def run(
        self,
        earlier: list[asyncio.Task[Any]],
        owner: object,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> None:
        """The whole load, to its end: once the ``earlier`` loads still releasing have
        ended, every read of the plan into the sink, a unit callback per unit as it
        completes (given ``owner``, the SlabSet), the release, and the final progress call.
        Raises what broke it, the load then ``failed`` or ``cancelled``."""
        strategy = self.strategy
        assert strategy is not None
        # One thread per read in flight: a cold cache needs several reads in flight to keep
        # storage busy, even on a machine with fewer cores than that, and niced threads with
        # short syscalls (see _read) leave the event loop a core the moment it wakes
        # (test_io_threads_run_niced_and_the_loop_does_not).
        pool = IoPool(strategy.workers, nice=self.options.io_nice)
        fds: dict[int, int] = {}
        loaded = False
        try:
            await self._after(earlier)
            error = await self._transfer(pool, fds, owner, on_unit_ready, progress)
            if error is not None:
                # Raised here, not in the handler that caught the task group's errors: as
                # that group's context, the error would hold the group's frames, and they
                # the task group, whose parent task holds the error (a cycle).
                try:
                    raise error from error.__cause__
                finally:
                    error = None
            if not self.complete:
                raise IncompleteLoadError(
                    f"load finished with incomplete units {self.missing_units()}"
                )
            loaded = True
        except asyncio.CancelledError as err:
            self.finish("cancelled", err)
            raise
        except AsyncSlabError as err:
            self.finish("failed", err)
            raise
        except Exception as err:
            raise self._failed(err) from err
        finally:
            try:
                # All of the release, even if cancelled meanwhile (the cancel is re-raised
                # after it): leaving early would leak the fds and the I/O threads
                # (test_cancel_at_random_points_leaks_nothing).
                await uncancellable(self._release(pool, fds))
            except asyncio.CancelledError:
                if loaded:  # every unit had landed; the cancel came while releasing
                    self.finish("complete")
                self._report_end(progress)
                raise
            if not loaded:
                self._report_end(progress)
        self._complete(progress)

    async def _after(self, earlier: list[asyncio.Task[Any]]) -> None:
        """Wait for the earlier loads still releasing: a failed or cancelled load is
        ``failed``/``cancelled`` (and a ready() caller may start the next) while its task
        still drains its threads, and for up to ``read_timeout`` a stuck read may still
        write into the slabs. Waited for even if cancelled meanwhile: aclose() must not
        free the slabs under that read. Then refuse slabs that release found broken."""
        running = [task for task in earlier if not task.done()]
        earlier.clear()  # their errors' frames need not live as long as this load
        if running:
            await uncancellable(asyncio.wait(running))
        if self.health.broken is not None:
            raise LoadError(f"these slabs cannot be reused: {self.health.broken}")

    async def _transfer(
        self,
        pool: IoPool,
        fds: dict[int, int],
        owner: object,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> BaseException | None:
        """Open the files and the transfer, then the reads and the unit callbacks; the
        error that broke them."""
        strategy = self.strategy
        assert strategy is not None
        reads, files = await self._open(pool, fds)
        self._staging_live = True
        read_one = strategy.open(reads, files, self.sink)
        self.staging_budget = strategy.staging_budget
        return await self._read_and_call_back(
            reads.schedule, files.paths, read_one, pool, owner, on_unit_ready, progress
        )

    def _complete(self, progress: ProgressCallback | None) -> None:
        """Every unit landed, everything released: complete, and the final progress call."""
        self.finish("complete")
        if progress is not None:
            try:
                refuse_awaitable(progress(self.statistics(self.sink.device)), "progress")
            except Exception as err:  # as one during the load: the load failed
                raise self._failed(err) from err

    async def _open(self, pool: IoPool, fds: dict[int, int]) -> tuple[Reads, Files]:
        """The plan's reads for this transfer (planned once per read size and gap) and its
        local files, opened and checked; each fd goes into ``fds`` as it opens, for the
        caller to close whatever happens."""
        strategy, options, plan = self.strategy, self.options, self.plan
        assert strategy is not None
        # Planning the reads is a pass over every route of the plan: off the loop, so
        # that a large plan does not stall it.
        key = (strategy.name, strategy.read_size, options.coalesce_gap)
        reads = self._read_plans.get(key)
        if reads is None:
            reads = await pool.run(_planned, strategy, self.sink, options.coalesce_gap)
            self._read_plans[key] = reads
        for i, shard in enumerate(plan.files):
            if shard.source is not None:  # an object: its reads are GETs (_strategy_remote)
                continue
            fds[i] = open_checked(
                shard.path, shard.size, shard.inode, shard.mtime_ns, shards=len(plan.files)
            )
        paths = [str(shard.path) for shard in plan.files]  # for errors
        return reads, Files(fds, paths, [f.size for f in plan.files])

    def _failed(self, err: Exception) -> LoadError:
        """Fail the load with ``err`` wrapped. (Not a local of the frame raising it: that
        frame lies in its traceback.)"""
        wrapped = LoadError(f"load failed: {err!r}")
        wrapped.__cause__ = err  # before finish() keeps a copy of it
        self.finish("failed", wrapped)
        return wrapped

    def _report_end(self, progress: ProgressCallback | None) -> None:
        """The final progress call of a load that failed or was cancelled: without it, a bar
        or a health check fed by the callback would go on saying "loading"."""
        if progress is None or self.superseded:
            return
        try:
            refuse_awaitable(progress(self.statistics(self.sink.device)), "progress")
        except Exception:
            # The load has failed already, with the error that matters; a callback that
            # also fails to report it must not replace that error.
            pass

    async def _release(self, pool: IoPool, fds: Mapping[int, int]) -> None:
        drained = await pool.drain(self.options.read_timeout)
        await pool.close(wait=drained)
        strategy = self.strategy
        assert strategy is not None
        staging = strategy.staging()
        if staging is not None:
            self.staging_peak = staging.peak_in_use
        self._staging_live = False
        if drained:
            _close(list(fds.values()), strategy)
        else:
            # A read stuck in a thread still reads its fd (or copies out of a mapping) and
            # writes into the slabs (or a staging buffer) when it wakes: closing the fd now
            # would let an unrelated open reuse its number, and aclose() would free the
            # memory under it. Keep all of them until the last such read returns
            # (test_stalled_read_keeps_its_fd_and_memory_until_it_returns).
            keep = [list(self.sink.route_bytes), self.sink.backing, self._read_plans]
            pool.when_idle(lambda: _close(list(fds.values()), strategy, keep))
            self.health.broken = (
                "a read thread did not return within read_timeout and may still write "
                "into them; allocate a new SlabSet"
            )

    async def _read_and_call_back(
        self,
        sched: Schedule,
        paths: Sequence[str],
        read_one: ReadOne,
        pool: IoPool,
        owner: object,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> BaseException | None:
        """The reads, and a unit callback per unit as it completes, in one task group; the
        error that broke them (the rest are its consequences: cancelled siblings)."""
        callbacks = self.callbacks
        try:
            async with asyncio.TaskGroup() as tg:

                def unit_done(unit: str) -> None:
                    if on_unit_ready is not None:
                        task = tg.create_task(_callback(on_unit_ready, unit, owner))
                        callbacks.add(task)
                        task.add_done_callback(callbacks.discard)

                self.begin(unit_done)
                for route in sched.empty:
                    self.land(route, 0)
                workers = min(self.strategy.workers if self.strategy else 1, max(1, len(sched.ops)))
                tg.create_task(read_all(self, sched.ops, paths, read_one, pool, workers, progress))
        except BaseExceptionGroup as group:
            # Nobody sees the group: its traceback goes. It holds the task group's exit
            # frame, which holds the group (a cycle through the error it wraps).
            group.__traceback__ = None
            return _first_error(group)
        except asyncio.CancelledError as err:
            # The same for a cancellation the task group passes on, raised again from here.
            err.__traceback__ = None
            raise
        finally:
            # unit_done stays with the tracker until the load finishes: it must not hold
            # the task group, whose parent task holds a failed load's error.
            tg = None  # type: ignore[assignment]
        return None


def _planned(strategy: TransferStrategy, sink: Sink, gap: int) -> Reads:
    with gc_paused():  # many small objects, none cyclic (see _format)
        return strategy.plan(sink, gap)


def _close(fds: Sequence[int], strategy: TransferStrategy, *keep: object) -> None:
    """Close a load's fds and what its transfer opened (``keep``: kept alive until now)."""
    for fd in fds:
        os.close(fd)
    strategy.close()


def check_progress(progress: ProgressCallback | None) -> None:
    if progress is None:
        return
    if not callable(progress):
        raise TypeError(f"progress must be callable, got {type(progress).__name__}")
    if inspect.iscoroutinefunction(progress) or inspect.iscoroutinefunction(
        type(progress).__call__  # an object with an async __call__
    ):
        raise TypeError(
            "progress is an async function; the loader calls it without awaiting (it must "
            "not hold the load up), so it must be a plain function"
        )


async def _callback(callback: UnitCallback, unit: str, slabs: Any) -> None:
    await _await_callback(callback(unit, slabs), unit)


async def _await_callback(pending: object, unit: str) -> None:
    """What a unit callback returned, awaited; its failures as the load reports them."""
    try:
        if not inspect.isawaitable(pending):
            # A plain function: it ran, but the loader awaits the callback (it may do I/O),
            # and Python's "NoneType can't be used in 'await'" would not say why.
            raise LoadError(
                f"on_unit_ready must be an async function (for unit {unit!r} it returned "
                f"{type(pending).__name__}, not an awaitable)"
            )
        await pending
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the load is being torn down
            raise
        # The callback's own doing (it awaited something cancelled): a TaskGroup would take
        # it for a clean end, and the load would report the unit post-processed.
        raise LoadError(f"on_unit_ready callback for unit {unit!r} was cancelled") from None
    except AsyncSlabError:
        raise
    except Exception as err:
        raise LoadError(f"on_unit_ready callback failed for unit {unit!r}: {err!r}") from err


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that broke the load; the rest are consequences (cancelled siblings)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


async def uncancellable(awaitable: Awaitable[T]) -> T:
    """Finish cleanup even if the task is cancelled again meanwhile, then re-raise."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def _open_file_limit() -> str:
    try:
        import resource  # Unix only
    except ImportError:  # pragma: no cover - Windows
        return "a limited number of"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "any number of" if soft == resource.RLIM_INFINITY else str(soft)


def open_checked(
    path: os.PathLike[str], size: int, inode: int, mtime_ns: int, *, shards: int
) -> int:
    """Open one of a load's ``shards`` files, refusing one that changed since planning."""
    try:
        # O_NONBLOCK: a FIFO put in the file's place after planning would otherwise block
        # this open, on the event-loop thread, until a writer comes
        # (test_file_gone_or_replaced_after_planning).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno == errno.EMFILE:
            why += (
                f" (a load keeps all {shards} shard files of its plan open; "
                f"this process may have {_open_file_limit()} files open: raise that limit, "
                "RLIMIT_NOFILE, e.g. with `ulimit -n`)"
            )
        raise ReadError(f"cannot open: {why}", file=path) from err
    try:
        _check_unchanged(path, os.fstat(fd), size, inode, mtime_ns)
    except FileChangedError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # the planned regular file: reads block as usual
    return fd


def map_checked(
    path: os.PathLike[str], size: int, inode: int, mtime_ns: int, *, shards: int
) -> torch.Tensor:
    """One of a load's ``shards`` files as a private mapping (``uint8``, its whole
    ``size``), refusing one that changed since planning. Private: writing into a view of
    it writes into a copy of the page, never into the file. The mapping lives as long as
    any tensor viewing it."""
    fd = open_checked(path, size, inode, mtime_ns, shards=shards)
    try:
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except OSError as err:
        raise ReadError(f"cannot map: {err.strerror or err}", file=path) from err
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _check_unchanged(
    path: os.PathLike[str], st: os.stat_result, size: int, inode: int, mtime_ns: int
) -> None:
    if (st.st_size, st.st_ino, st.st_mtime_ns) != (size, inode, mtime_ns):
        what = f"size {size} -> {st.st_size}" if st.st_size != size else "replaced or modified"
        raise FileChangedError(
            f"file changed since it was planned ({what}); open and plan it again", file=path
        )


def check_files(plan: Plan) -> None:
    """Before a load changes anything: every shard still as planned. Else a swap refused
    at its first open would have reset the slabs of the model being served. (The open
    checks again: a file may change in between.)"""
    for shard in plan.files:
        if shard.source is not None:  # an object: each GET is pinned to its ETag instead
            continue
        try:
            st = os.stat(shard.path)
        except OSError as err:
            raise ReadError(f"cannot open: {err.strerror or err}", file=shard.path) from err
        _check_unchanged(shard.path, st, shard.size, shard.inode, shard.mtime_ns)

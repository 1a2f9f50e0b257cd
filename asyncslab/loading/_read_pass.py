"""The read pass of one :class:`~._load.Load`: I/O threads that each take the next read of
the schedule, read it and hand it to the event loop, which lands its pieces in order; a
watch that fails the load once a read has been in flight past ``read_timeout``; and the
progress calls while the reads run (:class:`_Ticker`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..errors import ReadTimeoutError
from ._options import LoadOptions, LoadStatistics, ProgressCallback
from ._read import IoPool, ReadFeed
from ._schedule import ReadOp
from ._sink import ReadOne, Sink

__all__ = ["Reading", "read_all", "refuse_awaitable"]

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


class Reading(Protocol):
    """What the pass needs of its load (a :class:`~._load.Load`): where the bytes land,
    how to read, and the counters it keeps."""

    options: LoadOptions
    sink: Sink
    started: float
    clock: Callable[[], float]
    reads: int
    bytes_read: int

    def statistics(self, device: torch.device) -> LoadStatistics: ...


async def read_all(
    load: Reading,
    ops: Sequence[ReadOp],
    paths: Sequence[str],
    read_one: ReadOne,
    pool: IoPool,
    workers: int,
    progress: ProgressCallback | None,
) -> None:
    """Every read of ``ops`` into ``load``'s sink, by ``workers`` I/O threads that each take
    the next read themselves (``read_one(thread, index)``) and report it here without
    waiting (see ReadFeed); this task lands what arrives (counted in ``load``) and watches
    for reads taking longer than ``read_timeout``."""
    options, sink = load.options, load.sink
    feed = ReadFeed(
        [op.nbytes for op in ops],
        workers,
        max_bytes_per_s=options.max_bytes_per_s,
        started=load.started,
        clock=load.clock,
    )
    me = asyncio.current_task()
    broken: list[BaseException] = []

    def fail(err: BaseException) -> None:
        broken.append(err)
        feed.stop()

    def torn_down() -> bool:  # this task cancelled: the load was, or a unit callback failed
        return me is not None and me.cancelling() > 0

    snapshot = functools.partial(load.statistics, sink.device)
    ticker = _Ticker(progress, options.progress_interval, snapshot, fail)
    landed = _lander(load, ops, feed, ticker, fail, torn_down)
    loop = asyncio.get_running_loop()
    drive = functools.partial(_drive, feed, read_one, loop, landed)  # per I/O thread
    try:
        await _drive_all(options.read_timeout, feed, drive, pool, workers, ops, paths)
        if broken:
            raise broken.pop()
        if not torn_down():
            ticker.flush()
    finally:
        feed.stop()
        ticker.close()
        # A failed load's traceback holds this frame and the drives' (whose closures
        # hold these cells): the drives, their tasks and this task would be a cycle with
        # the error, which holds the destination.
        drive = landed = me = None  # type: ignore[assignment]
        broken.clear()


def _lander(
    load: Reading,
    ops: Sequence[ReadOp],
    feed: ReadFeed,
    ticker: _Ticker,
    fail: Callable[[BaseException], None],
    torn_down: Callable[[], bool],
) -> Callable[[int, int], None]:
    """What the loop does with each read an I/O thread finished: land its pieces, count
    it, tick the progress."""
    sink = load.sink
    # The tracker's own land per piece, the sink's byte count once per read: a plan of
    # 300,000 small tensors lands that many pieces.
    land = sink.tracker.land

    def landed(index: int, n: int) -> None:  # on the loop thread, in arrival order
        # A load that is over or being torn down lands nothing more, so no unit completes
        # and no callback is started for a task group that is shutting down.
        if feed.stopped or torn_down():
            return
        try:
            load.reads += 1
            load.bytes_read += n
            total = 0
            for route, _, _, nbytes in ops[index].pieces:
                land(route, nbytes)
                total += nbytes
            sink.bytes_landed += total
            ticker.tick()
        except Exception as err:  # a landing or progress-callback error ends the load
            fail(err)

    return landed


async def _drive_all(
    limit: float | None,
    feed: ReadFeed,
    drive: Callable[[int], None],
    pool: IoPool,
    workers: int,
    ops: Sequence[ReadOp],
    paths: Sequence[str],
) -> None:
    """The I/O threads, each running ``drive`` until the feed has no read left, and the
    watch for a read past ``read_timeout``, in one task group."""
    try:
        async with asyncio.TaskGroup() as tg:
            drives = [tg.create_task(pool.run(drive, w)) for w in range(workers)]
            if limit is not None:
                tg.create_task(_watch(feed, drives, limit, ops, paths))
    except BaseException as err:
        # Raised by the task group, it holds the group's exit frame, which holds the
        # error: a cycle through the group and this task (see Load._read_and_call_back).
        # The errors it wraps keep their own tracebacks.
        err.__traceback__ = None
        raise
    finally:
        # This frame lies in a failed load's traceback: it must not hold the task group
        # and the drives (see read_all).
        tg = drives = drive = None  # type: ignore[assignment]


def _drive(
    feed: ReadFeed,
    read_one: ReadOne,
    loop: asyncio.AbstractEventLoop,
    landed: Callable[[int, int], None],
    worker: int,
) -> None:
    """I/O thread ``worker`` of :meth:`read_all`: takes the next read, reads it and
    reports it to ``landed`` on the loop, until the feed has none left or stops."""
    try:
        while (index := feed.take(worker)) is not None:
            n = read_one(worker, index)
            feed.finished(worker)
            # Queued before this thread's own completion: every read a thread finished has
            # landed by the time its _drive() is seen to return.
            loop.call_soon_threadsafe(landed, index, n)
            # Give up the core between reads: with every core busy reading, a waking event
            # loop would otherwise wait for one until a thread's time slice ends; the yield
            # costs no load time (figures in docs/performance.md;
            # test_io_threads_give_up_the_core_after_every_read).
            _yield()
    except BaseException:
        feed.stop()
        raise


async def _watch(
    feed: ReadFeed,
    drives: Sequence[asyncio.Task[None]],
    limit: float,
    ops: Sequence[ReadOp],
    paths: Sequence[str],
) -> None:
    """Until every drive has returned: fail with :class:`ReadTimeoutError` once a read has
    been in flight for ``limit`` seconds. Wakes only when the oldest read would expire."""
    while True:
        oldest = feed.oldest()
        now = feed.now()
        if oldest is not None and now - oldest[0] >= limit:
            op = ops[oldest[1]]
            raise ReadTimeoutError(
                f"read of {op.nbytes} bytes at offset {op.offset} took longer than "
                f"read_timeout={limit}s",
                file=paths[op.file],
                offset=op.offset,
            )
        wait = limit if oldest is None else oldest[0] + limit - now
        _, pending = await asyncio.wait(drives, timeout=max(wait, 0.001))
        if not pending:
            return


class _Ticker:
    """Calls the progress callback while the reads run: at once for a read that lands
    ``interval`` seconds or more after the last call, else from a timer at the end of that
    interval — so the latest figures go out within one interval even if nothing lands
    after them (a stalled read, the last read), and a stall still shows (elapsed time,
    falling rate). ``interval`` 0 calls on every landing, and only then.

    A callback failing fails the load: on a landing, the caller's error handling sees it;
    from the timer, ``fail`` gets it."""

    def __init__(
        self,
        callback: ProgressCallback | None,
        interval: float,
        snapshot: Callable[[], LoadStatistics],
        fail: Callable[[BaseException], None],
    ) -> None:
        self._callback = callback
        self._interval = interval
        self._snapshot = snapshot
        self._fail = fail
        self._last = time.perf_counter()
        self._sent = True  # nothing landed since the last call
        self._timer: asyncio.TimerHandle | None = None
        if callback is not None and interval > 0:
            self._timer = asyncio.get_running_loop().call_later(interval, self._beat)

    def tick(self) -> None:
        """A read landed (on the loop thread)."""
        if self._callback is None:
            return
        self._sent = False
        now = time.perf_counter()
        if now - self._last >= self._interval:
            self._send(now)

    def close(self) -> None:
        """The reads ended: no more calls from the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def flush(self) -> None:
        """Send what landed since the last call (the reads ended well: the figures of the
        last reads go out now, not after the unit callbacks)."""
        if self._callback is not None and not self._sent:
            self._send(time.perf_counter())

    def _send(self, now: float) -> None:
        assert self._callback is not None
        self._last = now
        self._sent = True
        result: object = self._callback(self._snapshot())
        refuse_awaitable(result, "progress")

    def _beat(self) -> None:
        now = time.perf_counter()
        wait = self._last + self._interval - now
        if wait <= 0:
            try:
                self._send(now)
            except Exception as err:
                self._timer = None
                self._fail(err)
                return
            wait = self._interval
        self._timer = asyncio.get_running_loop().call_later(wait, self._beat)


def refuse_awaitable(result: object, what: str) -> None:
    """A callback the loader calls without awaiting returned an awaitable (an ``async def``
    given as ``progress``): it would never run, silently."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # no "never awaited" warning on top of the error
        raise TypeError(
            f"the {what} callback returned {type(result).__name__}; it is called without "
            "being awaited, so it must be a plain function"
        )

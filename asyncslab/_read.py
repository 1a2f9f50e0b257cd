"""Positional reads off the event-loop thread.

``os.preadv`` scatters one read straight into many destinations (slab slots, or a staging
buffer), takes no file position (so concurrent reads of one file need no lock), and
releases the GIL while the kernel copies. A bounded thread pool runs them; the loop thread
only awaits futures. Threads cannot be interrupted mid-syscall, so on cancellation the pool
is *drained*: the load does not return while a thread may still write into a slab.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._errors import ReadError

__all__ = ["IoPool", "preadv_exact", "byte_view"]

T = TypeVar("T")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: Bytes per ``preadv`` call. A kernel built without preemption (common on servers and VMs)
#: runs a read syscall to its end before another thread gets the core: a 16 MiB read into
#: fresh memory held both cores of a 2-core VM for ~10 ms at a time, and the event loop
#: waited that long. Smaller syscalls give the scheduler a chance every few hundred µs;
#: the extra calls cost nothing measurable.
SYSCALL_BYTES = 1 << 20


def preadv_exact(fd: int, targets: Sequence[memoryview], offset: int, *, path: str) -> int:
    """Fill every buffer in ``targets`` from ``offset`` on; a short read is a
    :class:`ReadError` (the file was truncated after planning)."""
    total = sum(len(t) for t in targets)
    done = 0
    index = 0
    skip = 0  # bytes of targets[index] already filled
    while done < total:  # not `index < len(targets)`: empty targets alone need no read
        batch: list[memoryview] = []
        room = SYSCALL_BYTES
        i, start = index, skip
        while room and i < len(targets) and len(batch) < _IOV_MAX:
            piece = targets[i][start : start + room]
            if piece:
                batch.append(piece)
                room -= len(piece)
            i += 1
            start = 0
        try:
            n = os.preadv(fd, batch, offset + done)
        except OSError as err:
            raise ReadError(
                f"read of {total} bytes at offset {offset} failed: {err.strerror or err}",
                file=path,
                offset=offset,
            ) from err
        if n == 0:
            raise ReadError(
                f"file ended early: got {done} of {total} bytes at offset {offset} "
                "(truncated after planning?)",
                file=path,
                offset=offset,
            )
        done += n
        n += skip
        while index < len(targets) and n >= len(targets[index]):
            n -= len(targets[index])
            index += 1
        skip = n
    return done


def byte_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``address``; the caller keeps the owner alive."""
    import ctypes

    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


_Job = tuple[
    concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]
]


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class IoPool:
    """A fixed set of I/O threads whose work is always finished before they are released.

    ``run`` hands a blocking call to a thread; ``drain`` waits for every call still in a
    thread (including ones whose awaiting task was cancelled) so that no thread writes into
    memory its load no longer owns. Threads are started and joined by short-lived helper
    threads: ``Thread.start()`` and ``join()`` block their caller until the new or exiting
    thread gets the GIL, which, with other I/O threads busy, took tens of milliseconds on
    the event loop.
    """

    def __init__(self, workers: int, name: str = "asyncslab-io", *, nice: int = 0) -> None:
        self._nice = nice if sys.platform.startswith("linux") else 0  # per thread on Linux only
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(workers)
        ]
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._starter: threading.Thread | None = None

    def _start_all(self) -> None:
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        if self._nice:
            # Linux's nice() applies to the calling thread; elsewhere it would lower the
            # whole process, event loop included (hence Linux only).
            try:
                os.nice(self._nice)
            except OSError:
                pass
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # handed to the awaiting task
                future.set_exception(err)
            else:
                future.set_result(result)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._starter is None:
            self._starter = threading.Thread(target=self._start_all, name="asyncslab-io-start")
            self._starter.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        self._queue.put((future, fn, args, kwargs))
        return await asyncio.wrap_future(future)

    async def drain(self, limit: float | None) -> bool:
        """Wait for calls still running; ``False`` if some outlived ``limit`` seconds."""
        pending = [f for f in list(self._inflight) if not f.cancel()]
        if not pending:
            return True
        waiters = [asyncio.wrap_future(f) for f in pending]
        for waiter in waiters:
            # Their errors are consequences of the one the load reports; retrieve them so
            # asyncio does not print "exception was never retrieved" at exit.
            waiter.add_done_callback(_retrieve)
        _, still = await asyncio.wait(waiters, timeout=limit)
        return not still

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every call still in a thread has returned (at once if
        none is; else on the thread that finishes last)."""
        pending = list(self._inflight)
        if not pending:
            callback()
            return
        lock = threading.Lock()
        left = [len(pending)]

        def one_done(_: object) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()

        for future in pending:
            future.add_done_callback(one_done)

    async def close(self, wait: bool) -> None:
        """Stop the threads; with ``wait``, until they have exited (a thread stuck in a
        read is a daemon and is left behind when ``wait`` is false)."""
        for _ in self._threads:
            self._queue.put(None)
        starter = self._starter
        if not wait or starter is None:
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def join() -> None:
            starter.join()
            for t in self._threads:
                t.join()
            loop.call_soon_threadsafe(_set_done, exited)

        joiner = threading.Thread(target=join, name="asyncslab-io-join")
        joiner.start()
        await exited
        # The joiner has only its return left (every I/O thread is gone, nothing holds the
        # GIL): joining it is immediate, and no thread of this pool outlives close().
        joiner.join()

"""Positional reads off the event-loop thread.

``preadv`` scatters one read straight into many destinations (slab slots, or a staging
buffer), takes no file position (so concurrent reads of one file need no lock), and
releases the GIL while the kernel copies. A bounded thread pool runs them; the loop thread
only awaits futures. Threads cannot be interrupted mid-syscall, so on cancellation the pool
is *drained*: the load does not return while a thread may still write into a slab.

A load's reads go through :class:`Scatter`: each read's destinations as a ready-made iovec
array, built once per plan and reused by every load, handed to libc's ``preadv`` with no
Python object per destination. ``os.preadv`` wants a buffer object per destination, so a
large load would make tens of thousands of them: enough to wake the cyclic garbage collector
during every load and, now and then, for a full collection that holds the GIL while the
event loop waits (figures in docs/performance.md, "Why the loader is built as it is").
``os.preadv`` remains the fallback where libc's is not reachable
(``test_libc_preadv_is_the_path_on_linux``, ``test_property_partial_reads_through_os_preadv``).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import ctypes
import errno
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .._os import libc_preadv
from ..errors import ReadError

__all__ = [
    "IoPool",
    "ReadFeed",
    "Scatter",
    "scatter",
    "pread_scatter",
    "byte_view",
    "retrieve",
]

T = TypeVar("T")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: Bytes per ``preadv`` call. A kernel built without preemption (common on servers and VMs)
#: runs a read syscall to its end before another thread gets the core, so the event loop
#: can wait as long as the longest syscall, and a large read into fresh memory takes long.
#: Syscalls of this size give the scheduler a chance often, at no cost the benchmarks can
#: see (figures in docs/performance.md). That no syscall exceeds it is pinned by
#: ``test_calls_respect_syscall_size_and_iov_limit``.
SYSCALL_BYTES = 1 << 20


# --- scatter reads through ready-made iovec arrays ---------------------------------------

#: An iovec is ``{void *iov_base; size_t iov_len}``: two machine words, stored as a flat
#: ``array`` of unsigned integers of that size.
_WORD = ctypes.sizeof(ctypes.c_size_t)
_IOV_CODE = next(
    (c for c in "QLI" if array.array(c).itemsize == _WORD == ctypes.sizeof(ctypes.c_void_p)),
    "Q",
)
_IOV_BYTES = 2 * _WORD


@dataclass(frozen=True, slots=True)
class Scatter:
    """One read's destinations, in file order: ``iov`` holds ``(address, length)`` pairs
    (native iovec layout), ``calls`` cuts them into syscalls ``(first entry, entries,
    bytes)`` of at most :func:`scatter`'s limit and the kernel's iovec limit each, in order.
    The caller keeps the memory the addresses point into alive while a read runs."""

    iov: array.array[int]
    calls: tuple[tuple[int, int, int], ...]
    nbytes: int


def scatter(regions: Iterable[tuple[int, int]], *, limit: int | None = None) -> Scatter:
    """The :class:`Scatter` filling ``regions``, ``(address, nbytes)`` pairs receiving
    consecutive bytes of the file (a region may repeat: gaps go to one scratch buffer), in
    syscalls of at most ``limit`` bytes (default :data:`SYSCALL_BYTES`)."""
    limit = SYSCALL_BYTES if limit is None else limit
    iov = array.array(_IOV_CODE)
    append = iov.append
    calls: list[tuple[int, int, int]] = []
    first = entries = 0
    room = limit
    total = 0
    for address, nbytes in regions:
        total += nbytes
        while nbytes:
            take = nbytes if nbytes < room else room
            append(address)
            append(take)
            entries += 1
            address += take
            nbytes -= take
            room -= take
            if not room or entries == _IOV_MAX:
                calls.append((first, entries, limit - room))
                first += entries
                entries = 0
                room = limit
    if entries:
        calls.append((first, entries, limit - room))
    return Scatter(iov, tuple(calls), total)


def pread_scatter(fd: int, target: Scatter, offset: int, *, path: str) -> int:
    """Fill ``target`` from ``offset`` on; returns its byte count. A short read is resumed
    where it stopped; end of file before the last byte is a :class:`ReadError` (the file
    was truncated after planning), as is a failing syscall."""
    base = target.iov.buffer_info()[0]
    done = 0
    for first, entries, nbytes in target.calls:
        n = _preadv_checked(
            fd, base + first * _IOV_BYTES, entries, offset + done, offset, target, path, done
        )
        if n != nbytes:
            _resume(fd, target, first, entries, n, offset + done, offset, path, done)
        done += nbytes
    return done


def _resume(
    fd: int,
    target: Scatter,
    first: int,
    entries: int,
    got: int,
    at: int,
    offset: int,
    path: str,
    done: int,
) -> None:
    # Rare (a regular file reads short only at its end): rebuild the rest of this syscall's
    # entries past the bytes that arrived, and read again until they are filled.
    pairs = target.iov[2 * first : 2 * (first + entries)]
    rest = [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)]
    want = sum(n for _, n in rest)
    while True:
        skip = got
        while rest and skip >= rest[0][1]:
            skip -= rest[0][1]
            rest.pop(0)
        if skip:
            address, n = rest[0]
            rest[0] = (address + skip, n - skip)
        want -= got
        at += got
        done += got
        if not rest:
            return
        iov = array.array(_IOV_CODE, [v for pair in rest for v in pair])
        got = _preadv_checked(fd, iov.buffer_info()[0], len(rest), at, offset, target, path, done)
        if got == want:
            return


def _preadv_checked(
    fd: int,
    iov_address: int,
    entries: int,
    at: int,
    offset: int,
    target: Scatter,
    path: str,
    done: int,
) -> int:
    try:
        n = _preadv_raw(fd, iov_address, entries, at)
    except OSError as err:
        raise ReadError(
            f"read of {target.nbytes} bytes at offset {offset} failed: {err.strerror or err}",
            file=path,
            offset=offset,
        ) from err
    if n == 0:
        raise ReadError(
            f"file ended early: got {done} of {target.nbytes} bytes at offset {offset} "
            "(truncated after planning?)",
            file=path,
            offset=offset,
        )
    return n


def _preadv_via_os(fd: int, iov_address: int, entries: int, at: int) -> int:
    """``preadv`` through ``os.preadv``: a memoryview per iovec entry."""
    pairs = (ctypes.c_size_t * (2 * entries)).from_address(iov_address)
    return os.preadv(fd, [byte_view(pairs[i], pairs[i + 1]) for i in range(0, 2 * entries, 2)], at)


def _raising(fn: Callable[[int, int, int, int], int]) -> Callable[[int, int, int, int], int]:
    """``fn`` (a C ``preadv``: -1 and ``errno`` on failure) raising ``OSError`` instead, and
    retrying when interrupted by a signal, as ``os.preadv`` does (PEP 475)."""

    def preadv(fd: int, iov_address: int, entries: int, at: int) -> int:
        while True:
            n = fn(fd, iov_address, entries, at)
            if n >= 0:
                return n
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))

    return preadv


def _libc_preadv() -> Callable[[int, int, int, int], int] | None:
    fn = libc_preadv()
    return None if fn is None else _raising(fn)


#: The one syscall under :func:`pread_scatter`: ``(fd, iovec array address, entries,
#: file offset) -> bytes read``, raising ``OSError``.
_preadv_raw: Callable[[int, int, int, int], int] = _libc_preadv() or _preadv_via_os


def byte_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``address``; the caller keeps the owner alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (its error is reported elsewhere), so that
    asyncio does not log it as never retrieved."""
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
    thread gets the GIL, which, with other I/O threads busy holding and retaking it, can
    take long, and the event loop must not be that caller.
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
                del result
            # The call's error holds this frame, and the future holds the error: a cycle,
            # and this frame keeps the previous call's locals while it waits for the next.
            del item, future, fn, args, kwargs

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._starter is None:
            self._starter = threading.Thread(target=self._start_all, name="asyncslab-io-start")
            self._starter.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        self._queue.put((future, fn, args, kwargs))
        try:
            return await asyncio.wrap_future(future)
        finally:
            # The call's error holds this frame, and the future holds the error: a cycle.
            del future

    async def drain(self, limit: float | None) -> bool:
        """Wait for calls still running; ``False`` if some outlived ``limit`` seconds."""
        pending = [f for f in list(self._inflight) if not f.cancel()]
        if not pending:
            return True
        waiters = [asyncio.wrap_future(f) for f in pending]
        for waiter in waiters:
            # Their errors are consequences of the one the load reports; retrieve them so
            # asyncio does not print "exception was never retrieved" at exit.
            waiter.add_done_callback(retrieve)
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


class ReadFeed:
    """The reads of one load, for I/O threads that take the next one themselves.

    Handing each read to a thread from the event loop costs a round trip per read (the
    thread idles until the loop has woken, landed the last read and queued the next): a
    measurable share of a load from a warm page cache (docs/performance.md). Here a thread
    calls :meth:`take` for the next read's index, reads it, and reports it to the loop
    without waiting for an answer (``test_feed_hands_each_read_out_once_across_threads``).
    The loop keeps the watch: :meth:`oldest` tells how long the longest read has been in
    flight, and :meth:`stop` makes every thread stop after its current read.

    ``clock`` times reads in flight against ``read_timeout`` (seconds, never going back; by
    default ``perf_counter``). A test passes one of its own, so that whether a read took
    too long is its decision, not the machine's
    (``test_timeout_names_the_stalled_read_while_others_finished``). Pacing keeps real time.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        workers: int,
        *,
        max_bytes_per_s: float | None = None,
        started: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._sizes = sizes
        self._clock = clock
        self._cursor = iter(range(len(sizes)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rate = max_bytes_per_s
        self._started = started or time.perf_counter()
        self._paced = 0
        self._since: list[tuple[float, int] | None] = [None] * workers

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()

    def take(self, worker: int) -> int | None:
        """The next read for thread ``worker``, once the pace allows it to start; ``None``
        when there is none left or the feed stopped."""
        with self._lock:
            index = None if self._stop.is_set() else next(self._cursor, None)
            if index is None:
                return None
            due = 0.0
            if self._rate is not None:
                # Each read starts no earlier than the rate allows for the bytes before it.
                self._paced += self._sizes[index]
                due = self._started + self._paced / self._rate
        delay = due - time.perf_counter()
        if delay > 0 and self._stop.wait(delay):
            return None
        self._since[worker] = (self._clock(), index)
        return index

    def finished(self, worker: int) -> None:
        self._since[worker] = None

    def now(self) -> float:
        """The time on the clock that :meth:`oldest` is stamped with."""
        return self._clock()

    def oldest(self) -> tuple[float, int] | None:
        """``(now() when it started, index)`` of the read longest in flight."""
        times = [since for since in list(self._since) if since is not None]
        return min(times) if times else None

"""The operating system's side, in one place: libc's calls through ``ctypes`` (one handle,
opened once), the page size and ``madvise`` advice, the process's resident memory, and the
event loop a synchronous caller runs a coroutine on. Every stage reads files, maps them or
faults memory in; none should open libc, or read ``/proc``, a way of its own.

libc is ``ctypes.CDLL(None, use_errno=True)``: the symbols already loaded into this
process (libc among them, on Linux and macOS), with no search of the filesystem
(``ctypes.util.find_library`` runs a compiler or ``ldconfig`` to find a name), and ``errno``
kept for :func:`ctypes.get_errno` after each call. A lookup returns ``None`` where the call
is missing or of no use here (another platform): each caller has a fallback, or does
without.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import mmap
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "MAP_FAILED",
    "PAGE",
    "Mmap",
    "libc",
    "libc_madvise",
    "libc_mincore",
    "libc_mmap",
    "libc_preadv",
    "loop_factory",
    "loop_name",
    "peak_rss",
    "proc_status",
    "reset_peak_rss",
    "run",
]

T = TypeVar("T")

#: Bytes per page of virtual memory: what ``mmap``, ``madvise`` and ``mincore`` count in.
PAGE = mmap.PAGESIZE

# linux/mman.h
MADV_HUGEPAGE = 14
#: Fault a range in for reading, reporting a page past a file's end (Linux 5.14+).
MADV_POPULATE_READ = 22
#: Fault a range in for writing without changing a byte (Linux 5.14+).
MADV_POPULATE_WRITE = 23

#: What ``mmap`` returns on failure, as ``ctypes.c_void_p`` reads it.
MAP_FAILED = ctypes.c_void_p(-1).value

_LINUX = sys.platform.startswith("linux")


@functools.cache
def libc() -> ctypes.CDLL | None:
    """This process's libc, with ``errno`` kept per call; ``None`` where it cannot be
    opened so (Windows). Opened once: every function looked up on it is one object, its
    argument types set once."""
    if sys.platform == "win32":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """libc's ``name`` with its C signature set, or ``None``."""
    handle = libc()
    try:
        fn = getattr(handle, name) if handle is not None else None
    except AttributeError:
        return None
    if fn is not None:
        fn.argtypes = argtypes
        fn.restype = restype
    return fn


@functools.cache
def libc_preadv() -> Callable[[int, int, int, int], int] | None:
    """``preadv(fd, iovec array address, entries, offset)`` as C returns it (-1 and
    ``errno`` on failure), on Linux and macOS with 64-bit words (the iovec layout the
    readers build); ``None`` elsewhere. ctypes releases the GIL for the call, as
    ``os.preadv`` does."""
    if not sys.platform.startswith(("linux", "darwin")) or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None
    fn = _function(
        "preadv", (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64), ctypes.c_ssize_t
    )
    return fn  # type: ignore[no-any-return]


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """``madvise(address, length, advice)``: 0, or -1 and ``errno``; Linux only (the
    advice used here, ``MADV_*`` above, is Linux's)."""
    if not _LINUX:
        return None
    fn = _function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    return fn  # type: ignore[no-any-return]


@functools.cache
def libc_mincore() -> Callable[[int, int, Any], int] | None:
    """``mincore(address, length, vector)``: which pages of a mapping are resident (bit 0 of
    each vector byte); Linux only."""
    if not _LINUX:
        return None
    fn = _function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int)
    return fn  # type: ignore[no-any-return]


class Mmap:
    """libc's ``mmap(address, length, prot, flags, fd, offset)`` (an address, or
    :data:`MAP_FAILED` and ``errno``) and ``munmap(address, length)``."""

    def __init__(self) -> None:
        self.mmap: Callable[..., int | None] = _function(
            "mmap",
            (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_long),
            ctypes.c_void_p,
        )  # fmt: skip
        self.munmap: Callable[[int, int], int] = _function(
            "munmap", (ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
        )


@functools.cache
def libc_mmap() -> Mmap:
    """libc's ``mmap`` and ``munmap`` (Linux), rather than the ``mmap`` module: a module
    mapping exports its memory only as a Python buffer, which cannot be closed while a
    tensor views it; here the address is plain and its owner unmaps it when done. Raises
    ``OSError(ENOTSUP)`` elsewhere."""
    if not _LINUX or libc() is None:
        raise OSError(errno.ENOTSUP, "mapped loads need Linux")
    return Mmap()


# --- this process's memory --------------------------------------------------------------


def peak_rss() -> int | None:
    """The most resident memory this process has held, in bytes (``ru_maxrss``: KiB on
    Linux, bytes on macOS); ``None`` where the platform does not say (Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM`` (the peak since start or :func:`reset_peak_rss`), ``RssAnon``
    and ``RssFile`` of this process from ``/proc/self/status``, in bytes; 0 where unknown
    (not Linux)."""
    out = dict.fromkeys(_STATUS_FIELDS, 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident memory (Linux ``clear_refs`` 5), so that a
    later :func:`proc_status` gives the peak of what ran since; False where unsupported
    (:func:`peak_rss` cannot be reset: it keeps the peak since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    status = proc_status()
    return status["VmHWM"] <= status["VmRSS"] + (1 << 20)


# --- the event loop ---------------------------------------------------------------------


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` where uvloop is installed (servers run on it); ``None``,
    asyncio's own loop, where not. Looked up at each call: an environment without uvloop
    is one a test can make (``sys.modules["uvloop"] = None``)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` runs on."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(work: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(work)``, on uvloop where it is installed (:func:`loop_factory`)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(work)

"""The page cache: the shard files read once to warm it, dropped from it before a cold run,
and how much of them it holds (``mincore``), so that a cold run that was not cold is told."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .contenders import COLD_CACHED_MAX, MiB

__all__ = ["cached_share", "check_cold", "drop_cache", "read_all"]


def read_all(files: Iterable[Path]) -> tuple[int, float]:
    """Read every file once (warms the page cache); returns bytes and seconds."""
    buffer = bytearray(16 * MiB)
    view = memoryview(buffer)
    total = 0
    t = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t


def drop_cache(files: Iterable[Path]) -> float | None:
    """Evict the files from the page cache; returns the share of their pages still cached
    after (``None``: unknown). Dirty pages cannot be dropped, so they are written back first
    (fsync); mapped pages are not dropped either (none are mapped here); tmpfs drops nothing."""
    files = list(files)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return cached_share(files)


def cached_share(files: Sequence[Path]) -> float | None:
    """Share of the files' pages in the page cache (``mincore`` over a mapping of each)."""
    from ..._os import MAP_FAILED, PAGE, libc_mincore, libc_mmap

    mincore = libc_mincore()
    if mincore is None:
        return None
    mapper = libc_mmap()
    cached = pages = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        n = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        fd = os.open(path, os.O_RDONLY)
        try:
            address = mapper.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address is None or address == MAP_FAILED:
                return None
            try:
                if mincore(address, size, vec) != 0:
                    return None
            finally:
                mapper.munmap(address, size)
        finally:
            os.close(fd)
        cached += sum(b & 1 for b in vec)
        pages += n
    return cached / pages if pages else 0.0


def check_cold(files: Sequence[Path]) -> dict[str, Any]:
    """Does fadvise(DONTNEED) make reads cold? Time one file dropped, then again warm."""
    probe = max(files, key=lambda p: p.stat().st_size)
    cached = drop_cache([probe])
    n, cold_s = read_all([probe])
    _, warm_s = read_all([probe])
    cold = n / cold_s / 1e9 if cold_s > 0 else 0.0
    warm = n / warm_s / 1e9 if warm_s > 0 else 0.0
    # Timing alone would pass a file on tmpfs (nothing dropped) as cold: the page cache
    # itself says what was dropped, where mincore can tell.
    effective = cold < 0.7 * warm and (cached is None or cached <= COLD_CACHED_MAX)
    return {
        "file": str(probe),
        "bytes": n,
        "cold_gbps": cold,
        "warm_gbps": warm,
        "cached_after_drop": cached,
        "effective": effective,
    }

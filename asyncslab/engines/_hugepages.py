"""Transparent huge pages for an engine's parameter memory, asked for before its first touch.

Memory a process has never touched costs a page fault per page on its first write: for
parameters read straight from a checkpoint, at 4 KiB pages, most of a first load. Where the
kernel offers transparent huge pages on request (``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``madvise`` or ``always``), ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned
inside of each large storage makes its first touch fault once per 2 MiB instead. Where they
are off, or the call is refused, nothing changes: the memory faults in 4 KiB pages as before.

Asked for only with ``ASYNCSLAB_HUGE_PAGES=1`` in the environment: on the development VM a
huge page's first touch cost more than the 512 small faults it replaces (docs/performance.md),
and a loader must not be slower than the engine's default where they do not pay.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from .._os import MADV_HUGEPAGE, libc_madvise

__all__ = ["HUGE_PAGE", "advise_huge_pages", "huge_pages_offered"]

HUGE_PAGE = 2 << 20
_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether huge pages are asked for (``ASYNCSLAB_HUGE_PAGES=1``) and this kernel gives
    them to memory that asks."""
    if not sys.platform.startswith("linux") or os.environ.get("ASYNCSLAB_HUGE_PAGES") != "1":
        return False
    try:
        mode = _ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Ask for huge pages under each CPU tensor's storage (each storage once), where it
    spans at least one aligned 2 MiB page; return the bytes so advised (0 where huge pages
    are not offered or the kernel refused)."""
    if not huge_pages_offered():
        return 0
    madvise = libc_madvise()
    if madvise is None:
        return 0
    seen: set[int] = set()
    advised = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start in seen or storage.nbytes() < HUGE_PAGE:
            continue
        seen.add(start)
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        last = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0:
            advised += last - first
    return advised

"""Loading, the staging buffers (GPU targets): pinned host buffers under a byte budget, one
per I/O thread.

A thread reads into its own buffer, enqueues the copies out of it and waits for them before
its next read (the copier returns only then). So host memory stays at the budget whatever
the checkpoint's size, and no buffer ever changes hands: between two reads a thread waits
for its own copy, never for an event-loop turn. Handing each read and its buffer over from
the event loop would cost a round trip through the loop per read, each retaking the GIL
behind the other threads (see ``_read.ReadFeed``).

A buffer is made (pinned) by its thread when that thread first reads, so the first read
starts after one buffer is pinned, not all of them: pinning is slow enough that pinning
the whole budget up front is a visible share of a GPU load (figures in
docs/performance.md). Tests: ``test_staged_load_pins_one_buffer_per_thread_on_the_threads``,
``test_staging_buffers_one_per_thread_made_when_first_used``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["StagingBuffers", "StagingStatistics", "pinned_bytes", "staging_budget"]


def pinned_bytes(size: int) -> int:
    """The pinned memory ``torch.empty(size, pin_memory=True)`` holds: torch's pinned-memory
    allocator rounds each block up to a power of two (and keeps it for reuse when freed)."""
    return 1 << (size - 1).bit_length() if size > 0 else 0


def staging_budget(budget: int, buffers: int, pinned: bool) -> int:
    """The bytes the staging buffers really take: pinned ones a power of two each, rounded
    down, so that what torch pins (see :func:`pinned_bytes`) stays within the budget: 8
    buffers of 48 MiB would pin 512 MiB of a 384 MiB budget."""
    size = budget // buffers
    if pinned:
        size = 1 << (size.bit_length() - 1)
    return size * buffers


@dataclass(frozen=True, slots=True)
class StagingStatistics:
    buffers: int
    buffer_bytes: int
    in_use: int
    peak_in_use: int


class StagingBuffers:
    def __init__(self, budget: int, buffers: int, make: Callable[[int], torch.Tensor]) -> None:
        """``buffers`` buffers of ``budget // buffers`` bytes, buffer ``i`` for I/O thread
        ``i`` alone, made by ``make(size)`` on that thread when it first needs it."""
        if buffers <= 0 or budget < buffers:
            raise ValueError(f"staging budget {budget} cannot hold {buffers} buffers")
        self.buffer_bytes = budget // buffers
        self._slots: list[torch.Tensor | None] = [None] * buffers
        self._make = make
        # Only the counts are shared between threads (and read by the event loop).
        self._lock = threading.Lock()
        self._in_use = 0
        self._peak = 0

    @contextmanager
    def use(self, worker: int) -> Iterator[torch.Tensor]:
        """Thread ``worker``'s buffer, in use until the block ends. A failed ``make``
        leaves the slot empty: the next use tries again."""
        buffer = self._slots[worker]
        if buffer is None:
            buffer = self._slots[worker] = self._make(self.buffer_bytes)
        with self._lock:
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
        try:
            yield buffer
        finally:
            with self._lock:
                self._in_use -= 1

    def statistics(self) -> StagingStatistics:
        """``buffers``: those made so far."""
        with self._lock:
            in_use, peak = self._in_use, self._peak
        made = sum(buffer is not None for buffer in self._slots)
        return StagingStatistics(
            made, self.buffer_bytes, in_use * self.buffer_bytes, peak * self.buffer_bytes
        )

    def close(self) -> None:
        """Drop the buffers. Pinned ones go back to torch's pinned-memory cache, which keeps
        them pinned for later pinned allocations (a next load's buffers among them)."""
        self._slots = [None] * len(self._slots)

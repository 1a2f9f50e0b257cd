"""Stage 4 (GPU targets): a fixed ring of pinned host buffers under a byte budget.

A read first takes a free buffer; when none is free it waits (backpressure), so host memory
stays at the budget whatever the checkpoint's size. A buffer goes back to the ring only
after the copies out of it have completed (the copier waits on the event recorded on its
stream before returning it). Acquiring one buffer at a time and never holding one while
waiting for another means loads sharing a ring cannot deadlock.

The ring is made lazily: a buffer is pinned when a read first finds none free, so the first
read starts after one buffer is pinned, not all of them (pinning ran at ~1 GB/s on an H200
host: 0.25 s for the default 256 MiB, before any read, in a load that took ~1 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

__all__ = ["StagingRing", "StagingStatistics"]


@dataclass(frozen=True, slots=True)
class StagingStatistics:
    buffers: int
    buffer_bytes: int
    in_use: int
    peak_in_use: int


class StagingRing:
    def __init__(
        self, budget: int, buffers: int, make: Callable[[int], Awaitable[torch.Tensor]]
    ) -> None:
        """A ring of ``buffers`` buffers of ``budget // buffers`` bytes, each made by
        ``make(size)`` (say, pinned on a worker thread) when a read first needs it."""
        if buffers <= 0 or budget < buffers:
            raise ValueError(f"staging budget {budget} cannot hold {buffers} buffers")
        self.buffer_bytes = budget // buffers
        self._buffers: list[torch.Tensor] = []
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        self._in_use = 0
        self._peak = 0
        self._count = buffers  # buffers it may hold
        self._claimed = 0  # buffers it has or is making
        self._make = make

    async def acquire(self) -> torch.Tensor:
        if self._free.empty() and self._claimed < self._count:
            # Claim the slot before awaiting, so that concurrent acquirers make no more
            # than the ring holds; a failed (or cancelled) make gives it back.
            self._claimed += 1
            try:
                buffer = await self._make(self.buffer_bytes)
            except BaseException:
                self._claimed -= 1
                raise
            self._buffers.append(buffer)
        else:
            buffer = await self._free.get()
        self._in_use += 1
        self._peak = max(self._peak, self._in_use)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._in_use -= 1
        self._free.put_nowait(buffer)

    def statistics(self) -> StagingStatistics:
        """``buffers``: those made so far."""
        return StagingStatistics(
            len(self._buffers),
            self.buffer_bytes,
            self._in_use * self.buffer_bytes,
            self._peak * self.buffer_bytes,
        )

    def close(self) -> None:
        """Drop the buffers (pinned memory is freed when the last reference goes)."""
        self._buffers.clear()
        while not self._free.empty():
            self._free.get_nowait()

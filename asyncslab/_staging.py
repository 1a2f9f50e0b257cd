"""Stage 4 (GPU targets): a fixed ring of pinned host buffers under a byte budget.

A read first takes a free buffer; when none is free it waits (backpressure), so host memory
stays at the budget whatever the checkpoint's size. A buffer goes back to the ring only
after the copies out of it have completed (the copier waits on the event recorded on its
stream before returning it). Acquiring one buffer at a time and never holding one while
waiting for another means loads sharing a ring cannot deadlock.
"""

from __future__ import annotations

import asyncio
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
    def __init__(self, buffers: list[torch.Tensor]) -> None:
        if not buffers:
            raise ValueError("a staging ring needs at least one buffer")
        self.buffer_bytes = buffers[0].numel()
        self._buffers = buffers
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        for buffer in self._buffers:
            self._free.put_nowait(buffer)
        self._in_use = 0
        self._peak = 0

    @staticmethod
    def allocate(budget: int, buffers: int, *, pin: bool) -> list[torch.Tensor]:
        """The ring's buffers; pinning hundreds of MiB takes long enough that callers run
        this on a worker thread, not on the event loop."""
        if buffers <= 0 or budget < buffers:
            raise ValueError(f"staging budget {budget} cannot hold {buffers} buffers")
        size = budget // buffers
        return [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(buffers)]

    async def acquire(self) -> torch.Tensor:
        buffer = await self._free.get()
        self._in_use += 1
        self._peak = max(self._peak, self._in_use)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._in_use -= 1
        self._free.put_nowait(buffer)

    def statistics(self) -> StagingStatistics:
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

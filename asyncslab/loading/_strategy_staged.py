"""The staged transfer (the CUDA default, ``LoadOptions(transfer="staged")``): each I/O
thread reads into its own (pinned) staging buffer, then copies out of it into the slabs
and waits for its copies before its next read (see ``_pinned`` and ``_copy``)."""

from __future__ import annotations

import torch

from ._copy import Copier, read_staged
from ._options import LoadOptions
from ._pinned import StagingBuffers, StagingStatistics, staging_budget
from ._schedule import schedule
from ._sink import Files, ReadOne, Reads, Sink, named_copy

__all__ = ["Staged", "staging_buffer"]


def staging_buffer(size: int, pin: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


class Staged:
    name = "staged"

    def __init__(self, options: LoadOptions, device: torch.device, copier: Copier) -> None:
        self._pin = device.type == "cuda"
        self._buffers = options.staging_buffers
        # A read fills one buffer: no larger than the buffer as allocated (pinned ones are
        # rounded down, see staging_budget).
        self.staging_budget = staging_budget(options.staging_bytes, self._buffers, self._pin)
        self.read_size = self.staging_budget // self._buffers
        self.workers = self._buffers
        self._copier = copier
        self._staging: StagingBuffers | None = None

    def plan(self, sink: Sink, gap: int) -> Reads:
        return Reads(schedule(sink.plan, max_read=self.read_size, gap=gap))

    def open(self, reads: Reads, files: Files, sink: Sink) -> ReadOne:
        pin = self._pin
        # Pinning blocks for long: each I/O thread pins its own buffer when it first reads.
        staging = self._staging = StagingBuffers(
            self.staging_budget, self._buffers, lambda size: staging_buffer(size, pin)
        )
        ops, fds, paths = reads.schedule.ops, files.fds, files.paths
        copy = named_copy(self._copier.copy, sink, paths)

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            with staging.use(worker) as buffer:
                n = read_staged(fds[op.file], op, buffer, paths[op.file])
                # Returns once the copies completed: the next read may overwrite the buffer.
                copy(op, buffer, worker)
            return n

        return read_one

    def staging(self) -> StagingStatistics | None:
        return None if self._staging is None else self._staging.statistics()

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()

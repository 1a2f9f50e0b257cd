"""The direct transfer (CPU targets, ``LoadOptions(transfer="direct")``): each read
scattered by one ``preadv`` straight into the slots of host slabs, the gaps between
tensors into a scratch buffer. No staging, no copy: each byte is written once."""

from __future__ import annotations

import torch

from ._copy import direct_scatters, read_direct
from ._options import LoadOptions
from ._pinned import StagingStatistics
from ._schedule import schedule
from ._sink import Files, ReadOne, Reads, Sink

__all__ = ["Direct"]


class Direct:
    name = "direct"
    staging_budget = 0

    def __init__(self, options: LoadOptions) -> None:
        self.workers = options.io_workers
        self.read_size = options.read_size

    def plan(self, sink: Sink, gap: int) -> Reads:
        sched = schedule(sink.plan, max_read=self.read_size, gap=gap)
        scratch = torch.empty(max(1, gap), dtype=torch.uint8)
        # The destinations of every read, once per plan: the slabs never move.
        scatters = direct_scatters(sched.ops, sink.addresses(), scratch.data_ptr())
        return Reads(sched, scatters, scratch)

    def open(self, reads: Reads, files: Files, sink: Sink) -> ReadOne:
        ops, scatters = reads.schedule.ops, reads.scatters
        assert scatters is not None
        fds, paths = files.fds, files.paths

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            return read_direct(fds[op.file], op, scatters[index], paths[op.file])

        return read_one

    def staging(self) -> StagingStatistics | None:
        return None

    def close(self) -> None:
        pass

"""The seam between a load's byte movers and its destination.

A :class:`Sink` says where each route's bytes go (the byte tensor its slab lies in, and the
slab's offset there: DCP's ``resolve_tensor``) and takes each landing (``commit_tensor``):
the loader's transfers and the distributed chunk protocol move bytes through it, and touch
nothing else of the slabs. A :class:`TransferStrategy` is one way bytes travel from the
shard files into the sink (``_strategy_direct``, ``_strategy_staged``, ``_strategy_mapped``,
``_strategy_remote``; chosen in ``_strategy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .._failures import first_line
from ..errors import LoadError
from ..planning import Plan
from ._pinned import StagingStatistics
from ._read import Scatter
from ._schedule import ReadOp, Schedule
from ._tracker import Tracker

__all__ = ["Files", "ReadOne", "Reads", "Sink", "TransferStrategy", "named_copy"]

# (I/O thread, read index) -> bytes read; runs on the I/O thread.
ReadOne = Callable[[int, int], int]


class Sink:
    """One load's destination. Per route of ``plan``: ``route_bytes[i]``, the byte tensor
    its slab lies in, and ``route_base[i]``, where in it the slab starts. :meth:`land`
    counts a route's bytes as written (on the event-loop thread); the tracker completes a
    unit when its last route has."""

    __slots__ = (
        "backing",
        "bytes_landed",
        "device",
        "plan",
        "route_base",
        "route_bytes",
        "tracker",
    )

    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        route_bytes: Sequence[torch.Tensor],
        route_base: Sequence[int],
        tracker: Tracker,
        *,
        backing: torch.Tensor | None = None,
    ) -> None:
        # The one allocation every slab lies in; None where the slabs are given tensors.
        self.backing = backing
        self.plan = plan
        self.device = device
        self.route_bytes = route_bytes
        self.route_base = route_base
        self.tracker = tracker
        self.bytes_landed = 0

    def addresses(self) -> list[int]:
        """Per route, the address of its slab's first byte (host slabs: for direct reads)."""
        pairs = zip(self.route_bytes, self.route_base, strict=True)
        return [t.data_ptr() + base for t, base in pairs]

    def land(self, route: int, nbytes: int) -> None:
        self.tracker.land(route, nbytes)
        self.bytes_landed += nbytes

    def release(self) -> None:
        """Let go of the destination's memory (its SlabSet was closed); counts stay."""
        self.route_bytes = ()
        self.backing = None


@dataclass(frozen=True, slots=True)
class Reads:
    """A plan's reads for one transfer, read size and gap; for direct reads into host slabs
    also each read's destinations and the scratch buffer that takes the gaps between
    tensors. Plans are immutable and slabs never move, so a reload reuses them."""

    schedule: Schedule
    scatters: tuple[Scatter, ...] | None = None
    scratch: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Files:
    """A load's open shards: file index -> fd, and the paths errors name."""

    fds: Mapping[int, int]
    paths: Sequence[str]
    sizes: Sequence[int]


class TransferStrategy(Protocol):
    """One way bytes travel into a sink. ``workers`` I/O threads each call the reader
    :meth:`open` returned, one read at a time; :meth:`close` releases what :meth:`open`
    made, once no thread runs a read."""

    name: str  # as LoadStatistics.transfer reports it
    workers: int
    read_size: int
    staging_budget: int  # bytes of staging buffers it holds while open (0: none)

    def plan(self, sink: Sink, gap: int) -> Reads:
        """The reads of ``sink.plan`` (on an I/O thread: tens of ms for 10,000 tensors)."""
        ...

    def open(self, reads: Reads, files: Files, sink: Sink) -> ReadOne: ...

    def staging(self) -> StagingStatistics | None: ...

    def close(self) -> None: ...


def named_copy(
    copy: Callable[[ReadOp, torch.Tensor, Sequence[torch.Tensor], Sequence[int], int], None],
    sink: Sink,
    paths: Sequence[str],
) -> Callable[[ReadOp, torch.Tensor, int], None]:
    """``copy`` (a copier's) of one read's bytes in ``source`` into the sink, a failure
    raised as a :class:`LoadError` naming the read and its first tensor."""
    routes, device = sink.plan.routes, sink.device
    route_bytes, route_base = sink.route_bytes, sink.route_base

    def copy_read(op: ReadOp, source: torch.Tensor, worker: int) -> None:
        try:
            copy(op, source, route_bytes, route_base, worker)
        except Exception as err:
            first = routes[op.pieces[0][0]]
            raise LoadError(
                f"copy to {device} of the read of {op.nbytes} bytes at offset "
                f"{op.offset} ({len(op.pieces)} pieces, the first for "
                f"{first.describe()}) failed: {first_line(err)}",
                file=paths[op.file],
                tensor=first.tensor,
                offset=op.offset,
                slab=first.slab,
                slot=first.slot,
            ) from err

    return copy_read

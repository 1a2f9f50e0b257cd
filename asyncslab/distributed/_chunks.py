"""Reading every needed byte range once in a process group, and sharing it.

The pieces of ``share_reads=True`` (driven by ``_session._Session``): the global chunk
list every rank computes alike from every rank's needed ranges; this rank's reader of the
chunks it owns; and the index that finds where a received chunk's bytes land in this
rank's slabs (through the load's :class:`~asyncslab.loading._sink.Sink`, like any transfer).
"""

from __future__ import annotations

import array
import bisect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import LoadError
from ..loading import Sink
from ..planning import Plan

__all__ = [
    "POLL_S",
    "Chunk",
    "ChunkReader",
    "Done",
    "RouteIndex",
    "Segment",
    "SegmentSource",
    "needed_ranges",
    "pack_ranges",
    "share_chunks",
    "unpack_ranges",
]

#: How often a protocol thread, waiting on something that cannot be interrupted (the
#: loop, this rank's reader), looks whether its load was aborted meanwhile.
POLL_S = 0.25


# --- the global chunk list (pure) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """``nbytes`` at ``offset`` of file ``file``, at ``at`` in the chunk's buffer."""

    file: int
    offset: int
    nbytes: int
    at: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Read by ``owner``; broadcast when ``shared`` (several ranks need bytes of it), else
    only its owner needs it and nothing crosses the group."""

    owner: int
    shared: bool
    needers: tuple[int, ...]
    nbytes: int
    segments: tuple[Segment, ...]


def needed_ranges(plan: Plan) -> list[tuple[int, int, int]]:
    """This plan's byte ranges ``(file index, start, end)``, touching ones merged."""
    index = {f.path: i for i, f in enumerate(plan.files)}
    spans = sorted(
        (index[r.file], r.src_offset, r.src_offset + r.nbytes) for r in plan.routes if r.nbytes
    )
    out: list[tuple[int, int, int]] = []
    for f, s, e in spans:
        if out and out[-1][0] == f and s <= out[-1][2]:
            out[-1] = (f, out[-1][1], max(out[-1][2], e))
        else:
            out.append((f, s, e))
    return out


def pack_ranges(ranges: Sequence[tuple[int, int, int]]) -> bytes:
    return array.array("q", [x for r in ranges for x in r]).tobytes()


def unpack_ranges(data: bytes) -> list[tuple[int, int, int]]:
    a = array.array("q")
    a.frombytes(data)
    return [(a[i], a[i + 1], a[i + 2]) for i in range(0, len(a), 3)]


def share_chunks(
    ranges: Sequence[Sequence[tuple[int, int, int]]], *, chunk_bytes: int, gap: int = 0
) -> list[Chunk]:
    """The global chunk list, identical on every rank that computes it from the same input.

    ``ranges[r]`` are rank ``r``'s needed ranges. The union is cut at every rank's range
    boundaries into pieces with one set of ranks needing them; consecutive pieces needed by
    the same single rank, or by several ranks (``shared``), merge across gaps of at most
    ``gap`` unneeded bytes (read through, like the loader's coalescing); the result is packed
    into chunks of at most ``chunk_bytes``, each either private to one rank or shared. A
    private chunk's owner is the rank that needs it; a shared chunk goes to the rank with
    the fewest bytes to read so far (ties: lowest rank), so storage reads stay balanced.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    world = len(ranges)
    merged = _pieces(ranges, gap)
    # Pack per key (one open chunk for each rank's private bytes, one for shared bytes).
    closed: list[tuple[tuple[int, int], int, frozenset[int], list[Segment]]] = []
    open_: dict[int, tuple[tuple[int, int], frozenset[int], list[Segment], int]] = {}

    def close(key: int) -> None:
        first, needers, segments, _ = open_.pop(key)
        closed.append((first, key, needers, segments))

    for f, s, e, needers in merged:
        key = _key(needers)
        pos = s
        while pos < e:
            if key not in open_:
                open_[key] = ((f, pos), frozenset(), [], 0)
            first, have, segments, used = open_[key]
            take = min(e - pos, chunk_bytes - used)
            segments.append(Segment(f, pos, take, used))
            open_[key] = (first, have | needers, segments, used + take)
            pos += take
            if used + take == chunk_bytes:
                close(key)
    for key in list(open_):
        close(key)
    closed.sort(key=lambda c: c[0])
    load = [0] * world
    for _, key, _, segments in closed:
        if key >= 0:
            load[key] += sum(s.nbytes for s in segments)
    chunks: list[Chunk] = []
    for _, key, needers, segments in closed:
        nbytes = sum(s.nbytes for s in segments)
        if key >= 0:
            owner = key
        else:
            owner = min(range(world), key=lambda r: (load[r], r))
            load[owner] += nbytes
        chunks.append(Chunk(owner, key < 0, tuple(sorted(needers)), nbytes, tuple(segments)))
    return chunks


def _pieces(
    ranges: Sequence[Sequence[tuple[int, int, int]]], gap: int
) -> list[tuple[int, int, int, frozenset[int]]]:
    """``(file, start, end, needers)``: the union of every rank's ranges cut into elementary
    pieces (one set of ranks needing each), then merged per key across gaps of at most
    ``gap``; in file and offset order."""
    world = len(ranges)
    events: dict[int, list[tuple[int, int, int]]] = {}
    for r, spans in enumerate(ranges):
        for f, s, e in spans:
            if e > s:
                events.setdefault(f, []).extend(((s, 1, r), (e, -1, r)))
    merged: list[tuple[int, int, int, frozenset[int]]] = []
    for f in sorted(events):
        active = [0] * world
        last = None
        for pos, delta, r in sorted(events[f]):
            if last is not None and pos > last:
                needers = frozenset(i for i in range(world) if active[i])
                if needers:
                    key = _key(needers)
                    prev = merged[-1] if merged else None
                    if (
                        prev is not None
                        and prev[0] == f
                        and _key(prev[3]) == key
                        and last - prev[2] <= gap
                    ):
                        merged[-1] = (f, prev[1], pos, prev[3] | needers)
                    else:
                        merged.append((f, last, pos, needers))
            active[r] += delta
            last = pos
    return merged


def _key(needers: frozenset[int]) -> int:
    """The rank a piece is private to, or -1 when several ranks need it."""
    return next(iter(needers)) if len(needers) == 1 else -1


# --- this rank's side -------------------------------------------------------------------


#: One read done: its byte count (called on the reading thread, in order).
Done = Callable[[int], None]


class SegmentSource(Protocol):
    """Fills a chunk's buffer with its segments' bytes (``_sources``: the shards' files,
    or their objects)."""

    def read(self, segments: Sequence[Segment], address: int, done: Done) -> None:
        """Each segment's bytes at ``address + segment.at``; ``done(nbytes)`` after each read
        that succeeded. Returns only once no read of the chunk is in flight (the buffer is
        the caller's again), raising the first failure."""
        ...

    def close(self) -> None:
        """Release what reading took (files, threads); no read is in flight."""
        ...


class ChunkReader:
    """This rank's reads of the chunks it owns, in chunk order on a thread of its own, at
    most ``depth`` chunks ahead of the protocol: chunk ``k`` goes into ``host[k % depth]``,
    free once the protocol has processed chunk ``k - depth`` (:meth:`advance`). ``source``
    reads them (the shards' files, or their objects: ``_sources``).

    ``failing()``: this rank has failed or aborted (no further read is worth its bytes);
    ``aborted()``: the protocol must stop waiting for a read (it may never return). The
    thread counts ``reads`` and ``bytes_read``.
    """

    def __init__(
        self,
        chunks: Sequence[Chunk],
        rank: int,
        host: list[torch.Tensor],
        depth: int,
        source: SegmentSource,
        *,
        failing: Callable[[], bool],
        aborted: Callable[[], bool],
    ) -> None:
        self._chunks = chunks
        self._mine = [k for k, c in enumerate(chunks) if c.owner == rank]
        self._host = host
        self._depth = depth
        self._source = source
        self._failing = failing
        self._aborted = aborted
        self.reads = 0
        self.bytes_read = 0
        self._cond = threading.Condition()
        self._done = 0  # chunks the protocol has processed
        self._stop = False  # no further read starts
        # The protocol stopped waiting for the reader (this rank aborted while one of its
        # reads was in flight); the reader then closes the source when it returns.
        self._left = False
        self._exited = False
        self._swapped = False
        self._filled: dict[int, BaseException | None] = {}
        self._thread = threading.Thread(target=self._run, name="asyncslab-dist-read", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # Its own references: a read the protocol left behind may still write into these
        # buffers and read through this source whenever it returns.
        buffers = list(self._host)
        addresses = [t.data_ptr() for t in buffers]
        source, cond = self._source, self._cond
        try:
            for k in self._mine:
                with cond:
                    while self._done < k - self._depth + 1 and not self._stop:
                        cond.wait()
                    if self._stop:
                        return
                result: BaseException | None = None
                if not self._failing():
                    try:
                        address = addresses[k % self._depth]
                        source.read(self._chunks[k].segments, address, self._count)
                    except BaseException as err:
                        result = err
                with cond:
                    self._filled[k] = result
                    cond.notify_all()
        finally:
            with cond:
                self._exited = True
                left = self._left
            if left:
                source.close()

    def _count(self, nbytes: int) -> None:
        self.reads += 1
        self.bytes_read += nbytes

    def take(self, k: int) -> BaseException | None:
        """The outcome of this rank's read of chunk ``k``: its error, or ``None`` (also
        when this rank aborted before the read ended: a stuck read must not keep it from
        the collectives the others wait in)."""
        with self._cond:
            while k not in self._filled and not self._aborted():
                self._cond.wait(POLL_S)
            if k in self._filled:
                return self._filled.pop(k)
            self._stop = True  # the reader starts no further chunk
            self._cond.notify_all()
            if not self._swapped:
                # The read left behind (of chunk k: the reader reads in order) may land
                # in its buffer whenever it returns; a broadcast received there
                # meanwhile would read its status byte torn. The remaining chunks pass
                # through the other buffer, free since chunk k - 1 was copied out
                # (synchronously), instead of fresh ones: an allocation that failed
                # here would leave this rank out of the collectives its peers wait in.
                self._swapped = True
                self._host[:] = [self._host[(k + 1) % self._depth]] * self._depth
        return None

    def advance(self, k: int) -> None:
        """The protocol is done with chunk ``k`` (its buffer is free)."""
        with self._cond:
            self._done = k + 1
            self._cond.notify_all()

    def finish(self) -> bool:
        """Start no further read and wait for the thread. ``True`` when this rank aborted
        with a read still in flight (it may never return): the reader keeps its source and
        buffers, and closes the source itself when the read returns."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        while self._thread.is_alive():
            self._thread.join(POLL_S)
            if not self._aborted():
                continue
            with self._cond:
                if not self._exited:
                    self._left = True
                    return True
        return False


class RouteIndex:
    """This rank's routes by file and offset, to find what a chunk segment overlaps.

    A plan's routes never overlap each other (each is a distinct tensor, or one slice of
    one), so the routes of a file sorted by start are also sorted by end.
    """

    def __init__(self, plan: Plan, sink: Sink) -> None:
        if sink.backing is None:
            raise LoadError(
                "share_reads=True writes into slabs asyncslab allocated; these were given "
                "(tensors=): load them without share_reads"
            )
        index = {f.path: i for i, f in enumerate(plan.files)}
        per_file: dict[int, list[tuple[int, int, int, int, int]]] = {}
        route_base = sink.route_base
        self.empty = [i for i, r in enumerate(plan.routes) if not r.nbytes]
        for i, r in enumerate(plan.routes):
            if r.nbytes:
                per_file.setdefault(index[r.file], []).append(
                    (r.src_offset, r.src_offset + r.nbytes, i, route_base[i], r.dst_offset)
                )
        self.files = {f: sorted(v) for f, v in per_file.items()}
        self.starts = {f: [e[0] for e in v] for f, v in self.files.items()}
        # Hold the backing: it outlives a SlabSet closed meanwhile.
        self.backing = sink.backing
        self.cuda = sink.device.type == "cuda"
        self.cuda_device = sink.device if self.cuda else None

    def overlaps(self, seg: Segment) -> Iterable[tuple[int, int, int, int, int]]:
        """``(route, file offset, slab's offset in the backing, byte offset in the slab,
        nbytes)`` per overlap."""
        entries = self.files.get(seg.file)
        if not entries:
            return
        lo, hi = seg.offset, seg.offset + seg.nbytes
        i = max(bisect.bisect_right(self.starts[seg.file], lo) - 1, 0)
        while i < len(entries) and entries[i][0] < hi:
            start, end, route, slab, dst = entries[i]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                yield route, a, slab, dst + (a - start), b - a
            i += 1

"""Stage 3: turn a plan's routes into a few large positional reads.

Routes come sorted by file and offset. Neighbours whose gap is at most ``gap`` bytes merge
into one read of at most ``max_read`` bytes (the gap is read and discarded: one syscall
beats two when the gap is small). A tensor larger than ``max_read`` is split into chunks, so
staging buffers of a fixed size can carry any tensor. Pure: no I/O.

A mapped load (see ``_mapped``) reads nothing: it registers each read's pages with CUDA and
copies out of them. CUDA refuses a page that is registered already, so :func:`windows`
cuts its reads at fixed, page-aligned boundaries instead: no two reads share a page.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ..planning._plan import Plan
from ..planning._routes import route_column

__all__ = ["Piece", "ReadOp", "Schedule", "schedule", "windows"]


#: ``(route, read_offset, dst_offset, nbytes)``: bytes ``[read_offset, read_offset + nbytes)``
#: of a read belong at ``dst_offset`` of route ``route``'s slab (a whole tensor, or one chunk
#: of a large one). A plain tuple, not a dataclass: a plan of many small tensors makes one
#: per tensor, and a tuple is built in C where a dataclass instance runs ``__init__``.
Piece = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class ReadOp:
    """One positional read: ``nbytes`` at ``offset`` of ``plan.files[file]``."""

    file: int
    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """The reads of a load, interleaved across files so that concurrent workers read
    different files; ``empty`` lists zero-byte routes, which land without a read."""

    ops: tuple[ReadOp, ...]
    empty: tuple[int, ...]
    bytes_needed: int
    bytes_read: int


def schedule(plan: Plan, *, max_read: int, gap: int) -> Schedule:
    if max_read <= 0:
        raise ValueError(f"max_read must be positive, got {max_read}")
    routes = _Columns(plan)
    keep = list(map(bool, routes.nbytes))
    empty = list(itertools.compress(range(len(keep)), map(operator.not_, keep)))
    index = list(itertools.compress(range(len(keep)), keep))
    files, starts, sizes, dsts = (
        list(itertools.compress(column, keep))
        for column in (routes.files, routes.starts, routes.nbytes, routes.dsts)
    )
    ends = list(map(operator.add, starts, sizes))
    small = [size <= max_read for size in sizes]
    # Where a read may go on from the route before: same file, a gap of 0..gap bytes, and
    # neither of the two split into chunks. Decided a column at a time; the loop below
    # steps once per read, not once per route.
    gaps = list(map(operator.sub, starts[1:], ends[:-1]))
    joins = map(
        all,
        zip(
            map(operator.eq, files[1:], files),
            map(operator.le, itertools.repeat(0), gaps),
            map(operator.ge, itertools.repeat(gap), gaps),
            small[1:],
            small,
            strict=True,
        ),
    )
    n = len(index)
    cuts = [0, *itertools.compress(range(1, n), map(operator.not_, joins)), n] if n else [0]
    per_file: list[list[ReadOp]] = [[] for _ in plan.files]
    for a, b in itertools.pairwise(cuts):
        f = files[a]
        if not small[a]:  # a tensor larger than a read: chunks, each a read of its own
            r_start, nbytes, route, dst = starts[a], sizes[a], index[a], dsts[a]
            for chunk in range(0, nbytes, max_read):
                size = min(max_read, nbytes - chunk)
                per_file[f].append(
                    ReadOp(f, r_start + chunk, size, ((route, 0, dst + chunk, size),))
                )
            continue
        while a < b:
            # As many routes as fit in one read (ends only grow along a run of joins).
            start = starts[a]
            stop = bisect.bisect_right(ends, start + max_read, a, b)
            pieces = tuple(
                zip(
                    index[a:stop],
                    map(operator.sub, starts[a:stop], itertools.repeat(start)),
                    dsts[a:stop],
                    sizes[a:stop],
                    strict=True,
                )
            )
            per_file[f].append(ReadOp(f, start, ends[stop - 1] - start, pieces))
            a = stop
    return _assemble(per_file, empty, sum(sizes))


class _Columns:
    """A plan's routes as the scheduler reads them: file numbers (in ``plan.files``), file
    offsets, sizes and slab offsets, a list each."""

    def __init__(self, plan: Plan) -> None:
        file_index = {f.path: i for i, f in enumerate(plan.files)}
        routes = plan.routes
        self.files = list(map(file_index.__getitem__, route_column(routes, "file")))
        self.starts = route_column(routes, "src_offset")
        self.nbytes = route_column(routes, "nbytes")
        self.dsts = route_column(routes, "dst_offset")


def windows(plan: Plan, *, window: int) -> Schedule:
    """The reads of a mapped load: each file's tensor bytes cut at every multiple of
    ``window`` (a file offset), one read per window that holds any, from its first byte
    needed to its last (gaps between tensors inside a window are spanned, not copied).

    With ``window`` a multiple of the page size, the pages under two reads never overlap,
    whatever order the routes come in, so each read's pages can be registered and released
    on their own."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    # (file, window) -> [(file offset, route, dst_offset, nbytes)]: routes may come in any
    # order (a rule can take rows of a tensor for several slabs), and a window must still
    # become a single read.
    found: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    empty: list[int] = []
    needed = 0
    routes = _Columns(plan)
    for index, (f, at, nbytes, dst) in enumerate(
        zip(routes.files, routes.starts, routes.nbytes, routes.dsts, strict=True)
    ):
        if nbytes == 0:
            empty.append(index)
            continue
        needed += nbytes
        end = at + nbytes
        while at < end:
            k = at // window
            cut = min(end, (k + 1) * window)
            found.setdefault((f, k), []).append((at, index, dst, cut - at))
            dst += cut - at
            at = cut
    per_file: list[list[ReadOp]] = [[] for _ in plan.files]
    for (f, _), parts in sorted(found.items()):
        start = min(p[0] for p in parts)
        stop = max(p[0] + p[3] for p in parts)
        pieces = tuple((route, at - start, dst, n) for at, route, dst, n in sorted(parts))
        per_file[f].append(ReadOp(f, start, stop - start, pieces))
    return _assemble(per_file, empty, needed)


def _assemble(per_file: Sequence[Sequence[ReadOp]], empty: list[int], needed: int) -> Schedule:
    ops = _interleave(per_file)
    return Schedule(
        ops=ops,
        empty=tuple(empty),
        bytes_needed=needed,
        bytes_read=sum(op.nbytes for op in ops),
    )


def _interleave(per_file: Sequence[Sequence[ReadOp]]) -> tuple[ReadOp, ...]:
    # Round-robin over files: workers taking ops in order spread over files (several files
    # in flight), while each file is still read front to back.
    out: list[ReadOp] = []
    longest = max((len(ops) for ops in per_file), default=0)
    for i in range(longest):
        for ops in per_file:
            if i < len(ops):
                out.append(ops[i])
    return tuple(out)

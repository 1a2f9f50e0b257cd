"""Loading, the schedule: turn a plan's routes into a few large positional reads.

Routes come sorted by file and offset. Neighbours whose gap is at most ``gap`` bytes merge
into one read of at most ``max_read`` bytes (the gap is read and discarded: one syscall
beats two when the gap is small). A tensor larger than ``max_read`` is split into chunks, so
staging buffers of a fixed size can carry any tensor. With ``fill``, a run of neighbours is
cut at exactly ``max_read`` bytes instead, the tensor across the cut split between two
reads: every read but a run's last has one size (what an object store's responses want, see
``_strategy_remote``). Pure: no I/O.

A mapped load (see ``_strategy_mapped``) reads nothing: it registers each read's pages with CUDA and
copies out of them. CUDA refuses a page that is registered already, so :func:`windows`
cuts its reads at fixed, page-aligned boundaries instead: no two reads share a page.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..planning import Plan, RouteTable, route_column

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


def schedule(plan: Plan, *, max_read: int, gap: int, fill: bool = False) -> Schedule:
    if max_read <= 0:
        raise ValueError(f"max_read must be positive, got {max_read}")
    per_file: list[list[ReadOp]] = [[] for _ in plan.files]
    empty: list[int] = []
    needed = 0

    start = end = 0
    pieces: list[Piece] = []
    current = -1
    for index, f, at, nbytes, dst in _Columns(plan).sized(empty):
        needed += nbytes
        if pieces and f == current and 0 <= at - end <= gap and at + nbytes - start <= max_read:
            pieces.append((index, at - start, dst, nbytes))  # most routes: joins whole
            end = at + nbytes
            continue
        chunked = nbytes > max_read
        while nbytes:
            room = start + max_read - at
            # A neighbour joins the open read whole, or with ``fill`` as much as fits.
            if pieces and f == current and 0 <= at - end <= gap and (nbytes <= room or fill):
                take = min(nbytes, room)
                if take > 0:
                    pieces.append((index, at - start, dst, take))
                    end = at + take
                    at, dst, nbytes = end, dst + take, nbytes - take
                    continue
            if pieces:
                per_file[current].append(ReadOp(current, start, end - start, tuple(pieces)))
            current, start = f, at
            take = min(nbytes, max_read)
            pieces = [(index, 0, dst, take)]
            end = at + take
            at, dst, nbytes = end, dst + take, nbytes - take
        if chunked and not fill:  # a large tensor's chunks are reads of their own
            per_file[current].append(ReadOp(current, start, end - start, tuple(pieces)))
            pieces = []
    if pieces:
        per_file[current].append(ReadOp(current, start, end - start, tuple(pieces)))
    return _assemble(per_file, empty, needed)


class _Columns:
    """A plan's routes as the scheduler reads them: file numbers (in ``plan.files``), file
    offsets, sizes and slab offsets, a list each."""

    def __init__(self, plan: Plan) -> None:
        routes = plan.routes
        paths = [f.path for f in plan.files]
        if isinstance(routes, RouteTable) and list(routes.tensors.paths) == paths:
            self.files = routes.files()  # numbered in the same order already
        else:
            file_index = {path: i for i, path in enumerate(paths)}
            self.files = list(map(file_index.__getitem__, route_column(routes, "file")))
        self.starts = route_column(routes, "src_offset")
        self.nbytes = route_column(routes, "nbytes")
        self.dsts = route_column(routes, "dst_offset")

    def sized(self, empty: list[int]) -> Iterator[tuple[int, int, int, int, int]]:
        """``(route, file, offset, nbytes, dst_offset)`` of each route with bytes; the
        numbers of those without go to ``empty``."""
        columns = zip(self.files, self.starts, self.nbytes, self.dsts, strict=True)
        for index, (f, at, nbytes, dst) in enumerate(columns):
            if nbytes:
                yield index, f, at, nbytes, dst
            else:
                empty.append(index)


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
    for index, f, at, nbytes, dst in _Columns(plan).sized(empty):
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

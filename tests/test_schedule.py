"""The read schedule: a plan's routes as a few large positional reads.

Whatever the sizes, gaps and limits, every routed byte is read exactly once and lands at its
slot's offset; no read exceeds ``max_read``; a discarded gap never exceeds ``gap``; each
file is read front to back. The windows of a mapped load read every byte once as well, one
read per window.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncslab import Checkpoint, Plan, plan
from asyncslab._schedule import Schedule, schedule, windows


def checkpoint_of(directory: Path, files: list[list[int]]) -> Checkpoint:
    """One U8 tensor per size, ``f{i}.t{j}``; payloads are zeros (only offsets matter)."""
    weight_map = {}
    for i, sizes in enumerate(files):
        header: dict[str, object] = {}
        position = 0
        for j, size in enumerate(sizes):
            header[f"f{i}.t{j}"] = {
                "dtype": "U8",
                "shape": [size],
                "data_offsets": [position, position + size],
            }
            position += size
        blob = json.dumps(header).encode()
        name = f"f{i}.safetensors"
        (directory / name).write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(position))
        weight_map.update(dict.fromkeys(header, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return Checkpoint.open(directory)


def check(p: Plan, s: Schedule, max_read: int, gap: int) -> None:
    landed: dict[int, list[tuple[int, int]]] = defaultdict(list)
    last_offset: dict[int, int] = {}
    for op in s.ops:
        assert 0 < op.nbytes <= max_read
        assert op.offset >= last_offset.get(op.file, -1)  # front to back
        last_offset[op.file] = op.offset
        assert op.pieces[0][1] == 0
        end = 0
        for i, (route, read_offset, dst_offset, nbytes) in enumerate(op.pieces):
            r = p.routes[route]
            assert p.files[op.file].path == r.file
            if i:
                assert 0 <= read_offset - end <= gap
            end = read_offset + nbytes
            # The bytes read here are the route's bytes that belong at dst_offset.
            assert op.offset + read_offset - r.src_offset == dst_offset - r.dst_offset
            landed[route].append((dst_offset, nbytes))
        assert end == op.nbytes
    for index, r in enumerate(p.routes):
        if r.nbytes == 0:
            assert index in s.empty
            assert index not in landed
            continue
        position = r.dst_offset
        for dst_offset, nbytes in sorted(landed[index]):
            assert dst_offset == position
            position += nbytes
        assert position == r.dst_offset + r.nbytes
    assert s.bytes_needed == sum(r.nbytes for r in p.routes)
    assert s.bytes_read == sum(op.nbytes for op in s.ops) >= s.bytes_needed


@settings(max_examples=60, deadline=None, database=None)
@given(
    files=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=3),
    max_read=st.integers(1, 64),
    gap=st.integers(0, 16),
    drop=st.sets(st.integers(0, 40), max_size=8),
)
def test_property_schedule_reads_every_byte_once(
    files: list[list[int]], max_read: int, gap: int, drop: set[int]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        ck = checkpoint_of(Path(d), files)
        # Leave some tensors out of the plan, so that reads must skip or read through gaps.
        ignored = [name for k, name in enumerate(ck.tensors) if k in drop]
        p = plan(ck, ignore=ignored) if ignored else plan(ck)
        check(p, schedule(p, max_read=max_read, gap=gap), max_read, gap)


def test_neighbours_coalesce_and_large_tensors_split(tmp_path: Path) -> None:
    ck = checkpoint_of(tmp_path, [[4, 4, 4, 20]])
    p = plan(ck)
    s = schedule(p, max_read=12, gap=0)
    assert [(op.offset - ck.files[0].data_start, op.nbytes) for op in s.ops] == [
        (0, 12),  # three 4-byte tensors, one read
        (12, 12),  # the 20-byte tensor, in chunks of at most 12
        (24, 8),
    ]
    check(p, s, 12, 0)


# --- windows: the reads of a mapped load ---------------------------------------------------------


def check_windows(p: Plan, s: Schedule, window: int) -> None:
    """Every byte once (as for any schedule), and each read inside one window of its file,
    one read per window: reads never share a page when ``window`` is a multiple of it."""
    check(p, s, window, window)
    seen: set[tuple[int, int]] = set()
    for op in s.ops:
        first, last = op.offset // window, (op.offset + op.nbytes - 1) // window
        assert first == last, (op.offset, op.nbytes)
        assert (op.file, first) not in seen
        seen.add((op.file, first))


@settings(max_examples=60, deadline=None, database=None)
@given(
    files=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=3),
    window=st.integers(1, 64),
    drop=st.sets(st.integers(0, 40), max_size=8),
)
def test_property_windows_read_every_byte_once_one_read_per_window(
    files: list[list[int]], window: int, drop: set[int]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        ck = checkpoint_of(Path(d), files)
        ignored = [name for k, name in enumerate(ck.tensors) if k in drop]
        p = plan(ck, ignore=ignored) if ignored else plan(ck)
        check_windows(p, windows(p, window=window), window)


def test_windows_cut_tensors_at_window_boundaries(tmp_path: Path) -> None:
    ck = checkpoint_of(tmp_path, [[6, 4, 30]])
    p = plan(ck)
    start = ck.files[0].data_start
    s = windows(p, window=16)
    cuts = [(op.offset, op.nbytes, [(piece[1], piece[3]) for piece in op.pieces]) for op in s.ops]
    # Windows are file offsets: the first one ends wherever 16 divides the offset.
    first_end = (start // 16 + 1) * 16
    assert cuts[0][0] == start
    assert cuts[0][0] + cuts[0][1] == first_end
    assert all(op.offset % 16 == 0 for op in s.ops[1:])
    assert sum(op.nbytes for op in s.ops) == 40  # no gaps: every byte is a tensor's
    check_windows(p, s, 16)


def test_windows_take_routes_in_any_order(tmp_path: Path) -> None:
    # A rule may emit routes out of file order; a window must still be one read.
    ck = checkpoint_of(tmp_path, [[5, 7, 9, 11, 3], [8, 8]])
    p = plan(ck)
    order = [4, 0, 6, 2, 5, 1, 3]
    shuffled = SimpleNamespace(files=p.files, routes=[p.routes[i] for i in order])
    s = windows(shuffled, window=8)  # type: ignore[arg-type]
    check_windows(shuffled, s, 8)  # type: ignore[arg-type]

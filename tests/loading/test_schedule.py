"""The read schedule: a plan's routes as a few large positional reads.

Whatever the sizes, gaps and limits, every routed byte is read exactly once and lands at its
slot's offset; no read exceeds ``max_read``; a discarded gap never exceeds ``gap``; each
file is read front to back. The windows of a mapped load read every byte once as well, one
read per window.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from asyncslab import Checkpoint, LoadOptions, Plan, load, plan
from asyncslab.loading._schedule import Schedule, schedule, windows
from support.faults import raw_bytes
from tests.helpers import assert_bit_identical


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
@pytest.mark.parametrize("fill", [False, True])
def test_property_schedule_reads_every_byte_once(
    files: list[list[int]], max_read: int, gap: int, drop: set[int], fill: bool
) -> None:
    """Filled (an object store's reads), each run is also cut at exactly ``max_read``."""
    with tempfile.TemporaryDirectory() as d:
        ck = checkpoint_of(Path(d), files)
        # Leave some tensors out of the plan, so that reads must skip or read through gaps.
        ignored = [name for k, name in enumerate(ck.tensors) if k in drop]
        p = plan(ck, ignore=ignored) if ignored else plan(ck)
        s = schedule(p, max_read=max_read, gap=gap, fill=fill)
        (check_filled if fill else check)(p, s, max_read, gap)


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


# --- filled reads: the GETs of a load from object storage ----------------------------------------


def check_filled(p: Plan, s: Schedule, max_read: int, gap: int) -> None:
    """Every byte once (as for any schedule), and a read shorter than ``max_read`` ends its
    run: the next read of its file could not have continued it (beyond ``gap``, at or past
    the cut, or overlapping it)."""
    check(p, s, max_read, gap)
    by_file: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for op in s.ops:
        by_file[op.file].append((op.offset, op.nbytes))
    for reads in by_file.values():
        for (offset, nbytes), (following, _) in zip(reads, reads[1:], strict=False):
            if nbytes < max_read:
                after = following - (offset + nbytes)
                assert after > gap or after < 0 or following >= offset + max_read


def test_filled_reads_split_the_tensor_across_the_cut(tmp_path: Path) -> None:
    ck = checkpoint_of(tmp_path, [[4, 4, 4, 20]])
    p = plan(ck)
    s = schedule(p, max_read=10, gap=0, fill=True)
    start = ck.files[0].data_start
    cuts = [(op.offset - start, op.nbytes, [(r, n) for r, _, _, n in op.pieces]) for op in s.ops]
    assert cuts == [
        (0, 10, [(0, 4), (1, 4), (2, 2)]),  # the third tensor's first 2 bytes
        (10, 10, [(2, 2), (3, 8)]),  # its last 2, and the 20-byte one's first 8
        (20, 10, [(3, 10)]),
        (30, 2, [(3, 2)]),  # the run's last read: short
    ]
    check_filled(p, s, 10, 0)
    overlapped, _ = overlapping(tmp_path / "overlapping")
    for gap in (0, 64):
        check_filled(
            overlapped, schedule(overlapped, max_read=1 << 20, gap=gap, fill=True), 1 << 20, gap
        )


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


# --- reads never span two files, never run backwards; limits are checked -------------------------


def two_shards(directory: Path) -> Checkpoint:
    """Shard ``a`` holds one 4-byte tensor; shard ``b``'s longer header puts its first tensor
    at a file offset just past ``a``'s last byte: offsets are per file, so by offset alone
    ``b``'s tensors look like ``a``'s neighbours."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = {
        "a.safetensors": {"a": torch.tensor([1.5])},
        "b.safetensors": {
            "b.first_tensor_of_the_second_shard": torch.arange(6.0),
            "b.second_tensor_of_the_second_shard": torch.arange(8, dtype=torch.int16) - 3,
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return Checkpoint.open(directory)


@pytest.mark.asyncio
async def test_reads_never_run_from_one_shard_into_the_next(tmp_path: Path) -> None:
    """Reads coalesce within a file only: merged across files, shard ``b``'s tensors would be
    read from shard ``a``'s descriptor (past its end, or wrong bytes)."""
    ck = two_shards(tmp_path / "ck")
    p = plan(ck)
    a, b = p.route("a"), p.route("b.first_tensor_of_the_second_shard")
    gap = LoadOptions().coalesce_gap
    # The situation guarded against: b's first tensor lies within ``gap`` after a's last byte.
    assert a.file != b.file
    assert 0 <= b.src_offset - (a.src_offset + a.nbytes) <= gap
    s = schedule(p, max_read=LoadOptions().read_size, gap=gap)
    check(p, s, LoadOptions().read_size, gap)  # every piece of a read is of the read's file
    assert len(s.ops) == 2
    for transfer in ("direct", "staged"):
        async with await load(ck, p, options=LoadOptions(transfer=transfer)) as slabs:
            assert assert_bit_identical(slabs, ck) == 3


def overlapping(directory: Path) -> tuple[Plan, torch.Tensor]:
    """A plan whose two routes overlap in the file: slab ``top`` takes rows 0-3 of ``w``,
    slab ``bottom`` rows 2-5 (its route's bytes moved onto ``w``'s). plan() never makes such
    routes, but a Plan is plain data, and schedule() and load() take it as given."""
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": w, "v": torch.zeros(4, 4)}, str(directory / "m.safetensors"))
    ck = Checkpoint.open(directory)
    p = plan(ck)
    top, bottom = p.route("w"), p.route("v")
    row = w[0].nbytes
    # Whole w into "top" would not fit its slot: rows 0-3 of it, rows 2-5 into "bottom".
    top = dataclasses.replace(top, nbytes=4 * row, shape=(4, 4))
    bottom = dataclasses.replace(bottom, src_offset=top.src_offset + 2 * row, shape=(4, 4))
    slabs = {
        "w": dataclasses.replace(p.slabs["w"], item_shape=(4, 4)),
        "v": p.slabs["v"],
    }
    routes = tuple(sorted((top, bottom), key=lambda r: r.src_offset))
    index = {r.tensor: i for i, r in enumerate(routes)}
    return dataclasses.replace(p, slabs=slabs, routes=routes, _index=index), w


def test_routes_overlapping_in_the_file_are_read_separately(tmp_path: Path) -> None:
    """Two routes sharing bytes of the file are two reads (or one read per route), never one
    read whose second piece starts before the first one ends: read front to back into its
    pieces, that read would put the wrong bytes in the second slot, or none at all."""
    p, _ = overlapping(tmp_path / "ck")
    first, second = p.routes
    assert second.src_offset < first.src_offset + first.nbytes  # the routes overlap
    for gap in (0, 64):
        s = schedule(p, max_read=1 << 20, gap=gap)
        check(p, s, 1 << 20, gap)


@pytest.mark.asyncio
@pytest.mark.parametrize("transfer", ["direct", "staged"])
async def test_routes_overlapping_in_the_file_load_their_own_bytes(
    tmp_path: Path, transfer: str
) -> None:
    """Each of two overlapping routes lands its own rows: rows 0-3 of ``w`` in one slab,
    rows 2-5 in the other (a shared read would fail, or shift the second slab's bytes)."""
    p, w = overlapping(tmp_path / "ck")
    ck = Checkpoint.open(tmp_path / "ck")
    options = LoadOptions(transfer=transfer)  # type: ignore[arg-type]
    async with await load(ck, p, options=options) as slabs:
        assert torch.equal(raw_bytes(slabs.view("w")), raw_bytes(w[0:4]))
        assert torch.equal(raw_bytes(slabs.view("v")), raw_bytes(w[2:6]))


def test_a_read_size_of_zero_is_refused(tmp_path: Path) -> None:
    """``max_read`` 0 (or less) is refused by name, not left to fail as range()'s "arg 3 must
    not be zero" (or to loop) on the first tensor it would split."""
    p = plan(checkpoint_of(tmp_path, [[4, 8]]))
    for max_read in (0, -1):
        with pytest.raises(ValueError, match=rf"^max_read must be positive, got {max_read}$"):
            schedule(p, max_read=max_read, gap=0)
    assert schedule(p, max_read=1, gap=0).bytes_read == 12

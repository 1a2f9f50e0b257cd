"""The read primitive under every load: :class:`Scatter` (a read's destinations as a
ready-made iovec array, cut into syscalls), :func:`pread_scatter` (libc's ``preadv``, short
reads resumed, errors named) and :class:`ReadFeed` (I/O threads taking reads themselves,
the loop watching for stalls)."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab.errors import ReadError
from asyncslab.loading import _read as read_module
from asyncslab.loading._read import ReadFeed, pread_scatter, scatter
from asyncslab.testing import SyntheticCheckpoint
from support.faults import HANG_S


def regions_in(
    buffer: torch.Tensor, sizes: Sequence[int], scratch_every: int = 0
) -> list[tuple[int, int]]:
    """Consecutive ranges of ``buffer`` of ``sizes`` bytes; with ``scratch_every``, every
    such region is followed by a 3-byte one at the buffer's start (a gap's scratch)."""
    out = []
    at = 16
    for i, n in enumerate(sizes):
        out.append((buffer.data_ptr() + at, n))
        at += n
        if scratch_every and i % scratch_every == 0:
            out.append((buffer.data_ptr(), 3))
    return out


def expected_after(data: bytes, offset: int, sizes: Sequence[int], scratch_every: int) -> bytes:
    """What ``regions_in``'s slots hold after the read (scratch bytes skipped)."""
    out = bytearray()
    at = offset
    for i, n in enumerate(sizes):
        out += data[at : at + n]
        at += n
        if scratch_every and i % scratch_every == 0:
            at += 3
    return bytes(out)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(7).randbytes(64 << 10)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def read_into(
    path: Path, sizes: Sequence[int], offset: int, scratch_every: int = 0, limit: int | None = None
) -> bytes:
    buffer = torch.zeros(16 + sum(sizes) + 8, dtype=torch.uint8)
    target = scatter(regions_in(buffer, sizes, scratch_every), limit=limit)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = pread_scatter(fd, target, offset, path=str(path))
    finally:
        os.close(fd)
    gaps = len(range(0, len(sizes), scratch_every)) if scratch_every else 0
    assert n == target.nbytes == sum(sizes) + 3 * gaps
    return bytes(buffer[16 : 16 + sum(sizes)].tolist())


def test_libc_preadv_is_the_path_on_linux() -> None:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("libc's preadv is used on 64-bit Linux and macOS only")
    assert read_module._preadv_raw is not read_module._preadv_via_os


@pytest.mark.parametrize("raw", ["libc", "os.preadv"])
def test_scatter_read_lands_every_region(
    data_file: tuple[Path, bytes], raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw == "os.preadv":
        monkeypatch.setattr(read_module, "_preadv_raw", read_module._preadv_via_os)
    path, data = data_file
    sizes = [5, 0, 1, 4096, 17, 3000, 1]
    got = read_into(path, sizes, 100, scratch_every=2)
    assert got == expected_after(data, 100, sizes, 2)


def test_calls_respect_syscall_size_and_iov_limit() -> None:
    buffer = torch.zeros(20_000, dtype=torch.uint8)
    # 2,500 one-byte regions, then one region crossing several syscall boundaries.
    regions = [(buffer.data_ptr() + i, 1) for i in range(2500)] + [(buffer.data_ptr(), 4321)]
    target = scatter(regions, limit=1000)
    assert target.nbytes == 2500 + 4321
    assert sum(n for _, _, n in target.calls) == target.nbytes
    assert all(0 < n <= 1000 for _, _, n in target.calls)
    assert all(0 < entries <= read_module._IOV_MAX for _, entries, _ in target.calls)
    # Calls tile the iovec array in order, and their lengths add up.
    first = 0
    for start, entries, nbytes in target.calls:
        assert start == first
        lengths = target.iov[2 * start + 1 : 2 * (start + entries) : 2]
        assert sum(lengths) == nbytes
        first += entries
    assert 2 * first == len(target.iov)
    # Without a limit, SYSCALL_BYTES is the limit.
    wide = torch.zeros(read_module.SYSCALL_BYTES + 1, dtype=torch.uint8)
    assert [n for _, _, n in scatter([(wide.data_ptr(), wide.numel())]).calls] == [
        read_module.SYSCALL_BYTES,
        1,
    ]


def test_a_read_of_nothing_needs_no_syscall() -> None:
    target = scatter([(1234, 0)])
    assert target.calls == ()
    assert target.nbytes == 0
    assert pread_scatter(-1, target, 0, path="none") == 0


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    sizes=st.lists(st.integers(0, 64), min_size=1, max_size=40)
    | st.integers(1000, 1300).map(lambda n: [1 + (i * 7) % 3 for i in range(n)]),  # > IOV_MAX
    offset=st.integers(0, 50),
    cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20),
    syscall_bytes=st.integers(1, 100),
    scratch_every=st.integers(0, 3),
)
def test_property_short_reads_resume_exactly(
    sizes: list[int],
    offset: int,
    cuts: list[float],
    syscall_bytes: int,
    scratch_every: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Whatever short counts the syscall returns, every region ends up with its bytes, and
    no call asks for more than its byte limit or ``IOV_MAX`` entries."""
    path = tmp_path_factory.getbasetemp() / "scatter.bin"
    data = random.Random(len(sizes)).randbytes(offset + 4 * sum(sizes) + 4000)
    path.write_bytes(data)
    calls = iter(cuts * (sum(sizes) * 4 + 4000))
    real = read_module._preadv_via_os

    def partial(fd: int, iov: int, entries: int, at: int) -> int:
        pairs = (ctypes.c_size_t * (2 * entries)).from_address(iov)
        want = sum(pairs[1::2])
        assert 0 < want <= syscall_bytes
        assert entries <= read_module._IOV_MAX
        # Ask for a prefix only: trim the entry list to the cut (at least one byte).
        limit = max(1, round(next(calls) * want))
        kept = []
        for i in range(entries):
            if limit <= 0:
                break
            n = min(pairs[2 * i + 1], limit)
            kept += [pairs[2 * i], n]
            limit -= n
        trimmed = (ctypes.c_size_t * len(kept))(*kept)
        return real(fd, ctypes.addressof(trimmed), len(kept) // 2, at)

    saved = read_module._preadv_raw
    read_module._preadv_raw = partial
    try:
        got = read_into(path, sizes, offset, scratch_every, limit=syscall_bytes)
    finally:
        read_module._preadv_raw = saved
    assert got == expected_after(data, offset, sizes, scratch_every)


def test_file_ending_early_is_a_read_error(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with pytest.raises(ReadError, match="ended early: got 96 of 200 bytes") as info:
        read_into(path, [100, 100], len(data) - 96)
    assert info.value.file == str(path)
    assert info.value.details["offset"] == len(data) - 96


def test_failing_syscall_is_a_read_error_with_its_cause(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: preadv fails with EISDIR
    buffer = torch.zeros(8, dtype=torch.uint8)
    try:
        with pytest.raises(ReadError, match="read of 8 bytes at offset 0 failed") as info:
            pread_scatter(fd, scatter([(buffer.data_ptr(), 8)]), 0, path=str(tmp_path))
    finally:
        os.close(fd)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EISDIR


def test_interrupted_syscall_is_retried_and_errno_raised() -> None:
    calls: list[int] = []

    def fake(fd: int, iov: int, entries: int, at: int) -> int:
        calls.append(fd)
        if len(calls) == 1:
            ctypes.set_errno(errno.EINTR)
            return -1
        if fd == 2:
            ctypes.set_errno(errno.EIO)
            return -1
        return 42

    preadv = read_module._raising(fake)
    assert preadv(1, 0, 1, 0) == 42
    assert calls == [1, 1]
    with pytest.raises(OSError, match=os.strerror(errno.EIO)) as info:
        preadv(2, 0, 1, 0)
    assert info.value.errno == errno.EIO


# --- ReadFeed ---------------------------------------------------------------------------


def test_feed_hands_each_read_out_once_across_threads() -> None:
    feed = ReadFeed([1] * 5000, 4)
    taken: list[list[int]] = [[] for _ in range(4)]

    def drive(worker: int) -> None:
        while (index := feed.take(worker)) is not None:
            taken[worker].append(index)
            feed.finished(worker)

    threads = [threading.Thread(target=drive, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for mine in taken for i in mine) == list(range(5000))
    assert all(mine == sorted(mine) for mine in taken)  # each thread moves forward
    assert feed.oldest() is None


def test_feed_tracks_reads_in_flight_and_stops() -> None:
    feed = ReadFeed([10, 20, 30], 2)
    assert feed.take(0) == 0
    assert feed.take(1) == 1
    first, second = feed._since
    assert first is not None
    assert second is not None
    assert feed.oldest() == min(first, second)
    feed.finished(0)
    assert feed.oldest() == second
    feed.stop()
    assert feed.stopped
    assert feed.take(0) is None  # a read was left, but the feed stopped


def test_stop_interrupts_a_paced_wait() -> None:
    # 1 byte/s: the read of 10,000 bytes is due in hours, so take() waits...
    feed = ReadFeed([10_000], 1, max_bytes_per_s=1.0)
    result: list[int | None] = []
    worker = threading.Thread(target=lambda: result.append(feed.take(0)))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive()
    feed.stop()  # ...until the load stops: then no read, at once
    worker.join(HANG_S)
    assert not worker.is_alive()
    assert result == [None]


# --- the loop's watch over reads taking the next one themselves ---------------------------


@pytest.mark.asyncio
async def test_timeout_names_the_stalled_read_while_others_finished(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(read_size=64 << 10, read_timeout=1.0, io_workers=2)
    from asyncslab.loading import _copy
    from asyncslab.loading._schedule import schedule

    ops = schedule(p, max_read=options.read_size, gap=options.coalesce_gap).ops
    victim = ops[len(ops) // 2]
    release = threading.Event()
    real: Callable[..., int] = _copy.pread_scatter
    done: list[int] = []

    # The watch's clock stands still until the victim stalls, so no read but the victim is
    # ever late, however slow this machine is.
    now = [0.0]

    def stall_one(fd: int, target: read_module.Scatter, offset: int, *, path: str) -> int:
        if offset == victim.offset and path == str(p.files[victim.file].path):
            # Stall only once the other thread has gone on past this read: that it did is
            # then a fact of the run, not a race between it and the timeout.
            deadline = time.monotonic() + HANG_S
            while len(done) <= len(ops) // 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            # Time passes now, all at once. Every read started so far has the same stamp;
            # the other thread's read in flight was taken after the victim (one cursor for
            # every thread), so the oldest of those stamped alike is the victim.
            now[0] = 100.0
            release.wait(HANG_S)
        n = real(fd, target, offset, path=path)
        done.append(offset)
        return n

    monkeypatch.setattr(_copy, "pread_scatter", stall_one)
    slabs = SlabSet(p, clock=lambda: now[0])
    try:
        with pytest.raises(asyncslab.errors.ReadTimeoutError, match="read_timeout=1.0") as info:
            await slabs.load(ckpt, options=options)
        assert info.value.file == str(p.files[victim.file].path)
        assert info.value.details["offset"] == victim.offset
        assert len(done) > len(ops) // 2  # the other thread went on meanwhile
    finally:
        release.set()
        await slabs.aclose()


@pytest.mark.asyncio
async def test_slow_but_steady_reads_do_not_time_out(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the watch's clock each read takes 20 ms, one at a time, and the load far longer
    # than read_timeout: only a single read over the limit is a timeout, not the sum of them.
    from asyncslab.loading import _copy

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    limit = 1.0
    now = [0.0]  # moves only inside reads, so a busy machine cannot make a read late
    loop_thread = threading.current_thread()
    watched = threading.Event()  # the watch looked, with the load already long past limit

    def clock() -> float:
        if threading.current_thread() is loop_thread and now[0] > 2 * limit:
            watched.set()
        return now[0]

    real: Callable[..., int] = _copy.pread_scatter

    def steady(fd: int, target: read_module.Scatter, offset: int, *, path: str) -> int:
        now[0] += 0.02
        if now[0] > 2 * limit:
            watched.wait(HANG_S)  # a read in flight while the watch looks
        return real(fd, target, offset, path=path)

    monkeypatch.setattr(_copy, "pread_scatter", steady)
    options = LoadOptions(read_size=16 << 10, read_timeout=limit, io_workers=1)
    slabs = await asyncslab.load(ckpt, p, options=options, into=SlabSet(p, clock=clock))
    stats = slabs.statistics()
    assert stats.state == "complete"
    assert watched.is_set()
    assert now[0] == pytest.approx(stats.reads * 0.02)
    assert now[0] > 2 * limit
    await slabs.aclose()


@pytest.mark.asyncio
async def test_io_threads_give_up_the_core_after_every_read(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two reads an I/O thread yields its core, so that a waking event loop does not
    wait for one while every core is busy reading."""
    from asyncslab.loading import _read_pass

    yields: list[str] = []

    def record() -> None:
        yields.append(threading.current_thread().name)

    monkeypatch.setattr(_read_pass, "_yield", record)
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = await asyncslab.load(ckpt, plan(ckpt), options=LoadOptions(read_size=32 << 10))
    assert len(yields) == slabs.statistics().reads > 1
    assert all(name.startswith("asyncslab-io") for name in yields)  # never the loop thread
    await slabs.aclose()

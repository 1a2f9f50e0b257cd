"""Faults injected *during* a load, cancellation at random points, concurrent loads, leaks.

``test_load.py`` covers the single cases (one EIO + retry, truncation or rewrite after
planning, a stalled read, one mid-load cancel, duplicate landing); this file injects faults
at random points through the real read path (``os.preadv`` as ``asyncslab.loading._read`` sees it,
which then carries every read: see ``fake_os``),
between the loader's stat check and its reads, and cancels loads at seeded random points,
checking after each that no thread still writes, no fd leaked, units are all-or-nothing,
and the next load is bit-exact.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncslab
from asyncslab import (
    Checkpoint,
    IncompleteLoadError,
    LoadOptions,
    SlabSet,
    load,
    plan,
)
from asyncslab.errors import ReadError
from asyncslab.loading import _load
from asyncslab.loading import _read as read_module
from asyncslab.loading import _strategy_staged as _staged
from asyncslab.loading._read import pread_scatter, scatter
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, write_synthetic
from support.faults import (
    CANCEL_MODES,
    HANG_S,
    PATHS,
    SMALL,
    cancel_somewhere,
    expected_bytes,
)
from tests.helpers import (
    assert_bit_exact,
    assert_units_all_or_nothing,
    open_fds,
    released,
    wait_io_threads_gone,
)

CANCEL_CYCLES = int(os.environ.get("ASYNCSLAB_CANCEL_CYCLES", "50"))
# Loop turns each paced read waits for (see test_cancel_at_random_points_leaks_nothing).
READ_TURNS = 60


# --- fixtures and helpers ----------------------------------------------------------------


@pytest.fixture
def fresh_small(tmp_path: Path) -> SyntheticCheckpoint:
    """A small checkpoint the test may damage."""
    spec = SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32, vocab=128)
    return write_synthetic(tmp_path / "ckpt", spec)


class FakeOs:
    """Stands in for ``os`` inside ``asyncslab.loading._read``: ``preadv`` goes through ``hook``;
    counts calls and reads in flight (so a test can assert none is left writing)."""

    def __init__(self, hook: Callable[[int, Sequence[memoryview], int], int] | None = None):
        self.hook = hook or os.preadv
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified as in_flight changes
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.started_after_error = 0
        self.error_at: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with self.lock:
            self.calls += 1
            self.in_flight += 1
            self.changed.notify_all()
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.error_at is not None:
                self.started_after_error += 1
        try:
            return self.hook(fd, buffers, offset)
        except OSError:
            with self.lock:
                if self.error_at is None:
                    self.error_at = time.monotonic()
            raise
        finally:
            with self.lock:
                self.in_flight -= 1
                self.changed.notify_all()


@pytest.fixture
def fake_os(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeOs]]:
    def install(hook: Callable[[int, Sequence[memoryview], int], int] | None = None) -> FakeOs:
        fake = FakeOs(hook)
        monkeypatch.setattr(read_module, "os", fake)
        # Loads read through libc's preadv; its os.preadv twin hands the hook the same
        # destinations (one memoryview per iovec entry) and the same offsets.
        monkeypatch.setattr(read_module, "_preadv_raw", read_module._preadv_via_os)
        return fake

    return install


def path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def trimmed(buffers: Sequence[memoryview], limit: int) -> list[memoryview]:
    """The first ``limit`` bytes of ``buffers`` (a short read asks for no more)."""
    out = []
    for b in buffers:
        if limit <= 0:
            break
        out.append(b[:limit])
        limit -= len(out[-1])
    return out


# --- a file changes between the loader's stat check and its reads ------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep", ["nothing", "header", "half", "all-but-one"])
async def test_truncated_between_stat_check_and_read(
    fresh_small: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch, keep: str
) -> None:
    ckpt = Checkpoint.open(fresh_small.root)
    expected_bytes(ckpt)  # before the damage
    p = plan(ckpt)
    victim = ckpt.files[1]
    size = {
        "nothing": 0,
        "header": victim.data_start,
        "half": (victim.data_start + victim.size) // 2,
        "all-but-one": victim.size - 1,
    }[keep]
    original = _load.open_checked

    def open_then_truncate(path: os.PathLike[str], *args: Any, **kwargs: Any) -> int:
        fd = original(path, *args, **kwargs)  # the size/inode/mtime check passed
        if Path(path) == victim.path:
            os.truncate(path, size)
        return fd

    monkeypatch.setattr(_load, "open_checked", open_then_truncate)
    fds = open_fds()
    slabs = SlabSet(p)
    with pytest.raises(ReadError, match="ended early") as info:
        await slabs.load(ckpt, options=SMALL)
    assert info.value.file == str(victim.path)
    assert victim.path.name in str(info.value)
    assert info.value.details["offset"] >= victim.data_start
    assert slabs.statistics().state == "failed"
    assert "ended early" in (slabs.statistics().error or "")
    assert_units_all_or_nothing(slabs, ckpt)
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []
    # The next load notices the size change before reading anything.
    monkeypatch.undo()
    with pytest.raises(asyncslab.errors.FileChangedError, match=victim.path.name):
        await slabs.load(ckpt, options=SMALL)
    await slabs.aclose()


def test_a_files_mapping_is_private_and_refused_once_the_file_changed(tmp_path: Path) -> None:
    """``map_checked``: the file as planned, mapped copy-on-write (a write into the mapping
    never reaches the file, and the mapping outlives every handle but its tensor's); a file
    changed since planning is refused, not mapped."""
    path = tmp_path / "f.safetensors"
    content = bytes(range(256)) * 64
    path.write_bytes(content)
    st = os.stat(path)
    whole = _load.map_checked(path, st.st_size, st.st_ino, st.st_mtime_ns, shards=1)
    assert bytes(whole.numpy()) == content
    whole[:16] = 7
    gc.collect()
    assert path.read_bytes() == content
    assert bytes(whole[16:32].numpy()) == content[16:32]
    with open(path, "r+b") as f:
        f.truncate(len(content) - 1)
    with pytest.raises(asyncslab.errors.FileChangedError, match="size 16384 -> 16383"):
        _load.map_checked(path, st.st_size, st.st_ino, st.st_mtime_ns, shards=1)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["deleted", "renamed-away", "replaced", "directory", "fifo"])
async def test_file_gone_or_replaced_after_planning(
    fresh_small: SyntheticCheckpoint, how: str
) -> None:
    ckpt = Checkpoint.open(fresh_small.root)
    p = plan(ckpt)
    victim = ckpt.files[2].path
    data = victim.read_bytes()
    victim.unlink()
    if how == "renamed-away":
        (victim.parent / "elsewhere.bin").write_bytes(data)
    elif how == "replaced":  # same bytes and size, another inode
        victim.write_bytes(data)
    elif how == "directory":
        victim.mkdir()
    elif how == "fifo":  # opening a FIFO for reading blocks until a writer comes: never
        os.mkfifo(victim)
    fds = open_fds()
    with pytest.raises((ReadError, asyncslab.errors.FileChangedError)) as info:
        await load(ckpt, p, options=SMALL)
    assert info.value.file == str(victim)
    if how in ("deleted", "renamed-away"):
        assert isinstance(info.value, ReadError)
        assert isinstance(info.value.__cause__, FileNotFoundError)
    else:
        assert isinstance(info.value, asyncslab.errors.FileChangedError)
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_file_unlinked_after_open_still_loads(
    fresh_small: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # POSIX: an open fd keeps the inode; once the loader holds it, deleting the name is
    # harmless and the load stays bit-exact.
    ckpt = Checkpoint.open(fresh_small.root)
    expected_bytes(ckpt)
    p = plan(ckpt)
    original = _load.open_checked

    def open_then_unlink(path: os.PathLike[str], *args: Any, **kwargs: Any) -> int:
        fd = original(path, *args, **kwargs)
        os.unlink(path)
        return fd

    monkeypatch.setattr(_load, "open_checked", open_then_unlink)
    slabs = await load(ckpt, p, options=SMALL)
    assert_bit_exact(slabs, ckpt)
    assert not any(f.path.exists() for f in ckpt.files)
    await slabs.aclose()


# --- short reads ---------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["random", "half-then-rest", "one-byte-first"])
async def test_short_reads_still_land_bit_exact(
    small_checkpoint: SyntheticCheckpoint, fake_os: Callable[..., FakeOs], policy: str
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    rng = random.Random(1234)
    short = 0
    retries: set[tuple[int, int]] = set()  # (fd, offset) where a short read resumes
    lock = threading.Lock()

    def partial(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        nonlocal short
        total = sum(len(b) for b in buffers)
        with lock:
            resumed = (fd, offset) in retries
            retries.discard((fd, offset))
            if policy == "random":
                limit = rng.randint(1, total)
            elif policy == "half-then-rest":  # the resumed read gets all the rest at once
                limit = total if resumed else max(1, total // 2)
            else:
                limit = total if resumed else 1
        n = os.preadv(fd, trimmed(buffers, limit), offset)
        with lock:
            if n < total:
                short += 1
                retries.add((fd, offset + n))
        return n

    fake = fake_os(partial)
    slabs = await load(ckpt, p, options=SMALL)
    assert short > 10
    assert fake.calls > slabs.statistics().reads
    assert_bit_exact(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    sizes=st.lists(st.integers(0, 64), min_size=0, max_size=40)
    | st.tuples(st.integers(1000, 1300), st.integers(0, 2**32)).map(  # > IOV_MAX targets
        lambda n_seed: [random.Random(n_seed[1]).randrange(4) for _ in range(n_seed[0])]
    ),
    offset=st.integers(0, 50),
    cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20),
    syscall_bytes=st.integers(1, 100),
)
def test_property_partial_reads_through_os_preadv(
    sizes: list[int],
    offset: int,
    cuts: list[float],
    syscall_bytes: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Whatever short counts ``preadv`` returns, every target ends up with its bytes, and
    no call asks for more than ``SYSCALL_BYTES``."""
    total = sum(sizes)
    data = random.Random(total).randbytes(offset + total)
    path = tmp_path_factory.getbasetemp() / "preadv.bin"
    path.write_bytes(data)
    calls = iter(cuts * (total + 2))

    def partial(fd: int, buffers: Sequence[memoryview], at: int) -> int:
        want = sum(len(b) for b in buffers)
        assert 0 < want <= syscall_bytes
        return os.preadv(fd, trimmed(buffers, max(1, round(next(calls) * want))), at)

    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    fd = os.open(path, os.O_RDONLY)
    saved = read_module.os, read_module.SYSCALL_BYTES, read_module._preadv_raw
    read_module.os = FakeOs(partial)  # type: ignore[assignment]
    read_module.SYSCALL_BYTES = syscall_bytes
    read_module._preadv_raw = read_module._preadv_via_os
    try:
        target = scatter([(t.data_ptr(), t.numel()) for t in targets])
        assert pread_scatter(fd, target, offset, path=str(path)) == total
    finally:
        read_module.os, read_module.SYSCALL_BYTES, read_module._preadv_raw = saved  # type: ignore[assignment]
        os.close(fd)
    assert b"".join(bytes(t.tolist()) for t in targets) == data[offset:]


# --- I/O errors ------------------------------------------------------------------------------


def _count_reads(ckpt: Checkpoint, p: asyncslab.Plan, options: LoadOptions) -> int:
    from asyncslab.loading._schedule import schedule

    size = (
        options.staging_bytes // options.staging_buffers
        if options.transfer == "staged"
        else options.read_size
    )
    return len(schedule(p, max_read=size, gap=options.coalesce_gap).ops)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(6))
async def test_eio_on_a_random_read(
    small_checkpoint: SyntheticCheckpoint,
    fake_os: Callable[..., FakeOs],
    seed: int,
    path: str,
) -> None:
    options = PATHS[path]
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    n_reads = _count_reads(ckpt, p, options)
    assert n_reads > 40
    fail_at = random.Random(seed).randrange(1, n_reads + 1)
    count = 0
    lock = threading.Lock()

    def eio_once(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        nonlocal count
        with lock:
            count += 1
            mine = count
        if mine == fail_at:
            raise OSError(errno.EIO, "Input/output error")
        return os.preadv(fd, buffers, offset)

    fake = fake_os(eio_once)
    fds = open_fds()
    slabs = SlabSet(p)
    with pytest.raises(ReadError, match="Input/output error") as info:
        await slabs.load(ckpt, options=options)
    err = info.value
    assert isinstance(err.__cause__, OSError)
    assert err.__cause__.errno == errno.EIO
    assert err.file in {str(f.path) for f in ckpt.files}
    assert isinstance(err.details.get("offset"), int)
    assert fake.in_flight == 0  # nothing still writing once the load has raised
    stats = slabs.statistics()
    assert stats.state == "failed"
    assert "Input/output error" in (stats.error or "")
    complete, incomplete = assert_units_all_or_nothing(slabs, ckpt)
    assert incomplete >= 1
    # The unit holding the failed read's bytes is among the incomplete ones.
    hit = {
        r.unit
        for r in p.routes
        if str(r.file) == err.file
        and r.src_offset <= err.details["offset"] < r.src_offset + max(r.nbytes, 1)
    }
    assert hit
    assert not hit & set(stats.unit_completed_at)
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []
    fake.hook = os.preadv
    await slabs.load(ckpt, options=options)
    assert_bit_exact(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_error_in_one_file_while_others_are_in_flight(
    small_checkpoint: SyntheticCheckpoint, fake_os: Callable[..., FakeOs]
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    victim = str(ckpt.files[1].path)
    victim_reads = 0
    in_flight_at_error: list[int] = []
    failed = threading.Event()

    def slow_reads_failing_victim(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        nonlocal victim_reads
        if path_of(fd) == victim:
            victim_reads += 1
            if victim_reads == 3:
                # Fail while another read is inside its syscall: wait (notified, not polled
                # against a deadline) until one is, and count them in the same instant, under
                # the lock that counts them. The bound is a hang guard only.
                with fake.changed:
                    fake.changed.wait_for(lambda: fake.in_flight >= 2, timeout=HANG_S)
                    in_flight_at_error.append(fake.in_flight)
                failed.set()
                raise OSError(errno.EIO, "Input/output error")
        time.sleep(0.01)
        n = os.preadv(fd, buffers, offset)
        if failed.is_set():
            # Returning now, this thread would take the next queued read before the loop
            # learns of the failure, as many times as the loop is late (a loaded machine):
            # hold until the load has failed, so that what is counted is how far the
            # schedule runs on once the failure is known, not the scheduler's mood.
            deadline = time.monotonic() + HANG_S
            while slabs.state != "failed" and time.monotonic() < deadline:
                time.sleep(0.001)
        return n

    fake = fake_os(slow_reads_failing_victim)
    slabs = SlabSet(p)
    waiters = {u: asyncio.ensure_future(slabs.ready(u)) for u in p.units}
    task = slabs.start(ckpt, options=SMALL)
    try:
        with pytest.raises(ReadError) as info:
            await task
    finally:
        await asyncio.gather(*waiters.values(), return_exceptions=True)
    err = info.value
    # The first error is the one reported, with its file and offset and the OSError.
    assert err.file == victim
    assert isinstance(err.details["offset"], int)
    assert isinstance(err.__cause__, OSError)
    assert err.__cause__.errno == errno.EIO
    assert in_flight_at_error
    assert in_flight_at_error[0] > 1
    # The rest were cancelled: the schedule stopped (few reads started after the error),
    # and no thread is still writing once the load has raised.
    assert fake.in_flight == 0
    assert fake.started_after_error <= SMALL.io_workers
    assert fake.calls < _count_reads(ckpt, p, SMALL)
    stats = slabs.statistics()
    assert stats.state == "failed"
    complete, incomplete = assert_units_all_or_nothing(slabs, ckpt)
    assert incomplete >= 1
    # Waiters of incomplete units learn of the failure (its cause attached); the others
    # returned normally.
    for unit, waiter in waiters.items():
        if unit in stats.unit_completed_at:
            await waiter
        else:
            with pytest.raises(IncompleteLoadError, match="load failed") as winfo:
                await waiter
            assert winfo.value.__cause__ is err
    await slabs.aclose()
    assert await wait_io_threads_gone() == []


# --- cancellation ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("via", ["task.cancel", "task.cancel+spin", "aclose"])
async def test_cancel_before_the_load_task_first_runs(
    small_checkpoint: SyntheticCheckpoint, via: str
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    slabs = SlabSet(p)
    task = slabs.start(ckpt, options=SMALL)
    if via == "aclose":
        await slabs.aclose()
        assert task.cancelled()
        return
    task.cancel()  # before the event loop ever ran it
    if via == "task.cancel+spin":
        # The task ends on the next iteration; awaiting it then returns at once, before
        # its done-callbacks ran: the state must already say so.
        await asyncio.sleep(0)
        assert task.done()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slabs.state == "cancelled"
    with pytest.raises(IncompleteLoadError):
        await slabs.ready()
    await slabs.load(ckpt, options=SMALL)  # not stuck in "already running"
    assert_bit_exact(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_aclose_while_awaited_load_runs(
    small_checkpoint: SyntheticCheckpoint, fake_os: Callable[..., FakeOs]
) -> None:
    # aclose() must stop a load that another task runs with ``await slabs.load()`` (not
    # only one begun with start()), and must not free the slabs under its reads.
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)

    def slow(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        time.sleep(0.005)
        return os.preadv(fd, buffers, offset)

    fake = fake_os(slow)
    fds = open_fds()
    slabs = SlabSet(p)
    loader = asyncio.ensure_future(slabs.load(ckpt, options=SMALL))
    while slabs.statistics().tensors_landed == 0:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    await slabs.aclose()
    assert fake.in_flight == 0
    assert loader.done()
    with pytest.raises((asyncslab.ClosedError, asyncio.CancelledError)):
        await loader
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", PATHS)
async def test_cancel_at_random_points_leaks_nothing(
    small_checkpoint: SyntheticCheckpoint, fake_os: Callable[..., FakeOs], path: str
) -> None:
    options = PATHS[path]
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    expected_bytes(ckpt)

    # Reads are paced by the event loop's turns, not by a sleep: each waits in its thread
    # until the loop has gone round READ_TURNS more times. A load then spans more loop turns
    # than its reads allow in the time cancel_somewhere spins, however busy the machine, so
    # a cancel after fewer turns than that comes before the load's end by construction (a
    # 0.2 ms sleep per read made "mid-load" a matter of how the scheduler felt).
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    def paced(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        due = turns + READ_TURNS
        deadline = time.monotonic() + HANG_S
        while turns < due:
            assert time.monotonic() < deadline, "the event loop stopped turning"
            time.sleep(0.0001)
        return os.preadv(fd, buffers, offset)

    counter = asyncio.create_task(count_turns())
    fake = fake_os(paced)
    rng = random.Random(20240611)
    fds = open_fds()
    slabs = SlabSet(p)
    outcomes: dict[str, int] = {}
    for cycle in range(CANCEL_CYCLES):
        mode = CANCEL_MODES[cycle % len(CANCEL_MODES)]
        await cancel_somewhere(slabs, ckpt, rng, mode, options)
        where = f"cycle {cycle} ({mode})"
        landed = slabs.statistics().tensors_landed if mode != "aclose" else -1
        if 0 < landed < len(p.routes):
            outcomes["mid-load"] = outcomes.get("mid-load", 0) + 1
        # The load has returned: no thread may still be writing into the slabs.
        assert fake.in_flight == 0, where
        assert open_fds() == fds, where
        assert await wait_io_threads_gone() == [], where
        if mode == "aclose":
            with pytest.raises(asyncslab.ClosedError):
                slabs.slab(next(iter(p.slabs)))
            slabs = SlabSet(p)
        else:
            state = slabs.statistics().state
            assert state in ("cancelled", "complete"), (where, state)
            outcomes[state] = outcomes.get(state, 0) + 1
            assert_units_all_or_nothing(slabs, ckpt)
        # The next load succeeds, bit-exact.
        await slabs.load(ckpt, options=options)
        assert_bit_exact(slabs, ckpt)
        assert open_fds() == fds, where
    await slabs.aclose()
    counter.cancel()
    assert await wait_io_threads_gone() == []
    # The seeded points spread over the load: before it began, in the middle, after it ended.
    assert outcomes.get("cancelled", 0) >= CANCEL_CYCLES // 4, outcomes
    assert outcomes.get("mid-load", 0) >= CANCEL_CYCLES // 10, outcomes


# --- concurrency -------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_several_slabsets_load_at_once(tmp_path: Path) -> None:
    ckpts = []
    for seed in range(4):
        spec = SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32, seed=seed)
        ckpts.append(Checkpoint.open(write_synthetic(tmp_path / str(seed), spec).root))
    ckpts.append(ckpts[0])  # two SlabSets reading the same files at once
    fds = open_fds()
    results = await asyncio.gather(*(load(c, plan(c), options=SMALL) for c in ckpts))
    for slabs, ckpt in zip(results, ckpts, strict=True):
        assert_bit_exact(slabs, ckpt)
        await slabs.aclose()
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_second_load_into_the_same_slabset_is_refused(
    small_checkpoint: SyntheticCheckpoint, fake_os: Callable[..., FakeOs]
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)

    def slow(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        time.sleep(0.001)
        return os.preadv(fd, buffers, offset)

    fake_os(slow)
    async with SlabSet(p) as slabs:
        first = slabs.start(ckpt, options=SMALL)
        with pytest.raises(asyncslab.LoadError, match="already running"):
            await slabs.load(ckpt, options=SMALL)
        with pytest.raises(asyncslab.LoadError, match="already running"):
            slabs.start(ckpt, options=SMALL)
        with pytest.raises(asyncslab.LoadError, match="while a load is running"):
            slabs.reset()
        assert await first is slabs
        assert_bit_exact(slabs, ckpt)

        # Two awaited loads raced with gather: exactly one runs, the other is refused.
        slabs.reset()
        results = await asyncio.gather(
            slabs.load(ckpt, options=SMALL), slabs.load(ckpt, options=SMALL),
            return_exceptions=True,
        )  # fmt: skip
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(refused) == 1
        assert isinstance(refused[0], asyncslab.LoadError)
        assert "already running" in str(refused[0])
        assert_bit_exact(slabs, ckpt)


# --- a read stuck past read_timeout -------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PATHS)
async def test_a_retry_the_moment_ready_reports_a_stuck_read_is_refused_not_run_beside_it(
    small_checkpoint: SyntheticCheckpoint,
    fake_os: Callable[..., FakeOs],
    path: str,
) -> None:
    # ready() raises as soon as a read passes read_timeout, while the load's task still
    # drains its threads (for up to read_timeout more) and only then marks the SlabSet
    # unusable. A server retrying at once must not get a load running beside the stuck
    # read, which writes into the slabs when it wakes: the retry waits for the drain and
    # is refused, as every later load of these slabs is.
    ckpt = Checkpoint.open(small_checkpoint.root)
    release = threading.Event()

    def stuck(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        release.wait(HANG_S)
        return os.preadv(fd, buffers, offset)

    fake = fake_os(stuck)
    slabs = SlabSet(plan(ckpt))
    options = replace(PATHS[path], read_timeout=0.2)
    first = slabs.start(ckpt, options=options)
    with pytest.raises(asyncslab.IncompleteLoadError) as info:
        await slabs.ready()
    assert isinstance(info.value.__cause__, asyncslab.errors.ReadTimeoutError)
    del info
    assert not first.done()  # still draining
    slabs.reset()
    with pytest.raises(asyncslab.LoadError, match="cannot be reused") as refused:
        await slabs.load(ckpt, options=options)
    assert not isinstance(refused.value, asyncslab.errors.ReadTimeoutError)  # it read nothing
    assert first.done()
    assert fake.in_flight > 0  # the stuck reads are still out
    await slabs.aclose()
    release.set()
    assert await wait_io_threads_gone() == []
    assert fake.in_flight == 0


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PATHS)
async def test_stalled_read_keeps_its_fd_and_memory_until_it_returns(
    small_checkpoint: SyntheticCheckpoint,
    fake_os: Callable[..., FakeOs],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    # After read_timeout the load gives up on a read stuck in a thread. That thread will
    # still write into the slab and read its fd when it wakes: neither may be released under
    # it (a freed slab would be a use-after-free; a closed fd number can be reused by an
    # unrelated open, and the resumed read would then read the wrong file).
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    release = threading.Event()
    fd_valid_after_wake: list[bool] = []

    def stuck(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        release.wait(HANG_S)
        try:
            os.fstat(fd)
            fd_valid_after_wake.append(True)
        except OSError:
            fd_valid_after_wake.append(False)
        return os.preadv(fd, buffers, offset)

    fake = fake_os(stuck)
    fds = open_fds()
    slabs = SlabSet(p)
    slab_refs = [weakref.ref(slabs._memory.backing)]  # the one allocation behind every slab
    # A staged read writes into its staging buffer: that may not be freed under it either.
    real_buffer = _staged.staging_buffer

    def tracked(size: int, pin: bool) -> torch.Tensor:
        buffer = real_buffer(size, pin)
        slab_refs.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(_staged, "staging_buffer", tracked)
    options = LoadOptions(read_timeout=0.05, io_workers=2)
    if path == "staged":
        options = replace(options, transfer="staged", staging_buffers=2, staging_bytes=2 << 16)
    with pytest.raises(asyncslab.errors.ReadTimeoutError):
        await slabs.load(ckpt, options=options)
    if path == "staged":
        assert len(slab_refs) > 1  # the stuck reads' buffers are among the tracked
    await slabs.aclose()
    del slabs
    gc.collect()
    assert fake.in_flight > 0  # the stuck reads are still inside their threads
    assert all(r() is not None for r in slab_refs), "slab memory freed under a live read"
    release.set()
    assert await wait_io_threads_gone() == []
    assert fake.in_flight == 0
    assert fd_valid_after_wake
    assert all(fd_valid_after_wake), fd_valid_after_wake
    # Once the stuck reads returned, everything is released after all.
    assert await released(lambda: open_fds() != fds), (open_fds(), fds)
    assert await released(lambda: any(r() is not None for r in slab_refs))


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PATHS)
async def test_a_file_replaced_between_start_and_its_open_is_refused_not_read(
    fresh_small: SyntheticCheckpoint, path: str
) -> None:
    """start() checks every shard against the plan, but the files are opened only when the
    load's task first runs; a shard swapped in between (same size, another inode, other
    tensor bytes: a checkpoint re-exported in place) must be refused at its open, else its
    bytes would land silently as the planned checkpoint's."""
    ckpt = Checkpoint.open(fresh_small.root)
    p = plan(ckpt)
    victim = ckpt.files[1]
    data = bytearray(victim.path.read_bytes())
    data[-1] ^= 0xFF  # a tensor byte: the header, and so the plan, would still match
    fds = open_fds()
    slabs = SlabSet(p)
    task = slabs.start(ckpt, options=PATHS[path])  # the stat check passes here
    replacement = victim.path.with_name("replacement.tmp")
    replacement.write_bytes(bytes(data))
    os.replace(replacement, victim.path)
    with pytest.raises(asyncslab.errors.FileChangedError, match="replaced or modified") as info:
        await task
    assert info.value.file == str(victim.path)
    assert slabs.state == "failed"
    assert slabs.statistics().reads == 0
    assert open_fds() == fds
    assert await wait_io_threads_gone() == []
    await slabs.aclose()

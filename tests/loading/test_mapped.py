"""Mapped loads (``transfer="mapped"``) on the CPU: copies straight out of the mapped shards,
each read's pages "registered" for the time of its copies.

On a GPU registering pins the pages with CUDA, which refuses a page registered twice; here a
recording registry stands in for it, checking what CUDA would refuse (a range overlapping
one still registered, one not page-aligned) and that every registration is undone, whatever
happens to the load. The CUDA registry itself is exercised in ``test_cuda.py``.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab.errors import CudaError, ReadError
from asyncslab.loading import _copy
from asyncslab.loading import _strategy_mapped as _mapped
from asyncslab.loading._options import resolve_transfer
from asyncslab.loading._schedule import ReadOp, windows
from asyncslab.testing import SyntheticCheckpoint
from support.faults import CANCEL_MODES, HANG_S, cancel_somewhere
from tests.helpers import (
    assert_bit_exact,
    assert_bit_identical,
    open_fds,
    released,
    wait_io_threads_gone,
)

# Windows of two pages, three threads: hundreds of registrations per load, tensors cut at
# window edges, several registered at once.
MAPPED = LoadOptions(
    transfer="mapped",
    staging_bytes=3 * 2 * mmap.PAGESIZE,
    staging_buffers=3,
    read_timeout=HANG_S,
)


class RecordingRegistry(_mapped.PopulateRegistry):
    """The CPU registry, checked as CUDA would check it and counted."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}
        self.registered = 0
        self.most_live = 0
        self.errors: list[str] = []
        self.delay = delay
        self.fail_at = fail_at
        # Set, the first registration stays live until another thread registers a window:
        # that reads overlap is then a fact of the run, not of how the scheduler felt.
        self.hold_first = False
        self._second = threading.Event()

    def register(self, address: int, nbytes: int) -> None:
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.registered += 1
            if self.fail_at is not None and self.registered == self.fail_at:
                raise RuntimeError("cudaHostRegister(read-only) failed: injected (CUDA error 1)")
            if address % mmap.PAGESIZE or nbytes % mmap.PAGESIZE or nbytes <= 0:
                self.errors.append(f"unaligned range {address:#x}+{nbytes}")
            for start, n in self.live.items():
                if start < address + nbytes and address < start + n:
                    self.errors.append(f"{address:#x}+{nbytes} overlaps {start:#x}+{n}")
            self.live[address] = nbytes
            self.most_live = max(self.most_live, len(self.live))
            first = self.registered == 1
            if len(self.live) > 1:
                self._second.set()
        super().register(address, nbytes)
        if first and self.hold_first:
            # Bounded: with one thread only, no second window ever comes, and the test's
            # most_live assertion says so.
            self._second.wait(timeout=HANG_S)

    def unregister(self, address: int) -> None:
        with self.lock:
            if self.live.pop(address, None) is None:
                self.errors.append(f"unregistered {address:#x}, never registered")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingRegistry]:
    reg = RecordingRegistry()
    monkeypatch.setattr(_mapped, "PopulateRegistry", lambda: reg)
    yield reg
    assert reg.errors == []
    assert reg.live == {}, "a registration was never undone"


def mapped_shards(ckpt: Checkpoint) -> list[str]:
    """Lines of this process's memory map that map one of ``ckpt``'s shards."""
    paths = {str(f.path.resolve()) for f in ckpt.files}
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.rstrip().split(" ")[-1] in paths]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_mapped_load_is_bit_identical_and_leaves_nothing_mapped(
    moe_checkpoint: SyntheticCheckpoint, registry: RecordingRegistry
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    fds = open_fds()
    # The first window stays registered until another thread registers one: the threads'
    # windows overlap in time whatever the machine's load.
    registry.hold_first = True
    async with SlabSet(p) as slabs:
        await slabs.load(ckpt, options=MAPPED)
        assert assert_bit_identical(slabs, ckpt) == len(p.routes)
        stats = slabs.statistics()
        window = 2 * mmap.PAGESIZE
        assert stats.reads == len(windows(p, window=window).ops) == registry.registered
        assert stats.bytes_landed == p.nbytes
        assert stats.transfer == "mapped"
        # No staging buffers: the bytes come from the page cache itself.
        assert stats.staging_budget == 0
        assert stats.staging_peak == 0
        assert 1 < registry.most_live <= 3  # one window per thread at most
        assert mapped_shards(ckpt) == []
        assert open_fds() == fds
        # Reload into the same memory: same pointers, same bytes.
        pointer = slabs.slab(next(iter(p.slabs))).data_ptr()
        slabs.reset()
        await slabs.load(ckpt, options=MAPPED)
        assert slabs.slab(next(iter(p.slabs))).data_ptr() == pointer
        assert_bit_identical(slabs, ckpt)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_mapped_load_with_large_windows_reads_whole_shards(
    moe_checkpoint: SyntheticCheckpoint, registry: RecordingRegistry
) -> None:
    # The defaults: windows of 32 MiB hold a small shard whole.
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = await asyncslab.load(ckpt, plan(ckpt), options=LoadOptions(transfer="mapped"))
    assert_bit_identical(slabs, ckpt)
    assert registry.registered == len(ckpt.files)
    await slabs.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_registration_fails_the_load_naming_file_and_offset(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    failing = RecordingRegistry(fail_at=5)
    monkeypatch.setattr(_mapped, "PopulateRegistry", lambda: failing)
    fds = open_fds()
    async with SlabSet(p) as slabs:
        with pytest.raises(asyncslab.errors.ReadError) as info:
            await slabs.load(ckpt, options=MAPPED)
        err = info.value
        assert re.search(r"cannot register the \d+ bytes at offset \d+ .*: .*injected", str(err))
        assert err.file in {str(f.path) for f in ckpt.files}
        assert isinstance(err.details["offset"], int)
        assert isinstance(err.__cause__, RuntimeError)
        assert slabs.state == "failed"
        assert failing.live == {}
        assert failing.errors == []
        assert mapped_shards(ckpt) == []
        assert open_fds() == fds
        # Nothing half-loaded is handed out; a retry with a working registry succeeds.
        with pytest.raises(asyncslab.IncompleteLoadError):
            slabs.slab(next(iter(p.slabs)))
        monkeypatch.setattr(_mapped, "PopulateRegistry", RecordingRegistry)
        slabs.reset()
        await slabs.load(ckpt, options=MAPPED)
        assert_bit_identical(slabs, ckpt)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failing_mapped_copy_fails_the_load_and_undoes_its_registration(
    moe_checkpoint: SyntheticCheckpoint,
    registry: RecordingRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    calls = 0
    real = _copy.CpuCopier.copy

    def failing(self: object, op, buffer, backing, route_base, stream_index):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 7:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(self, op, buffer, backing, route_base, stream_index)  # type: ignore[arg-type]

    monkeypatch.setattr(_copy.CpuCopier, "copy", failing)
    async with SlabSet(p) as slabs:
        with pytest.raises(asyncslab.LoadError, match="illegal memory access") as info:
            await slabs.load(ckpt, options=MAPPED)
        err = info.value
        assert err.tensor in {r.tensor for r in p.routes}
        assert err.details["slab"] in p.slabs
        assert isinstance(err.details["slot"], tuple)
        assert err.file in {str(f.path) for f in ckpt.files}
    assert mapped_shards(ckpt) == []  # and the fixture checks every registration was undone


class UnregisterFails(RecordingRegistry):
    """Unregistration ``fail_unregister_at`` (counted from 1) raises, the range left
    registered, as a failing ``cudaHostUnregister`` would leave it."""

    def __init__(self, fail_unregister_at: int) -> None:
        super().__init__()
        self.unregistered = 0
        self.fail_unregister_at = fail_unregister_at
        self.stuck: list[int] = []

    def unregister(self, address: int) -> None:
        with self.lock:
            self.unregistered += 1
            if self.unregistered == self.fail_unregister_at:
                self.stuck.append(address)
                raise RuntimeError("cudaHostUnregister failed: injected (CUDA error 1)")
        super().unregister(address)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("copy_fails", [False, True], ids=["after-its-copy", "after-a-failed-copy"])
async def test_a_range_left_registered_keeps_its_shard_mapped(
    fresh_moe: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    copy_fails: bool,
) -> None:
    """Unmapped, a shard's addresses could go to a later mapping while CUDA still holds a
    range of them registered: it would refuse to register them again, or take them for the
    old pages. That shard stays mapped; the others are unmapped; a new load works. (A
    checkpoint of its own: the mapping it leaves stays for the life of the process.)"""
    ckpt = Checkpoint.open(fresh_moe.root)
    p = plan(ckpt)
    failing = UnregisterFails(fail_unregister_at=4)
    monkeypatch.setattr(_mapped, "PopulateRegistry", lambda: failing)
    if copy_fails:
        real = _copy.CpuCopier.copy
        calls = [0]

        def copy(self: object, *args: Any) -> None:
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("CUDA error: injected")
            real(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(_copy.CpuCopier, "copy", copy)
    before = mapped_shards(ckpt)
    async with SlabSet(p) as slabs:
        with pytest.raises(asyncslab.LoadError) as info:
            await slabs.load(ckpt, options=MAPPED)
        expected = "CUDA error: injected" if copy_fails else "cannot unregister .*injected"
        assert re.search(expected, str(info.value))
    (address,) = failing.stuck
    left = [line for line in mapped_shards(ckpt) if line not in before]
    assert len(left) == 1, left  # the one shard holding the range, and only it
    start, end = (int(x, 16) for x in left[0].split(" ")[0].split("-"))
    assert start <= address < end
    monkeypatch.undo()
    monkeypatch.setattr(_mapped, "PopulateRegistry", RecordingRegistry)
    async with SlabSet(p) as slabs:
        await slabs.load(ckpt, options=MAPPED)
        assert_bit_identical(slabs, ckpt)
    assert [line for line in mapped_shards(ckpt) if line not in before] == left


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_mapped_cancel_at_random_points_leaks_nothing(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    paced = RecordingRegistry(delay=0.0002)  # a load takes ~10 ms: cancelled mid-way
    monkeypatch.setattr(_mapped, "PopulateRegistry", lambda: paced)
    rng = random.Random(20261130)
    fds = open_fds()
    slabs = SlabSet(p)
    mid_load = 0
    for cycle in range(21):
        mode = CANCEL_MODES[cycle % len(CANCEL_MODES)]
        await cancel_somewhere(slabs, ckpt, rng, mode, MAPPED)
        where = f"cycle {cycle} ({mode})"
        # The load has returned: no registration left, nothing mapped, no fd, no thread.
        assert paced.live == {}, where
        assert mapped_shards(ckpt) == [], where
        assert open_fds() == fds, where
        assert await wait_io_threads_gone() == [], where
        if mode == "aclose":
            slabs = SlabSet(p)
        else:
            landed = slabs.statistics().tensors_landed
            mid_load += 0 < landed < len(p.routes)
        await slabs.load(ckpt, options=MAPPED)
        assert_bit_exact(slabs, ckpt)
    await slabs.aclose()
    assert paced.errors == []
    assert mid_load >= 2


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_registration_stuck_past_read_timeout_keeps_the_mappings_until_it_returns(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A registration faults in pages from storage: it can hang like a read. The load gives
    # up after read_timeout, but the thread still copies out of the mapping when it wakes:
    # the mapping (and the slabs) must outlive it.
    ckpt = Checkpoint.open(moe_checkpoint.root)
    release = threading.Event()
    woke: list[int] = []
    stuck_at: list[int] = []

    class Stuck(RecordingRegistry):
        def register(self, address: int, nbytes: int) -> None:
            super().register(address, nbytes)
            with self.lock:
                first = not stuck_at
                if first:
                    stuck_at.append(address)
            if first:
                release.wait(HANG_S)
                # Reading the page now would kill the process had it been unmapped.
                ctypes.c_ubyte.from_address(address).value  # noqa: B018
                woke.append(address)

    stuck = Stuck()
    monkeypatch.setattr(_mapped, "PopulateRegistry", lambda: stuck)
    slabs = SlabSet(plan(ckpt))
    backing = weakref.ref(slabs._memory.backing)  # the one allocation behind every slab
    with pytest.raises(asyncslab.errors.ReadTimeoutError):
        await slabs.load(ckpt, options=replace(MAPPED, read_timeout=0.1))
    await slabs.aclose()
    del slabs
    gc.collect()
    # Kept for the stuck thread: the mappings it copies out of, the slabs it copies into.
    assert mapped_shards(ckpt) != []
    assert backing() is not None
    release.set()
    assert await wait_io_threads_gone() == []
    assert len(woke) == 1
    assert stuck.live == {}
    assert await released(lambda: mapped_shards(ckpt) != [])
    assert await released(lambda: backing() is not None)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_mapped_loads_of_empty_and_tensorless_shards(
    tmp_path: Path, registry: RecordingRegistry
) -> None:
    # A shard with no tensor bytes is mapped but never registered; zero-size tensors land
    # without a read.
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(3000, dtype=torch.int32), "z": torch.empty(0)}
    save_file(tensors, tmp_path / "x.safetensors")
    save_file({"e": torch.empty(0, 4)}, tmp_path / "y.safetensors")
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt)
    slabs = await asyncslab.load(ckpt, p, options=MAPPED)
    assert_bit_identical(slabs, ckpt)
    ops = windows(p, window=2 * mmap.PAGESIZE).ops
    assert {p.files[op.file].path.name for op in ops} == {"x.safetensors"}
    assert registry.registered == len(ops) >= 1
    await slabs.aclose()


def test_populate_registry_reports_pages_past_a_truncated_end(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(b"x" * (3 * mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        maps = _mapped.Mappings([fd], [3 * mmap.PAGESIZE], [str(path)])
    finally:
        os.close(fd)
    try:
        registry = _mapped.PopulateRegistry()
        registry.register(maps.address(0), 3 * mmap.PAGESIZE)
        os.truncate(path, mmap.PAGESIZE)
        if registry._madvise is None:
            pytest.skip("MADV_POPULATE_READ is not available on this kernel")
        with pytest.raises(OSError, match="truncated") as info:
            registry.register(maps.address(0), 3 * mmap.PAGESIZE)
        assert info.value.errno == errno.EFAULT
    finally:
        maps.close()


def test_transfer_option_is_checked() -> None:
    with pytest.raises(ValueError, match="transfer must be one of"):
        LoadOptions(transfer="zero-copy")  # type: ignore[arg-type]
    with pytest.raises(asyncslab.LoadError, match="needs 'staged' or 'mapped'"):
        resolve_transfer("direct", torch.device("cuda"))
    assert resolve_transfer("auto", torch.device("cuda")) == "staged"
    assert resolve_transfer("auto", torch.device("cpu")) == "direct"


@pytest.mark.asyncio
async def test_direct_transfer_onto_cuda_is_refused_before_anything_starts(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = SlabSet(plan(ckpt))
    # Only the check is exercised; nothing is allocated: the device its memory is on.
    slabs._memory.device = torch.device("cuda")
    with pytest.raises(asyncslab.LoadError, match="reads into host memory"):
        await slabs.load(ckpt, options=LoadOptions(transfer="direct"))
    assert slabs.state == "empty"
    slabs._memory.device = torch.device("cpu")
    await slabs.aclose()


class _FakeCudart:
    """``torch.cuda.cudart()`` as the CUDA registry calls it: error codes, not exceptions."""

    def __init__(self, register_code: int = 0, unregister_code: int = 0) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.codes = (register_code, unregister_code)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", address, size, flags))
        return self.codes[0]

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        return self.codes[1]

    def cudaGetErrorString(self, code: int) -> str:  # noqa: N802
        return {801: "operation not supported", 712: "part or all of the range is registered"}[code]


def test_cuda_registry_registers_read_only_and_reports_cuda_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    devices: list[object] = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: devices.append(d) or nullcontext())
    registry = _mapped.CudaRegistry(torch.device("cuda", 1))
    registry.register(0x10000, 8192)
    registry.unregister(0x10000)
    # Read-only (8) and portable (1), with the target device current.
    assert fake.calls == [("register", 0x10000, 8192, 9), ("unregister", 0x10000)]
    assert devices == [torch.device("cuda", 1)] * 2
    fake.codes = (801, 712)
    with pytest.raises(CudaError, match=r"cudaHostRegister\(read-only\) failed: operation") as e:
        registry.register(0x10000, 8192)
    assert e.value.details == {"call": "cudaHostRegister(read-only)", "code": 801}
    with pytest.raises(CudaError, match=r"cudaHostUnregister failed: .* \(CUDA error 712\)") as e:
        registry.unregister(0x10000)
    assert e.value.details == {"call": "cudaHostUnregister", "code": 712}
    # What a mapped load raises of it: a ReadError naming the range, the CudaError its cause.
    fake.codes = (801, 0)
    mappings: Any = SimpleNamespace(address=lambda file: 0x10000)
    with pytest.raises(ReadError, match=r"cannot register the \d+ bytes at offset 0") as r:
        _mapped.transfer(ReadOp(0, 0, 16, ()), mappings, registry, print, "a.safetensors")
    assert isinstance(r.value.__cause__, CudaError)
    assert r.value.file == "a.safetensors"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spare", [1, mmap.PAGESIZE - 1])
async def test_a_window_size_off_the_page_size_is_cut_to_whole_pages(
    moe_checkpoint: SyntheticCheckpoint, registry: RecordingRegistry, spare: int
) -> None:
    """``staging_bytes // staging_buffers`` need not be a multiple of the page size; the
    windows must be, rounded down. Windows of the size asked would share a page with their
    neighbours, and two threads would register that page at once: CUDA refuses that
    ("already registered"), failing every such mapped load on a GPU."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    registry.delay = 0.002  # registrations overlap in time, as CUDA's do
    options = replace(MAPPED, staging_bytes=3 * (2 * mmap.PAGESIZE + spare))
    async with SlabSet(p) as slabs:
        await slabs.load(ckpt, options=options)
        assert assert_bit_identical(slabs, ckpt) == len(p.routes)
        reads = slabs.statistics().reads
    assert reads == len(windows(p, window=2 * mmap.PAGESIZE).ops) == registry.registered


class _SpanRegistry:
    """Records the one range registered; the copy checks it reads only inside it."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        self.ranges.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(0, 1), (1, mmap.PAGESIZE), (mmap.PAGESIZE - 1, 2), (mmap.PAGESIZE, mmap.PAGESIZE),
     (mmap.PAGESIZE + 5, 3 * mmap.PAGESIZE)],
)  # fmt: skip
def test_transfer_registers_every_page_its_copy_reads(
    tmp_path: Path, offset: int, nbytes: int
) -> None:
    """The pages registered for a read cover all of its bytes: on a GPU a copy from past
    the registered range reads pages neither pinned nor faulted in (a cold page, or a file
    truncated meanwhile, ends the process with SIGBUS on the CPU twin instead of an error)."""
    path = tmp_path / "shard.bin"
    data = random.Random(0).randbytes(6 * mmap.PAGESIZE)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    mappings = _mapped.Mappings([fd], [len(data)], [str(path)])
    registry = _SpanRegistry()
    # Plain numbers and bytes only: nothing that points into the mapping outlives it.
    copied: list[tuple[int, int, bytes]] = []

    def copy(op: Any, source: torch.Tensor) -> None:
        copied.append((source.data_ptr(), source.numel(), source.numpy().tobytes()))

    op = ReadOp(file=0, offset=offset, nbytes=nbytes, pieces=())
    try:
        returned = _mapped.transfer(op, mappings, registry, copy, str(path))
    finally:
        mappings.close()
        os.close(fd)
    assert returned == nbytes
    ((address, length),) = registry.ranges
    ((pointer, size, got),) = copied
    assert got == data[offset : offset + nbytes]
    assert address % mmap.PAGESIZE == 0
    assert length % mmap.PAGESIZE == 0
    assert address <= pointer
    assert pointer + size <= address + length
    assert registry.unregistered == [address]


def test_mappings_that_fail_part_way_unmap_what_they_mapped(tmp_path: Path) -> None:
    """A shard that cannot be mapped (here: a bad descriptor) fails the load; the shards
    mapped before it must be unmapped then, not left in the address space for the life of
    the process (each retry would leak the whole checkpoint's address range again)."""
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(3 * mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="cannot map"):
            _mapped.Mappings([fd, -1], [3 * mmap.PAGESIZE, 1], [str(path), "bad"])
    finally:
        os.close(fd)
    with open("/proc/self/maps") as maps:
        assert [line for line in maps if line.rstrip().endswith(str(path))] == []

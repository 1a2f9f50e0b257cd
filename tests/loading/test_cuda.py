"""The CUDA target: pinned staging buffers, copies on several streams, pointer identity on the
device. Skipped cleanly where CUDA is not available (see conftest)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch
from safetensors import safe_open

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, load, plan
from asyncslab._heap import gc_paused
from asyncslab.testing import SyntheticCheckpoint
from support.faults import raw_bytes
from tests.helpers import assert_bit_identical, slow_reads, staging_released

pytestmark = [pytest.mark.asyncio, pytest.mark.cuda]


@pytest.mark.parametrize("streams", [1, 4])
async def test_cuda_load_is_bit_identical(
    moe_checkpoint: SyntheticCheckpoint, streams: int
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    # A tiny ring forces chunking of large tensors and buffer reuse.
    options = LoadOptions(staging_bytes=4 * (64 << 10), staging_buffers=4, streams=streams)
    slabs = await load(ckpt, p, device="cuda", options=options)
    assert_bit_identical(slabs, ckpt)
    stats = slabs.statistics()
    assert stats.staging_budget == options.staging_bytes
    assert 0 < stats.staging_peak <= options.staging_bytes
    for name in p.slabs:
        assert slabs.slab(name).device.type == "cuda"


async def test_cuda_staging_budget_is_what_is_pinned(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    # 96 KiB asked per buffer; torch would pin 128 KiB for each: 64 KiB are used instead.
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(staging_bytes=4 * (96 << 10), staging_buffers=4)
    async with SlabSet(p, "cuda") as slabs:
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)
        stats = slabs.statistics()
        assert stats.staging_budget == 4 * (64 << 10)
        assert 0 < stats.staging_peak <= stats.staging_budget


async def test_cuda_views_and_reload_keep_pointers(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    slabs = await load(ckpt, p, device="cuda")
    for route in p.routes:
        slab = slabs.slab(route.slab)
        view = slabs.view(route.tensor)
        assert view.data_ptr() == slab.data_ptr() + route.dst_offset
        assert view.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
    pointers = {n: slabs.slab(n).data_ptr() for n in p.slabs}
    allocated = torch.cuda.memory_allocated()
    slabs.reset()
    await slabs.load(ckpt)
    assert {n: slabs.slab(n).data_ptr() for n in p.slabs} == pointers
    assert torch.cuda.memory_allocated() == allocated  # reload allocates nothing on the device
    assert_bit_identical(slabs, ckpt)


async def test_cuda_peak_memory_is_the_slabs(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    gc.collect()  # an earlier test's garbage freed during this load would skew the peak
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    slabs = await load(ckpt, p, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    # No transient per-tensor copies on the device: the peak is the slabs (allocator
    # rounding aside).
    assert peak <= p.nbytes + 512 * len(p.slabs)
    await slabs.aclose()


@pytest.mark.parametrize("transfer", ["staged", "mapped"])
async def test_cuda_dropped_slabset_frees_device_memory_without_the_collector(
    moe_checkpoint: SyntheticCheckpoint, transfer: str
) -> None:
    """A model swap: the old SlabSet dropped, its VRAM must be free for the next one."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with gc_paused():  # the collector off: only reference counts free
        options = LoadOptions(transfer=transfer)  # type: ignore[arg-type]
        slabs = await load(ckpt, p, device="cuda", options=options)
        assert torch.cuda.memory_allocated() >= base + p.nbytes
        del slabs
        await asyncio.sleep(0)  # the handle that resumed this step holds the load's task
        assert torch.cuda.memory_allocated() == base


async def test_cuda_cancel_releases_staging_and_retry_succeeds(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)

    slow_reads(monkeypatch, 0.01)
    slabs = SlabSet(p, "cuda")

    # Cancelled from the progress report of the first landing: surely mid-load (nothing
    # lands after a cancel). A poll for it, late on a loaded machine, could find the load
    # already complete.
    def cancel_at_first_landing(stats: asyncslab.LoadStatistics) -> None:
        if stats.tensors_landed and not task.cancelling():
            task.cancel()

    task = slabs.start(
        ckpt,
        options=LoadOptions(staging_bytes=4 << 16, staging_buffers=4, progress_interval=0),
        progress=cancel_at_first_landing,
    )
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slabs.statistics().state == "cancelled"
    assert staging_released(slabs)  # the pinned staging buffers went with the load
    monkeypatch.undo()
    await slabs.load(ckpt)
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()


async def test_cuda_failing_copy_fails_the_load_and_a_retry_succeeds(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy to the device that raises mid-load, after some of its copies were enqueued:
    the load fails naming the read, but only once those copies have finished (they read
    the pinned buffer the load then releases); the next load works."""
    from asyncslab.loading import _copy

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    # One stream per I/O thread: the others' copies do not queue behind the failing one's.
    options = LoadOptions(staging_bytes=4 * (64 << 10), staging_buffers=4, streams=4)
    real = _copy._copy_all
    calls = [0]
    lock = threading.Lock()  # the I/O threads copy concurrently
    enqueued: list[torch.cuda.Event] = []

    def fifth_fails(
        dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool
    ) -> None:
        with lock:
            calls[0] += 1
            fifth = calls[0] == 5
        if not fifth:
            real(dst, src, non_blocking=non_blocking)
            return
        # On this thread's copy stream: ~1 s of GPU time, then the real copies, then fail.
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
        real(dst, src, non_blocking=non_blocking)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        enqueued.append(event)
        raise RuntimeError("CUDA error: injected")

    slabs = SlabSet(p, "cuda")
    monkeypatch.setattr(_copy, "_copy_all", fifth_fails)
    with pytest.raises(asyncslab.LoadError, match="copy to cuda.* failed: CUDA error: injected"):
        await slabs.load(ckpt, options=options)
    (event,) = enqueued
    # The failed read's copies had finished before the load reported.
    assert event.query()  # type: ignore[no-untyped-call]
    assert slabs.statistics().state == "failed"
    assert staging_released(slabs)
    monkeypatch.undo()
    slabs.reset()
    await slabs.load(ckpt, options=options)
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.parametrize("transfer", ["staged", "mapped"])
async def test_cuda_a_unit_is_on_the_device_when_its_callback_runs(
    moe_checkpoint: SyntheticCheckpoint, transfer: str
) -> None:
    """on_unit_ready promises a usable unit: its bytes must already be on the device (the
    copies into it completed), not merely enqueued."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    expected: dict[str, torch.Tensor] = {}
    for shard in ckpt.files:
        with safe_open(shard.path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                expected[name] = f.get_tensor(name)
    by_unit: dict[str, list[str]] = {}
    for route in p.routes:
        by_unit.setdefault(p.slabs[route.slab].unit, []).append(route.tensor)
    checked: list[str] = []

    async def on_unit(unit: str, slabs: SlabSet) -> None:
        for name in by_unit.get(unit, []):
            # .cpu() on another stream than the copies': waits for nothing they enqueued.
            with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
                got = slabs.view(name).cpu()
            assert torch.equal(raw_bytes(got), raw_bytes(expected[name])), (unit, name)
        checked.append(unit)

    options = LoadOptions(transfer=transfer, staging_bytes=4 * (64 << 10), staging_buffers=4)  # type: ignore[arg-type]
    async with SlabSet(p, "cuda") as slabs:
        await slabs.load(ckpt, options=options, on_unit_ready=on_unit)
    assert sorted(checked) == sorted(p.units)


# --- mapped: copies straight out of the page cache, pages registered with CUDA ---------------


@pytest.mark.parametrize("window", [64 << 10, 32 << 20])
async def test_cuda_mapped_load_is_bit_identical_with_no_host_memory(
    moe_checkpoint: SyntheticCheckpoint, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small windows: hundreds of registrations, tensors cut at window edges, several
    # registered at once by 4 threads; large ones: a shard whole in one registration.
    from asyncslab.loading import _strategy_mapped as _mapped

    live: set[int] = set()
    counts = [0, 0]
    lock = threading.Lock()  # the I/O threads register concurrently
    real_register, real_unregister = _mapped.CudaRegistry.register, _mapped.CudaRegistry.unregister

    def register(self: _mapped.CudaRegistry, address: int, nbytes: int) -> None:
        real_register(self, address, nbytes)  # CUDA itself refuses an overlap
        with lock:
            live.add(address)
            counts[0] += 1

    def unregister(self: _mapped.CudaRegistry, address: int) -> None:
        real_unregister(self, address)
        with lock:
            live.discard(address)
            counts[1] += 1

    monkeypatch.setattr(_mapped.CudaRegistry, "register", register)
    monkeypatch.setattr(_mapped.CudaRegistry, "unregister", unregister)
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="mapped", staging_bytes=4 * window, staging_buffers=4)
    gc.collect()  # an earlier test's garbage freed during this load would skew the peak
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    async with SlabSet(p, "cuda") as slabs:
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)
        assert slabs.statistics().staging_budget == 0
        # No transient device allocation: the peak is what stays, the slabs.
        assert torch.cuda.max_memory_allocated() - base == torch.cuda.memory_allocated() - base
        assert counts[0] == counts[1] == slabs.statistics().reads
        assert live == set()  # every registration undone
        slabs.reset()
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)
        assert live == set()


async def test_cuda_mapped_failing_registration_names_the_file(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncslab.loading import _strategy_mapped as _mapped

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    real = _mapped.CudaRegistry.register
    calls = 0
    lock = threading.Lock()

    def failing(self: _mapped.CudaRegistry, address: int, nbytes: int) -> None:
        nonlocal calls
        with lock:  # exactly one registration fails, whichever thread makes the third
            calls += 1
            third = calls == 3
        real(self, address, nbytes)
        if third:
            try:  # a real CUDA refusal: these pages are registered already
                real(self, address, nbytes)
            finally:
                self.unregister(address)  # as a refused registration leaves nothing behind

    monkeypatch.setattr(_mapped.CudaRegistry, "register", failing)
    options = LoadOptions(transfer="mapped", staging_bytes=4 * (64 << 10), staging_buffers=4)
    async with SlabSet(p, "cuda") as slabs:
        with pytest.raises(asyncslab.errors.ReadError, match="CUDA error") as info:
            await slabs.load(ckpt, options=options)
        assert info.value.file in {str(f.path) for f in ckpt.files}
        cause = info.value.__cause__
        assert isinstance(cause, asyncslab.errors.CudaError)
        assert cause.details["call"] == "cudaHostRegister(read-only)"
        monkeypatch.undo()
        slabs.reset()
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)


async def test_cuda_device_without_an_index_is_the_current_one(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    # The copies run on I/O threads, whose current device is 0: an index-less "cuda" would
    # put their streams and events on the wrong device of a multi-GPU machine.
    slabs = SlabSet(plan(Checkpoint.open(moe_checkpoint.root)), "cuda")
    assert slabs.device == torch.device("cuda", torch.cuda.current_device())
    await slabs.aclose()


@pytest.mark.parametrize("transfer", ["staged", "mapped"])
async def test_cuda_copies_wait_for_work_queued_on_the_current_stream(
    moe_checkpoint: SyntheticCheckpoint, transfer: str
) -> None:
    # The copy streams did not wait for the current stream: memory freed by work still
    # queued there (a model swap) could be handed to the slabs, and that work then wrote
    # over bytes the load had copied.
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    torch.cuda.synchronize()
    scratch = torch.empty(p.nbytes + (1 << 20), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before the fill
    scratch.fill_(0xA5)
    del scratch  # freed at once; its block may become the slabs' backing
    slabs = await load(ckpt, p, device="cuda", options=LoadOptions(transfer=transfer))  # type: ignore[arg-type]
    torch.cuda.synchronize()
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.parametrize("transfer", ["staged", "mapped"])
async def test_cuda_load_into_given_device_tensors_keeps_their_memory(
    moe_checkpoint: SyntheticCheckpoint, transfer: str
) -> None:
    """An engine's parameters on the GPU as the slabs (``tensors=``): copied into in place,
    bit-identical, and left allocated when the SlabSet closes."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    given = {
        name: torch.empty(spec.shape, dtype=spec.dtype, device="cuda")
        for name, spec in p.slabs.items()
    }
    addresses = {name: t.data_ptr() for name, t in given.items()}
    slabs = SlabSet(p, tensors=given)
    assert slabs.device.type == "cuda"
    options = LoadOptions(transfer=transfer, staging_bytes=4 * (64 << 10), staging_buffers=4)  # type: ignore[arg-type]
    await slabs.load(ckpt, options=options)
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()
    for name, tensor in given.items():
        assert tensor.data_ptr() == addresses[name]
    with safe_open(ckpt.files[0].path, framework="pt") as f:
        name = next(iter(f.keys()))  # noqa: SIM118
        route = p.route(name)
        if route.shape is None and not p.slabs[route.slab].slot_dims:
            assert torch.equal(raw_bytes(given[route.slab]), raw_bytes(f.get_tensor(name)))

"""The load pipeline on a CPU target: bytes land bit-exact in their slots, completeness gates
access, pointers survive reloads, and failures and cancellation leave nothing behind."""

from __future__ import annotations

import asyncio
import errno
import gc
import math
import os
import re
import sys
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, load, plan
from asyncslab._heap import gc_paused
from asyncslab.errors import ReadError
from asyncslab.loading import _copy as copy_module
from asyncslab.loading._read import Scatter, pread_scatter, scatter
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, write_synthetic
from support.faults import HANG_S, raw_bytes
from tests.helpers import (
    assert_bit_identical,
    io_threads,
    loop_errors,
    open_fds,
    slow_reads,
    staging_released,
    wait_io_threads_gone,
)

pytestmark = pytest.mark.asyncio

# Small reads and few workers make every checkpoint here take many reads, so the pipeline's
# interleaving, chunking and coalescing are all exercised on KB-sized files.
SMALL = LoadOptions(read_size=64 << 10, coalesce_gap=256, io_workers=3)


async def test_tiered_moe_lands_bit_identical(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt, tier_map=moe_checkpoint.tier_map_path)
    slabs = await load(ckpt, p, options=SMALL)
    assert slabs.state == "complete"
    assert assert_bit_identical(slabs, ckpt) == len(p.routes)
    stats = slabs.statistics()
    assert stats.tensors_landed == stats.tensors == len(p.routes)
    assert stats.bytes_landed == stats.bytes_needed == p.nbytes
    # Reads never exceed what is needed by more than the coalescing slack.
    assert p.nbytes <= stats.bytes_read <= p.nbytes + SMALL.coalesce_gap * stats.reads
    assert stats.units_complete == len(p.units)
    assert stats.transfer == "direct"  # "auto" on a CPU target
    slabs.reset()
    assert slabs.statistics().transfer == ""  # no load since


async def test_default_options_and_experts_straddling_files(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    files_of_expert: dict[tuple[int, int], set[Path]] = {}
    for r in p.routes:
        if r.expert is not None:
            files_of_expert.setdefault((r.layer or 0, r.expert), set()).add(r.file)
    assert any(len(files) > 1 for files in files_of_expert.values())
    slabs = await load(ckpt, p)
    assert_bit_identical(slabs, ckpt)


@pytest.mark.parametrize("rank", [0, 1])
async def test_rank_sliced_reads_only_its_rank(tmp_path: Path, rank: int) -> None:
    written = write_synthetic(tmp_path, SyntheticSpec(tp_ranks=2, n_layers=3))
    ckpt = Checkpoint.open(written.root)
    p = plan(ckpt, rank=rank)
    assert all(f".rank{rank}." in r.tensor for r in p.routes if r.expert is not None)
    slabs = await load(ckpt, p, options=SMALL)
    assert_bit_identical(slabs, ckpt)
    stats = slabs.statistics()
    other = sum(ckpt.tensors[n].nbytes for n in p.skipped)
    assert other > 0
    # The other rank's slices are not read (beyond coalescing slack).
    assert stats.bytes_read <= stats.bytes_needed + SMALL.coalesce_gap * stats.reads


async def test_zero_size_scalars_and_many_dtypes(tmp_path: Path) -> None:
    tensors = {
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "empty2": torch.zeros(0, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i8": -torch.arange(5, dtype=torch.int8),
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "big": torch.randn(300, 301),  # larger than one read: moves in chunks
        "i64": torch.arange(9, dtype=torch.int64).reshape(3, 3),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, path)
    ckpt = Checkpoint.open(path)
    p = plan(ckpt)
    slabs = await load(ckpt, p, options=LoadOptions(read_size=4096, coalesce_gap=0))
    for name, t in tensors.items():
        got = slabs.view(name)
        assert got.shape == t.shape
        assert got.dtype == t.dtype
        assert torch.equal(raw_bytes(got), raw_bytes(t))


async def test_views_are_zero_copy(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    slabs = await load(ckpt, p)
    for route in p.routes:
        slab = slabs.slab(route.slab)
        view = slabs.view(route.tensor)
        assert view.data_ptr() == slab.data_ptr() + route.dst_offset
        assert view.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
    # W13 is projection-major: gate shard then up shard, each group_offset-minor.
    w13 = next(n for n, s in p.slabs.items() if s.labels.get("projection") == "w13")
    spec = p.slabs[w13]
    assert spec.slot_dims[0] == 2
    assert slabs.slot(w13, (1, 0)).data_ptr() == slabs.slab(w13).data_ptr() + (
        spec.slot_dims[1] * spec.slot_nbytes
    )


async def test_reload_keeps_every_pointer(tmp_path: Path) -> None:
    first = write_synthetic(tmp_path / "a", SyntheticSpec(seed=1))
    second = write_synthetic(tmp_path / "b", SyntheticSpec(seed=1, fill="pattern"))
    ckpt_a, ckpt_b = Checkpoint.open(first.root), Checkpoint.open(second.root)
    plan_a, plan_b = plan(ckpt_a), plan(ckpt_b)
    assert plan_a.layout_fingerprint == plan_b.layout_fingerprint
    slabs = await load(ckpt_a, plan_a)
    pointers = {name: slabs.slab(name).data_ptr() for name in plan_a.slabs}

    slabs.reset()
    with pytest.raises(asyncslab.IncompleteLoadError):
        slabs.slab(next(iter(plan_a.slabs)))
    await slabs.load(ckpt_a)
    assert {name: slabs.slab(name).data_ptr() for name in plan_a.slabs} == pointers

    await load(ckpt_b, plan_b, into=slabs)
    assert {name: slabs.slab(name).data_ptr() for name in plan_a.slabs} == pointers
    assert_bit_identical(slabs, ckpt_b)


async def test_incomplete_slab_is_refused(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    async with SlabSet(p) as slabs:
        name = next(n for n, s in p.slabs.items() if s.labels.get("kind") == "experts")
        incomplete = r"0 of \d+ tensors landed; missing"
        with pytest.raises(asyncslab.IncompleteLoadError, match=incomplete):
            slabs.slab(name)
        with pytest.raises(asyncslab.IncompleteLoadError):
            slabs.slabs[name]
        with pytest.raises(asyncslab.IncompleteLoadError):
            await slabs.ready()  # no load running: fails at once instead of hanging


async def test_plan_for_other_files_is_refused(tmp_path: Path) -> None:
    a = write_synthetic(tmp_path / "a", SyntheticSpec(n_shards=1))
    b = write_synthetic(tmp_path / "b", SyntheticSpec(n_shards=1))
    ckpt_a, ckpt_b = Checkpoint.open(a.root), Checkpoint.open(b.root)
    async with SlabSet(plan(ckpt_a)) as slabs:
        with pytest.raises(asyncslab.PlanError, match="other files"):
            await slabs.load(ckpt_b)
        other_layout = write_synthetic(tmp_path / "c", SyntheticSpec(n_shards=1, n_experts=6))
        ckpt_c = Checkpoint.open(other_layout.root)
        with pytest.raises(asyncslab.PlanError, match="layout"):
            await slabs.load(ckpt_c, plan=plan(ckpt_c))


async def test_unit_callbacks_overlap_the_load(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    seen: list[str] = []

    async def on_unit(unit: str, slabs: SlabSet) -> None:
        # Inside the callback its unit is already usable.
        for name in p.units[unit]:
            slabs.slab(name)
        seen.append(unit)

    await load(ckpt, p, options=SMALL, on_unit_ready=on_unit)
    assert sorted(seen) == sorted(p.units)


async def test_failing_callback_fails_the_load(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)

    async def on_unit(unit: str, slabs: SlabSet) -> None:
        raise RuntimeError("post-processing broke")

    with pytest.raises(asyncslab.LoadError, match="callback failed") as info:
        await load(ckpt, p, on_unit_ready=on_unit)
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_ready_waits_for_a_background_load(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    async with SlabSet(p) as slabs:
        task = slabs.start(ckpt, options=SMALL)
        await slabs.ready("layers.2")
        assert slabs.slab(p.units["layers.2"][0]).numel() > 0
        await slabs.ready()
        assert await task is slabs


@pytest.mark.parametrize("observed", [True, False])
async def test_a_failure_ready_reported_is_not_logged_again_as_never_retrieved(
    moe_checkpoint: SyntheticCheckpoint, observed: bool
) -> None:
    """A server that starts a load and awaits ready() gets the failure there; asyncio must
    not log it again, as unseen, when the task goes. A failure nobody looked at still is."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    with loop_errors() as logged:
        slabs = SlabSet(plan(ckpt))

        def broken(_: asyncslab.LoadStatistics) -> None:
            raise RuntimeError("progress display broke")

        task = slabs.start(ckpt, options=SMALL, progress=broken)
        if observed:
            with pytest.raises(asyncslab.IncompleteLoadError, match="load failed") as info:
                await slabs.ready()
            assert isinstance(info.value.__cause__, asyncslab.LoadError)
            del info  # its traceback would keep the task alive past the test
        await asyncio.wait([task])  # its end, without retrieving its exception
        assert slabs.state == "failed"
        del slabs, task
        await asyncio.sleep(0)
        gc.collect()  # a failed load's tracebacks hold frames: cycles
    never = [c for c in logged if "never retrieved" in c.get("message", "")]
    assert len(never) == (0 if observed else 1)
    assert not [c for c in logged if c not in never]


async def test_a_slabset_loads_under_one_event_loop_after_another(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    """A synchronous caller runs each step in an asyncio.run of its own: the SlabSet, and
    ready() waiting in each, must not stay bound to the first loop."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))

    async def step() -> None:
        task = slabs.start(ckpt, options=SMALL)
        await slabs.ready()  # before the load's first step: it waits
        assert await task is slabs

    factories: list[Any] = [asyncio.new_event_loop]
    try:
        import uvloop

        factories.append(uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        pass

    def one_loop_after_another() -> list[str]:
        states = []
        for factory in [*factories, *factories]:
            if slabs.state != "empty":
                slabs.reset()
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(step())
            states.append(slabs.state)
        return states

    # In a thread of its own: asyncio.Runner needs a thread without a running loop.
    assert await asyncio.to_thread(one_loop_after_another) == ["complete"] * 2 * len(factories)
    assert_bit_identical(slabs, ckpt)


async def test_cancel_mid_load_leaks_nothing_and_retry_succeeds(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    fds_before, threads_before = open_fds(), len(io_threads())
    slabs = SlabSet(p)

    # Cancelled from the progress callback of the first landing: surely mid-load, and
    # nothing lands after a cancel. Polling for the first landing let the loop land on
    # meanwhile, as much as a loaded machine made the poll late.
    def cancel_at_first_landing(stats: asyncslab.LoadStatistics) -> None:
        if stats.tensors_landed and not task.cancelling():
            task.cancel()

    task = slabs.start(
        ckpt,
        options=LoadOptions(read_size=8 << 10, coalesce_gap=0, io_workers=2, progress_interval=0),
        progress=cancel_at_first_landing,
    )
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = slabs.statistics()
    assert stats.state == "cancelled"
    assert 0 < stats.tensors_landed < stats.tensors
    assert not slabs.complete
    assert open_fds() == fds_before
    assert len(io_threads()) == threads_before
    with pytest.raises(asyncslab.IncompleteLoadError, match="incomplete"):
        await slabs.ready()

    monkeypatch.undo()
    await slabs.load(ckpt)
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE, /proc")
async def test_too_many_shards_for_the_open_file_limit_is_a_clear_error(tmp_path: Path) -> None:
    """A load holds every shard open; past the process's limit the error says so, names
    the count and the limit, leaks no fd, and the same load succeeds once the limit allows."""
    import resource

    shards = 40
    for i in range(shards):
        tensor = torch.full((4, 4), float(i), dtype=torch.float16)
        name = f"model.layers.{i}.mlp.down_proj.weight"
        save_file({name: tensor}, str(tmp_path / f"model-{i:05d}-of-{shards:05d}.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt)
    slabs = SlabSet(p)
    before = open_fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + shards // 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(ReadError) as info:
            await slabs.load(ckpt)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    message = str(info.value)
    assert "Too many open files" in message
    assert f"keeps all {shards} shard files" in message
    assert f"may have {limit} files open" in message
    assert info.value.file is not None
    assert Path(info.value.file).parent == tmp_path
    assert slabs.state == "failed"
    assert open_fds() == before
    await slabs.load(ckpt)
    assert_bit_identical(slabs, ckpt)
    await slabs.aclose()


async def test_read_error_names_file_keeps_cause_and_retry_succeeds(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    calls = 0

    def flaky(fd: int, target: Scatter, offset: int, *, path: str) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            os_error = OSError(errno.EIO, "Input/output error")
            raise ReadError("read failed: Input/output error", file=path) from os_error
        return pread_scatter(fd, target, offset, path=path)

    monkeypatch.setattr(copy_module, "pread_scatter", flaky)
    fds_before = open_fds()
    async with SlabSet(p) as slabs:
        with pytest.raises(ReadError, match=r"model-0000\d-of-00003\.safetensors") as info:
            await slabs.load(ckpt, options=SMALL)
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EIO
        assert slabs.state == "failed"
        assert not slabs.complete
        assert open_fds() == fds_before
        monkeypatch.undo()
        await slabs.load(ckpt, options=SMALL)
        assert_bit_identical(slabs, ckpt)


async def test_real_eio_from_the_os_becomes_read_error(tmp_path: Path) -> None:
    # A directory fd makes preadv fail with EISDIR: a real OSError through the real path.
    buffer = torch.zeros(4, dtype=torch.uint8)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(ReadError, match="failed") as info:
            pread_scatter(fd, scatter([(buffer.data_ptr(), 4)]), 0, path="dir")
    finally:
        os.close(fd)
    assert isinstance(info.value.__cause__, OSError)


async def test_file_truncated_after_planning(fresh_moe: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(fresh_moe.root)
    p = plan(ckpt)
    victim = ckpt.files[1].path
    os.truncate(victim, ckpt.files[1].size - 100)
    with pytest.raises(asyncslab.errors.FileChangedError, match=victim.name):
        await load(ckpt, p)


async def test_file_rewritten_after_planning(fresh_moe: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(fresh_moe.root)
    p = plan(ckpt)
    victim = ckpt.files[0].path
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(asyncslab.errors.FileChangedError, match="changed since it was planned"):
        await load(ckpt, p)


async def test_file_shrinking_during_read_is_a_short_read(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"abc")
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = torch.zeros(8, dtype=torch.uint8)
        with pytest.raises(ReadError, match="ended early"):
            pread_scatter(fd, scatter([(buffer.data_ptr(), 8)]), 0, path=str(path))
    finally:
        os.close(fd)


async def test_stalled_read_times_out_and_marks_slabs_unusable(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    slow_reads(monkeypatch, 1.0)
    slabs = SlabSet(p)
    with pytest.raises(asyncslab.errors.ReadTimeoutError, match="read_timeout=0.05"):
        await slabs.load(ckpt, options=LoadOptions(read_timeout=0.05))
    # The stalled thread may still write into these slabs, so they refuse another load.
    with pytest.raises(asyncslab.LoadError, match="cannot be reused"):
        await slabs.load(ckpt)
    await slabs.aclose()
    # The stalled reads end on their own: wait for that (a hang guard, not a 2 s budget),
    # so that no thread of this test is still out when the next one counts threads.
    assert await wait_io_threads_gone() == []


@pytest.mark.parametrize("transfer", ["direct", "staged", "mapped"])
async def test_a_dropped_slabset_frees_its_slabs_without_the_garbage_collector(
    moe_checkpoint: SyntheticCheckpoint, transfer: str
) -> None:
    """A server that swaps models drops the old SlabSet and allocates the next: the old
    slabs must go with the last reference, not with a collection that may come minutes
    later (on a GPU, the next model's allocation would fail meanwhile)."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = replace(SMALL, transfer=transfer)  # type: ignore[arg-type]
    with gc_paused():  # the collector off: only reference counts free
        loaded = await load(ckpt, p, options=options)
        started = SlabSet(p)
        task = started.start(ckpt, options=options)
        assert await task is started
        assert loaded.state == started.state == "complete"
        backings = [weakref.ref(loaded._memory.backing), weakref.ref(started._memory.backing)]
        del loaded, started, task
        # The loop's handle that resumed this step still holds the task it awaited (and
        # so its result) until the step ends.
        await asyncio.sleep(0)
        assert [b() for b in backings] == [None, None]


async def test_closed_slabset(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = await load(ckpt, plan(ckpt))
    await slabs.aclose()
    await slabs.aclose()  # idempotent
    with pytest.raises(asyncslab.ClosedError):
        slabs.slab(next(iter(slabs.plan.slabs)))


async def test_event_loop_stays_responsive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = write_synthetic(tmp_path, asyncslab.testing.spec_for_size(48 << 20))
    ckpt = Checkpoint.open(written.root)
    p = plan(ckpt)
    lags: list[float] = []
    done = asyncio.Event()
    ticked = threading.Event()  # the ticker had two turns

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)
            if len(lags) >= 2:
                ticked.set()

    # The loop kept running while bytes moved: the first read waits in its thread until
    # the ticker has had two turns, which only a loop not blocked by the load can give it
    # (counting the turns a load happened to last depended on how fast the machine was).
    first = threading.Lock()
    waited: list[bool] = []

    def after_two_ticks(*args: Any, **kwargs: Any) -> int:
        if first.acquire(blocking=False):
            waited.append(ticked.wait(HANG_S))
        return pread_scatter(*args, **kwargs)

    monkeypatch.setattr(copy_module, "pread_scatter", after_two_ticks)
    tick = asyncio.create_task(ticker())
    slabs = await load(ckpt, p)
    done.set()
    await tick
    assert_bit_identical(slabs, ckpt)
    assert waited == [True]  # the ticker got turns during the load
    assert len(lags) >= 2
    lags.sort()
    print(
        f"\nevent-loop lag during a {p.nbytes / 2**20:.0f} MiB load: "
        f"p50 {lags[len(lags) // 2] * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms, "
        f"{len(lags)} ticks"
    )


async def test_duplicate_landing_is_an_error(moe_checkpoint: SyntheticCheckpoint) -> None:
    from asyncslab.loading._tracker import Tracker

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    tracker = Tracker(p)
    tracker.begin(None)
    route = p.routes[0]
    tracker.land(0, route.nbytes)
    with pytest.raises(asyncslab.DuplicateLandingError, match=route.tensor):
        tracker.land(0, route.nbytes)


async def test_duplicate_read_in_schedule_fails_the_load(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncslab.loading import _strategy_direct as _direct
    from asyncslab.loading._schedule import Schedule, schedule

    def doubled(*args: object, **kwargs: object) -> Schedule:
        s = schedule(*args, **kwargs)  # type: ignore[arg-type]
        return Schedule(s.ops + s.ops[:1], s.empty, s.bytes_needed, s.bytes_read)

    monkeypatch.setattr(_direct, "schedule", doubled)
    ckpt = Checkpoint.open(moe_checkpoint.root)
    with pytest.raises(asyncslab.DuplicateLandingError, match="landed twice"):
        await load(ckpt, plan(ckpt), options=LoadOptions(io_workers=1))


async def test_staged_path_respects_the_budget(moe_checkpoint: SyntheticCheckpoint) -> None:
    """The staging buffers (what a CUDA target uses) exercised on CPU: tensors larger than a
    buffer move in chunks, and staging in use never exceeds the budget."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=3 * (16 << 10), staging_buffers=3)
    assert max(r.nbytes for r in p.routes) > options.staging_bytes  # forces chunking
    slabs = await load(ckpt, p, options=options)
    assert_bit_identical(slabs, ckpt)
    stats = slabs.statistics()
    assert stats.transfer == "staged"
    assert stats.staging_budget == options.staging_bytes
    assert 0 < stats.staging_peak <= options.staging_bytes


async def test_staged_reads_fit_buffers_rounded_down_as_pinned_ones_are(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned staging buffers are a power of two each, rounded down (see staging_budget):
    the reads must be cut to the buffer as made, not to the size asked, or they would run
    past its end. On the CPU, with the rounding a CUDA target gets."""
    from asyncslab.loading import _strategy_staged as _staged

    real = _staged.staging_budget
    monkeypatch.setattr(
        _staged, "staging_budget", lambda budget, buffers, pinned: real(budget, buffers, True)
    )
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=3 * (48 << 10), staging_buffers=3)
    slabs = await load(ckpt, p, options=options)
    assert_bit_identical(slabs, ckpt)
    stats = slabs.statistics()
    assert stats.staging_budget == 3 * (32 << 10)
    assert 0 < stats.staging_peak <= stats.staging_budget
    await slabs.aclose()


async def test_a_staged_read_never_writes_past_its_buffer(tmp_path: Path) -> None:
    from asyncslab.loading._copy import read_staged
    from asyncslab.loading._schedule import ReadOp

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 4)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = torch.zeros(64, dtype=torch.uint8)
        op = ReadOp(file=0, offset=0, nbytes=65, pieces=())
        with pytest.raises(ValueError, match="a read of 65 bytes into a 64-byte buffer"):
            read_staged(fd, op, buffer, str(path))
        assert int(buffer.count_nonzero()) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("copy_all", ["torch", "per piece"])
async def test_staged_reads_take_one_syscall_and_one_copy_call_each(
    moe_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    copy_all: str,
) -> None:
    """Each staged read fills its buffer in one syscall, however small SYSCALL_BYTES is,
    and moves all its pieces in one list copy (or, without torch's, one copy per piece):
    the bytes land exactly either way."""
    from asyncslab.loading import _read as read_module

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=4 * (256 << 10), staging_buffers=4)
    monkeypatch.setattr(read_module, "SYSCALL_BYTES", 4096)  # direct reads would cut here
    syscalls: list[int] = []
    raw = read_module._preadv_raw

    def counting(fd: int, iov: int, entries: int, offset: int) -> int:
        syscalls.append(entries)
        return raw(fd, iov, entries, offset)

    monkeypatch.setattr(read_module, "_preadv_raw", counting)
    lists: list[int] = []
    if copy_all == "per piece":
        monkeypatch.setattr(copy_module, "_copy_all", copy_module._copy_each)
    else:
        real = copy_module._copy_all

        def one_call(dst: list[torch.Tensor], src: list[torch.Tensor], **kw: bool) -> None:
            lists.append(len(dst))
            real(dst, src, **kw)

        monkeypatch.setattr(copy_module, "_copy_all", one_call)
    slabs = await load(ckpt, p, options=options)
    assert_bit_identical(slabs, ckpt)
    reads = slabs.statistics().reads
    assert len(syscalls) == reads  # no read was cut (nor short) on a regular file
    assert all(entries == 1 for entries in syscalls)
    if copy_all == "torch":
        assert len(lists) == reads
        assert sum(lists) == sum(len(op.pieces) for op in _schedule_ops(p, options))


def _schedule_ops(p: asyncslab.Plan, options: LoadOptions) -> list[Any]:
    from asyncslab.loading._schedule import schedule

    size = options.staging_bytes // options.staging_buffers
    return list(schedule(p, max_read=size, gap=options.coalesce_gap).ops)


async def test_staged_load_pins_one_buffer_per_thread_on_the_threads(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many more reads than buffers: each I/O thread makes its buffer once, off the event
    loop, and reuses it; the bytes land exactly."""
    from asyncslab.loading import _strategy_staged as _staged

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=3 * (16 << 10), staging_buffers=3)
    real = _staged.staging_buffer
    makers: list[str] = []

    def recording(size: int, pin: bool) -> torch.Tensor:
        makers.append(threading.current_thread().name)
        return real(size, pin)

    monkeypatch.setattr(_staged, "staging_buffer", recording)
    slabs = await load(ckpt, p, options=options)
    assert_bit_identical(slabs, ckpt)
    assert slabs.statistics().reads > 3 * len(makers)
    assert 1 <= len(makers) <= 3
    assert len(set(makers)) == len(makers)  # one each
    assert all(name.startswith("asyncslab-io_") for name in makers)


async def test_a_failing_staged_copy_fails_the_load_naming_the_read(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy out of a staging buffer that raises (on a GPU: a CUDA error) fails the load
    with an error naming the file, offset and first tensor of that read; nothing is left
    behind and the next load into the same SlabSet works."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=3 * (16 << 10), staging_buffers=3)
    real = copy_module.CpuCopier.copy
    calls = [0]

    def third_fails(self: Any, op: Any, *args: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(self, op, *args)

    fds_before = open_fds()
    async with SlabSet(p) as slabs:
        monkeypatch.setattr(copy_module.CpuCopier, "copy", third_fails)
        with pytest.raises(asyncslab.LoadError, match="illegal memory access") as info:
            await slabs.load(ckpt, options=options)
        err = info.value
        assert "copy to cpu of the read of" in str(err)
        assert isinstance(err.__cause__, RuntimeError)
        route = p.routes[[r.tensor for r in p.routes].index(err.tensor)]
        assert err.file == str(route.file)
        assert route.src_offset <= err.details["offset"] < route.src_offset + route.nbytes
        assert (err.details["slab"], err.details["slot"]) == (route.slab, route.slot)
        assert slabs.state == "failed"
        assert staging_released(slabs)
        assert open_fds() == fds_before
        assert not io_threads()
        monkeypatch.setattr(copy_module.CpuCopier, "copy", real)
        slabs.reset()
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)


async def test_a_staging_buffer_that_cannot_be_made_fails_the_load_cleanly(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinning happens during the load now (a buffer when a read first needs it): if it
    fails while another thread holds a buffer, the load fails with that error, leaves no fd
    or thread behind, and the next load into the same SlabSet works."""
    from asyncslab.loading import _strategy_staged as _staged

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    options = LoadOptions(transfer="staged", staging_bytes=4 * (64 << 10), staging_buffers=4)
    real = _staged.staging_buffer
    lock = threading.Lock()
    made = [0]
    second_asked = threading.Event()

    def second_fails(size: int, pin: bool) -> torch.Tensor:
        with lock:
            made[0] += 1
            n = made[0]
        if n == 1:
            # Threads take reads themselves: one thread could do them all and no second
            # buffer be asked for. Holding the first thread here leaves the reads to others.
            if not second_asked.wait(HANG_S):
                raise AssertionError("no second thread asked for a staging buffer")
        elif n == 2:
            second_asked.set()
            raise RuntimeError("cannot pin 64 KiB")
        return real(size, pin)

    fds_before = open_fds()
    async with SlabSet(p) as slabs:
        monkeypatch.setattr(_staged, "staging_buffer", second_fails)
        with pytest.raises(asyncslab.LoadError, match="cannot pin 64 KiB"):
            await slabs.load(ckpt, options=options)
        assert slabs.state == "failed"
        assert open_fds() == fds_before
        assert not io_threads()
        monkeypatch.setattr(_staged, "staging_buffer", real)
        slabs.reset()
        await slabs.load(ckpt, options=options)
        assert_bit_identical(slabs, ckpt)


async def test_slab_mapping_membership_does_not_need_completeness(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    async with SlabSet(p) as slabs:
        name = next(iter(p.slabs))
        assert name in slabs.slabs
        assert "no such slab" not in slabs.slabs
        assert list(slabs.slabs) == list(p.slabs)
        assert "state='empty'" in repr(slabs)


@pytest.mark.parametrize("staged", [False, True])
async def test_paced_load_reports_progress_and_needed_bytes_at_once(
    moe_checkpoint: SyntheticCheckpoint, staged: bool
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    seen: list[int] = []
    async with SlabSet(p) as slabs:
        rate = p.nbytes / 0.3  # about 0.3 s for the whole load
        options = LoadOptions(read_size=64 << 10, max_bytes_per_s=rate, progress_interval=0)
        if staged:  # the same reads through the staging buffers
            options = replace(
                options, transfer="staged", staging_bytes=4 * (64 << 10), staging_buffers=4
            )
        task = slabs.start(ckpt, options=options, progress=lambda s: seen.append(s.bytes_landed))
        assert slabs.statistics().bytes_needed == p.nbytes  # known before the task runs
        await task
    assert seen == sorted(seen)
    assert len(seen) > 5
    assert seen[-1] == p.nbytes


async def test_slot_refuses_what_is_not_an_in_range_slot(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    slabs = await load(ckpt, p)
    name = next(n for n, s in p.slabs.items() if s.labels.get("projection") == "w13")
    dims = p.slabs[name].slot_dims
    assert slabs.slot(name, (1,)).shape == (dims[1], *p.slabs[name].item_shape)
    for bad in [(2, 0), (0, -1), [0, 0], (0, 0, 0), (True, 0)]:
        with pytest.raises(IndexError, match="outside slab"):
            slabs.slot(name, bad)  # type: ignore[arg-type]


async def test_slabs_share_one_aligned_allocation(tmp_path: Path) -> None:
    """Every slab is a view of one allocation, at its own 64-byte-aligned range; nothing
    overlaps, and a reload writes the same memory."""
    tensors = {
        "a": torch.arange(3, dtype=torch.int8),
        "b": torch.arange(5, dtype=torch.float64),
        "c": torch.zeros(0, 7, dtype=torch.float16),
        "d": torch.arange(12, dtype=torch.int16).reshape(3, 4),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    slabs = await load(ckpt, plan(ckpt))
    views = {name: slabs.slab(name) for name in slabs.plan.slabs}
    storages = {v.untyped_storage().data_ptr() for v in views.values()}
    assert len(storages) == 1
    ranges = sorted((v.data_ptr(), v.data_ptr() + v.nbytes) for v in views.values())
    assert all(start % 64 == 0 for start, _ in ranges)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False))
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor)
    await slabs.aclose()


async def test_unrepresentable_zero_size_slab_is_refused_at_allocation(tmp_path: Path) -> None:
    """``[0, 2**63]`` of U8 is a valid header (zero bytes) but no torch tensor can have it."""
    header = b'{"z":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'
    (tmp_path / "z.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    ckpt = Checkpoint.open(tmp_path / "z.safetensors")
    with pytest.raises(asyncslab.LoadError, match=r"cannot make slab 'z'"):
        SlabSet(plan(ckpt))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("io_nice", [19, 10, 0])
async def test_io_threads_run_niced_and_the_loop_does_not(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch, io_nice: int
) -> None:
    """Reads run on threads whose nice value is raised by ``io_nice``; the event-loop thread
    (and the process) keep theirs."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def recording(*args: object, **kwargs: object) -> int:
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # 0: the calling thread, on Linux
        return pread_scatter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(copy_module, "pread_scatter", recording)
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = await load(ckpt, plan(ckpt), options=LoadOptions(io_nice=io_nice, read_size=64 << 10))
    assert len(seen) == slabs.statistics().reads > 1
    assert set(seen) == {min(19, base + io_nice)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    await slabs.aclose()


@pytest.mark.parametrize("io_nice", [-1, 20])
async def test_io_nice_out_of_range_is_refused(io_nice: int) -> None:
    with pytest.raises(ValueError, match="io_nice"):
        LoadOptions(io_nice=io_nice)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"read_timeout": 0}, ValueError, "read_timeout must be positive seconds, or None"),
        ({"read_timeout": -1.0}, ValueError, "read_timeout must be positive"),
        ({"read_timeout": math.nan}, ValueError, "read_timeout must be positive"),
        ({"read_timeout": "5"}, TypeError, "read_timeout must be a number or None, got '5'"),
        ({"read_size": 1.5}, TypeError, "read_size must be an int, got 1.5"),
        ({"io_workers": 2.5}, TypeError, "io_workers must be an int, got 2.5"),
        ({"streams": True}, TypeError, "streams must be an int, got True"),
        ({"coalesce_gap": None}, TypeError, "coalesce_gap must be an int, got None"),
        ({"progress_interval": None}, TypeError, "progress_interval must be a number, got None"),
        ({"max_bytes_per_s": "1e9"}, TypeError, "max_bytes_per_s must be a number or None"),
        ({"max_bytes_per_s": math.nan}, ValueError, "max_bytes_per_s must be positive"),
    ],
)
async def test_load_options_refuse_wrong_values_naming_the_option(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Refused when made, naming the option: a float count failed deep inside a load as a
    bare TypeError, and read_timeout=0 (elsewhere often "no timeout") failed every read and
    left the SlabSet unusable."""
    with pytest.raises(error, match=re.escape(message)):
        LoadOptions(**options)


async def test_load_options_take_integers_of_any_kind_as_ints() -> None:
    import numpy as np

    options = LoadOptions(io_workers=np.int64(3), read_size=np.int32(4096), read_timeout=None)
    assert (options.io_workers, options.read_size) == (3, 4096)
    assert type(options.io_workers) is int
    assert type(options.read_size) is int
    assert LoadOptions(read_timeout=math.inf).read_timeout == math.inf


async def test_an_unknown_unit_is_refused_showing_the_plans_units(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    async with SlabSet(p) as slabs:
        task = slabs.start(ckpt)
        # Waited for while loading, and once loaded: both name the units there are.
        with pytest.raises(KeyError, match=r"unit 'layer\.1' is not in the plan; its \d+ units: "):
            await slabs.ready("layer.1")
        await task
        with pytest.raises(KeyError) as info:
            await slabs.ready("layer.1")
    message = str(info.value)
    assert f"its {len(p.units)} units: " in message
    assert "'globals'" in message
    assert "'layers.1'" in message


async def test_failing_callback_stops_landing_without_orphan_callbacks(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """Reads still in flight when a unit callback fails land nothing more: no callback
    coroutine is created for the task group that is shutting down (it would never be
    awaited), and callbacks ran only for units that completed."""
    import gc
    import warnings

    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt)
    called: list[str] = []

    async def on_unit(unit: str, slabs: SlabSet) -> None:
        called.append(unit)
        raise RuntimeError("post-processing broke")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):  # the window is a few reads wide: try it repeatedly
            slabs = SlabSet(p)
            with pytest.raises(asyncslab.LoadError, match="callback failed"):
                await slabs.load(ckpt, options=SMALL, on_unit_ready=on_unit)
            completed = set(slabs.statistics().unit_completed_at)
            assert set(called) <= completed
            await slabs.aclose()
            called.clear()
        gc.collect()
    never_awaited = [w for w in caught if "never awaited" in str(w.message)]
    assert never_awaited == []


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
async def test_fp8_fnuz_tensors_load_bit_exact(tmp_path: Path, name: str) -> None:
    # Refused as an unknown dtype before, though the reference writes and reads them.
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"this torch has no {name}")
    raw = torch.arange(60, dtype=torch.uint8).reshape(3, 20)
    tensors = {"w": raw.view(dtype), "s": raw[0, :1].clone().view(dtype).reshape(())}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    async with await load(ckpt, plan(ckpt)) as slabs:
        for key, t in tensors.items():
            got = slabs.view(key)
            assert got.dtype == dtype
            assert got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads threads' names in /proc")
@pytest.mark.parametrize("copier", ["HostCopier", "CpuCopier"])
async def test_host_copies_start_no_thread(copier: str) -> None:
    """An I/O thread of a load from object storage onto the CPU copies a response's pieces
    itself (HostCopier, host_copy): with torch's intra-op threads at 4, it starts no thread.
    The control, torch's copy of the same pieces (CpuCopier), starts an OpenMP team for the
    calling thread where torch runs on OpenMP. Threads are told apart by name: a new thread
    inherits its creator's."""
    if copier == "CpuCopier" and not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP: no team to start")
    from asyncslab.loading._schedule import ReadOp

    mib = 1 << 20
    buffer = torch.randint(0, 256, (2 * mib,), dtype=torch.uint8)
    backing = torch.zeros(4 * mib, dtype=torch.uint8)
    op = ReadOp(file=0, offset=0, nbytes=2 * mib, pieces=((0, 0, 0, mib), (1, mib, 4096, mib)))
    name = f"copytest{os.getpid() % 10000}"
    named: list[int] = []

    def copy() -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name)
        getattr(copy_module, copier)().copy(op, buffer, [backing, backing], [0, 2 * mib], 0)
        # Counted while this thread lives: a team stays with the thread that started it.
        named.append(sum(1 for t in Path("/proc/self/task").iterdir() if _comm(t) == name))

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        worker = threading.Thread(target=copy)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    if copier == "HostCopier":
        assert named == [1]
    else:
        assert named[0] > 1
    assert torch.equal(backing[:mib], buffer[:mib])
    assert torch.equal(backing[2 * mib + 4096 : 3 * mib + 4096], buffer[mib:])
    assert int(backing[mib : 2 * mib + 4096].count_nonzero()) == 0


def _comm(task: Path) -> str | None:
    try:
        return (task / "comm").read_text().strip()
    except OSError:  # the thread ended meanwhile
        return None


async def test_a_host_copy_outside_its_buffer_or_slab_is_refused_not_written() -> None:
    from asyncslab.loading._schedule import ReadOp

    buffer = torch.ones(64, dtype=torch.uint8)
    backing = torch.zeros(128, dtype=torch.uint8)
    copier = copy_module.HostCopier()
    past_buffer = ReadOp(file=0, offset=0, nbytes=64, pieces=((0, 32, 0, 33),))
    with pytest.raises(ValueError, match="33 bytes from offset 32 of a 64-byte buffer"):
        copier.copy(past_buffer, buffer, [backing], [0], 0)
    past_slab = ReadOp(file=0, offset=0, nbytes=64, pieces=((0, 0, 100, 29),))
    with pytest.raises(ValueError, match="into offset 100 of a 128-byte slab"):
        copier.copy(past_slab, buffer, [backing], [0], 0)
    assert int(backing.count_nonzero()) == 0

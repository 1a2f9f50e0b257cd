"""A SlabSet's life in a server: closing, retrying, waiting and calling back while other
tasks do the same. Each test here failed before the fix it names (see docs/robustness.md)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import itertools
import json
import math
import re
import shutil
import threading
import time
import traceback
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab._heap import gc_paused
from asyncslab.loading import _copy as copy_module
from asyncslab.loading._read import pread_scatter
from asyncslab.planning import route_column
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, write_synthetic
from support.faults import HANG_S
from tests.helpers import assert_bit_identical, io_threads, loop_errors, open_fds, slow_reads, until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

# Many small reads on four threads: a load is dozens of reads, several in flight.
SMALL = LoadOptions(read_size=4 << 10, coalesce_gap=0, io_workers=4)


def failing_first_read(
    monkeypatch: pytest.MonkeyPatch,
    *,
    others_take: float = 0.0,
    hold: threading.Event | None = None,
) -> None:
    """The first read of the process fails at once; every other read takes ``others_take``
    seconds more. Given ``hold``, the first read fails only once another is in its thread,
    and every other read waits for ``hold`` to be set: reads are then still in their threads
    when the failure is reported, whatever the scheduler does."""
    calls = itertools.count()
    other_started = threading.Event()

    def read(*args: Any, **kwargs: Any) -> int:
        if next(calls) == 0:
            time.sleep(0.02)
            if hold is not None:
                assert other_started.wait(HANG_S)
            raise asyncslab.errors.ReadError("injected EIO", file=kwargs["path"])
        other_started.set()
        if hold is not None:
            assert hold.wait(HANG_S)
        time.sleep(others_take)
        return pread_scatter(*args, **kwargs)

    monkeypatch.setattr(copy_module, "pread_scatter", read)


async def test_concurrent_acloses_free_the_slabs_only_once_no_read_is_left(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two shutdown paths (a signal handler, the lifespan's exit) each close the slabs. The
    # second used to find no task and free the slabs at once, under running reads (a tensor
    # allocated next received their bytes).
    ckpt = Checkpoint.open(small_checkpoint.root)
    in_flight = slow_reads(monkeypatch, 0.1)
    slabs = SlabSet(plan(ckpt))
    task = slabs.start(ckpt, options=SMALL)
    await until(in_flight.is_set)  # a read is in flight (a fixed sleep only hoped so)
    seen: list[tuple[bool, list[str]]] = []

    async def close() -> None:
        await slabs.aclose()
        seen.append((task.done(), [t.name for t in io_threads()]))

    await asyncio.gather(close(), close())
    assert seen == [(True, []), (True, [])]
    assert slabs._memory.backing.numel() == 0
    assert task.cancelled()


async def test_aclose_right_after_a_retry_waits_for_the_failed_load_to_drain(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ready() reports a failure while that load still drains its threads; a retry is started
    # and the server shuts down before the retry's first step. aclose() used to wait for the
    # retry only, freeing the slabs under the failed load's reads.
    # The failed load's other reads are held until the retry has been cancelled and the
    # loop has gone round a few times more: an aclose() that waited for the retry only has
    # returned by then, with those reads still out (a fixed 0.3 s read left that race to
    # the scheduler).
    ckpt = Checkpoint.open(small_checkpoint.root)
    hold = threading.Event()
    failing_first_read(monkeypatch, hold=hold)
    slabs = SlabSet(plan(ckpt))
    failed = slabs.start(ckpt, options=SMALL)
    with pytest.raises(asyncslab.IncompleteLoadError) as info:
        await slabs.ready()
    assert isinstance(info.value.__cause__, asyncslab.errors.ReadError)
    assert not failed.done()  # still draining
    retry = slabs.start(ckpt, options=SMALL)

    async def release_once_the_retry_is_gone() -> None:
        try:
            await until(retry.done)
            for _ in range(20):
                await asyncio.sleep(0)
        finally:
            hold.set()

    releaser = asyncio.ensure_future(release_once_the_retry_is_gone())
    await slabs.aclose()
    await releaser
    assert failed.done()
    assert io_threads() == []
    assert retry.cancelled()


async def test_aclose_from_a_unit_callback_is_refused_instead_of_waiting_for_itself(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # aclose() cancels and waits for the load, whose task group waits for this callback:
    # that hung the load, the slabs and the process's exit.
    ckpt = Checkpoint.open(small_checkpoint.root)
    fds = open_fds()
    slabs = SlabSet(plan(ckpt))

    async def on_unit(unit: str, s: SlabSet) -> None:
        await s.aclose()

    async with asyncio.timeout(HANG_S / 2):  # a hang guard
        with pytest.raises(asyncslab.LoadError, match="from an on_unit_ready callback"):
            await slabs.load(ckpt, options=SMALL, on_unit_ready=on_unit)
    assert slabs.state == "failed"
    assert io_threads() == []
    assert open_fds() == fds
    await slabs.aclose()  # from outside a callback: closes
    with pytest.raises(asyncslab.ClosedError):
        slabs.slab(next(iter(slabs.plan.slabs)))


async def test_start_outside_an_event_loop_leaves_the_slabset_as_it_was(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # start() marked the SlabSet "loading" before finding no loop to run in: every later
    # load was "already running" and reset() refused, for good.
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))
    with pytest.raises(RuntimeError, match="no running event loop"):
        await asyncio.to_thread(slabs.start, ckpt)
    assert slabs.state == "empty"
    await slabs.load(ckpt, options=SMALL)
    assert_bit_identical(slabs, ckpt)


def _swap_two_experts_across_tiers(src: Path, dst: Path) -> str:
    """A copy of ``src`` in which two experts of one layer, in different tiers, swap names:
    the same slab layout, other slots for their tensors. Returns one renamed tensor."""
    ckpt = Checkpoint.open(src)
    slab_of: dict[tuple[int, int], str] = {}
    for route in plan(ckpt).routes:
        m = re.fullmatch(
            r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.trellis", route.tensor
        )
        if m:
            slab_of[(int(m[1]), int(m[2]))] = route.slab
    layer, a, b = next(
        (la, ea, eb)
        for (la, ea), sa in sorted(slab_of.items())
        for (lb, eb), sb in sorted(slab_of.items())
        if la == lb and eb > ea and sa != sb
    )
    first, second = (
        f"model.layers.{layer}.mlp.experts.{a}.",
        f"model.layers.{layer}.mlp.experts.{b}.",
    )

    def renamed(name: str) -> str:
        if name.startswith(first):
            return second + name[len(first) :]
        if name.startswith(second):
            return first + name[len(second) :]
        return name

    dst.mkdir()
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                tensors = {renamed(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                metadata = f.metadata()
            save_file(tensors, str(dst / path.name), metadata=metadata)
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
            if "weight_map" in data:
                data["weight_map"] = {renamed(k): v for k, v in data["weight_map"].items()}
            (dst / path.name).write_text(json.dumps(data))
    return first + "up_proj.trellis"


async def test_view_and_statistics_follow_the_plan_of_the_last_load(tmp_path: Path) -> None:
    # A load with plan= (same slab layout, other routes) used to leave view() on the plan
    # the slabs were made for: wrong shapes and wrong bytes for the tensors that moved.
    spec = SyntheticSpec(n_layers=3, n_experts=8, hidden=64, intermediate=32, vocab=128, seed=0)
    a = write_synthetic(tmp_path / "a", spec)
    moved = _swap_two_experts_across_tiers(a.root, tmp_path / "b")
    ckpt_a, ckpt_b = Checkpoint.open(a.root), Checkpoint.open(tmp_path / "b")
    plan_a, plan_b = plan(ckpt_a), plan(ckpt_b)
    assert plan_a.layout_fingerprint == plan_b.layout_fingerprint
    assert plan_a.where(moved) != plan_b.where(moved)
    slabs = await asyncslab.load(ckpt_a, plan_a)
    await slabs.load(ckpt_b, plan=plan_b)
    assert slabs.plan is plan_a  # the slabs' layout
    assert_bit_identical(slabs, ckpt_b)  # through view(), tensor by tensor
    stats = slabs.statistics()
    assert (stats.files, stats.tensors) == (len(plan_b.files), len(plan_b.routes))
    await slabs.aclose()


async def test_ready_returns_once_the_load_ended_so_a_reload_may_start_at_once(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))
    slabs.start(ckpt, options=SMALL)
    await slabs.ready()
    assert slabs.state == "complete"  # was "loading": threads and files not yet released
    slabs.reset()  # refused before: "a load is running"
    await slabs.load(ckpt, options=SMALL)
    assert_bit_identical(slabs, ckpt)


@pytest.mark.parametrize("how", ["callback fails", "progress fails at the end", "cancelled"])
async def test_ready_raises_when_the_load_breaks_after_every_unit_landed(
    small_checkpoint: SyntheticCheckpoint, how: str
) -> None:
    # The slabs are exact, but what the server does with them (a unit callback) did not
    # finish: ready() used to return as if the load had succeeded.
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    slabs = SlabSet(p)
    landed = asyncio.Event()
    units_done: list[str] = []

    async def on_unit(unit: str, s: SlabSet) -> None:
        units_done.append(unit)
        if len(units_done) < len(p.units):
            return
        landed.set()
        if how == "callback fails":
            raise ValueError("post-processing broke")
        if how == "cancelled":
            await asyncio.sleep(30)  # cancelled below

    def progress(stats: asyncslab.LoadStatistics) -> None:
        if how == "progress fails at the end" and stats.state == "complete":
            raise ValueError("progress display broke")

    task = slabs.start(ckpt, options=SMALL, on_unit_ready=on_unit, progress=progress)
    if how == "cancelled":
        await landed.wait()
        task.cancel()
    with pytest.raises(asyncslab.IncompleteLoadError, match="after its units landed") as info:
        await slabs.ready()
    assert slabs.complete  # every unit landed
    if how == "cancelled":
        assert slabs.state == "cancelled"
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
    else:
        assert slabs.state == "failed"
        assert isinstance(info.value.__cause__, asyncslab.LoadError)
        assert isinstance(info.value.__cause__.__cause__, ValueError)
    await asyncio.wait([task])
    # Per unit, ready() still returns: each unit's bytes are complete and exact.
    await slabs.ready(next(iter(p.units)))


async def test_a_failing_final_progress_call_fails_the_load_as_any_progress_call(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # load() used to raise the bare ValueError while the state said "complete".
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))

    def progress(stats: asyncslab.LoadStatistics) -> None:
        if stats.state == "complete":
            raise ValueError("progress display broke")

    with pytest.raises(asyncslab.LoadError, match="load failed: ValueError") as info:
        await slabs.load(ckpt, options=SMALL, progress=progress)
    assert isinstance(info.value.__cause__, ValueError)
    assert slabs.state == "failed"
    assert "progress display broke" in (slabs.statistics().error or "")


async def test_a_unit_callback_that_ends_cancelled_fails_the_load(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # A callback awaiting something that was cancelled ends in CancelledError of its own; a
    # task group takes that for a clean end, and the load reported complete with that
    # unit's post-processing never done.
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    unit = sorted(p.units)[1]

    async def on_unit(u: str, s: SlabSet) -> None:
        if u == unit:
            gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            gone.cancel()
            await gone

    slabs = SlabSet(p)
    with pytest.raises(
        asyncslab.LoadError, match=f"callback for unit '{re.escape(unit)}' was cancelled"
    ):
        await slabs.load(ckpt, options=SMALL, on_unit_ready=on_unit)
    assert slabs.state == "failed"


async def test_a_late_ready_after_a_failure_has_its_cause_and_nothing_is_logged(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A health check calling ready() after the load failed got no cause, and asyncio logged
    # the load task's error as never retrieved although ready() had reported it.
    ckpt = Checkpoint.open(small_checkpoint.root)
    failing_first_read(monkeypatch, others_take=0.0)
    with loop_errors() as logged:
        slabs = SlabSet(plan(ckpt))
        task = slabs.start(ckpt, options=SMALL)
        await asyncio.wait([task])  # ended, its error not retrieved
        assert slabs.state == "failed"
        with pytest.raises(asyncslab.IncompleteLoadError, match="is incomplete") as info:
            await slabs.ready()
        assert isinstance(info.value.__cause__, asyncslab.errors.ReadError)
        del info, task, slabs
        await asyncio.sleep(0)
        gc.collect()  # a failed load's tracebacks hold frames: cycles
    assert logged == []


async def test_cancelled_ready_callers_leave_no_waiter_behind(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # ready() waits on a future of its own per call: callers cancelled mid-wait leave none
    # behind, and a later caller is still woken.
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))
    task = slabs.start(ckpt, options=replace(SMALL, max_bytes_per_s=200_000))
    cancelled = [asyncio.ensure_future(slabs.ready()) for _ in range(5)]
    # Cancelled mid-wait: once each has registered its waiter (not after a fixed sleep).
    await until(lambda: sum(len(w) for w in slabs._memory.tracker._waiters.values()) == 5)
    assert not any(w.done() for w in cancelled)
    for waiter in cancelled:
        waiter.cancel()
    await asyncio.gather(*cancelled, return_exceptions=True)
    assert sum(len(w) for w in slabs._memory.tracker._waiters.values()) == 0
    await slabs.ready()
    assert await task is slabs


@pytest.mark.parametrize("retry", ["succeeds", "fails"])
async def test_ready_judges_the_slabs_after_a_retry_began_while_it_waited(
    small_checkpoint: SyntheticCheckpoint, retry: str
) -> None:
    # The load failed after every unit landed; its caller reset the slabs and started a
    # retry before a health check's ready() resumed, and ready() returned normally with no
    # unit complete (it looked at the new load's state, not for its end).
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    slabs = SlabSet(p)
    calls: list[str] = []

    async def on_unit(unit: str, s: SlabSet) -> None:
        calls.append(unit)
        last = len(calls) % len(p.units) == 0  # each load's last unit
        if last and (len(calls) == len(p.units) or retry == "fails"):
            raise ValueError("post-processing broke")

    async def loader() -> None:
        with pytest.raises(asyncslab.LoadError):
            await slabs.load(ckpt, options=SMALL, on_unit_ready=on_unit)
        slabs.reset()
        again = slabs.start(ckpt, options=SMALL, on_unit_ready=on_unit)
        with contextlib.suppress(asyncslab.LoadError):
            await again

    async def health() -> str:
        await asyncio.sleep(0)  # waits while the first load runs
        try:
            await slabs.ready()
        except asyncslab.IncompleteLoadError:
            return f"raised, complete={slabs.complete}"
        return f"returned, complete={slabs.complete}, state={slabs.state}"

    _, seen = await asyncio.gather(loader(), health())
    if retry == "succeeds":
        assert seen == "returned, complete=True, state=complete"
    else:
        assert seen == "raised, complete=True"  # every unit landed, the retry failed after
        assert slabs.state == "failed"
    await slabs.aclose()


async def test_ready_raises_when_the_slabs_were_reset_by_the_final_progress_call(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = SlabSet(plan(ckpt))

    def progress(stats: asyncslab.LoadStatistics) -> None:
        if stats.state == "complete":
            slabs.reset()

    task = slabs.start(ckpt, options=SMALL, progress=progress)
    with pytest.raises(asyncslab.IncompleteLoadError):
        await slabs.ready()
    await task
    assert slabs.state == "empty"
    await slabs.aclose()


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
async def test_a_swap_refused_for_a_changed_file_leaves_the_served_slabs_as_they_were(
    small_checkpoint: SyntheticCheckpoint, tmp_path: Path, change: str
) -> None:
    # The refusal came at the first open, after the slabs had been reset: the model being
    # served was marked failed and refused access, its bytes intact.
    ckpt = Checkpoint.open(small_checkpoint.root)
    slabs = await asyncslab.load(ckpt, plan(ckpt), options=SMALL)
    other_root = tmp_path / "other"
    shutil.copytree(small_checkpoint.root, other_root)
    other = Checkpoint.open(other_root)
    other_plan = plan(other)
    shard = other.files[0].path
    if change == "rewritten":
        shard.write_bytes(shard.read_bytes() + b"\0")
    else:
        shard.unlink()
    errors = asyncslab.errors
    expected = errors.FileChangedError if change == "rewritten" else errors.ReadError
    with pytest.raises(expected, match=re.escape(shard.name)):
        slabs.start(other, plan=other_plan, options=SMALL)
    with pytest.raises(expected):
        await slabs.load(other, plan=other_plan, options=SMALL)
    assert slabs.state == "complete"
    assert slabs.complete
    assert_bit_identical(slabs, ckpt)
    await slabs.ready()
    await slabs.aclose()


async def test_a_plain_unit_callback_fails_the_load_saying_it_must_be_async(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # It failed with torch's "object NoneType can't be used in 'await' expression".
    ckpt = Checkpoint.open(small_checkpoint.root)
    called: list[str] = []

    def postprocess(unit: str, slabs: SlabSet) -> None:
        called.append(unit)

    async with SlabSet(plan(ckpt)) as slabs:
        with pytest.raises(asyncslab.LoadError, match="on_unit_ready must be an async function"):
            await slabs.load(ckpt, options=SMALL, on_unit_ready=postprocess)  # type: ignore[arg-type]
    assert called


@pytest.mark.parametrize("transfer", ["direct", "staged", "mapped"])
@pytest.mark.parametrize(
    "how", ["unit callback", "progress callback", "read error", "cancelled", "start"]
)
async def test_a_dropped_slabset_whose_load_failed_frees_its_slabs_without_the_collector(
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    transfer: str,
) -> None:
    """A server whose load failed drops the SlabSet and retries with a new one: the old
    slabs must go with the last reference. The failed load's error, kept for ready(),
    held the frames of the load in its traceback, with the slabs in their locals: a cycle,
    freed only by a collection that may come minutes later (VRAM on a GPU: the retry's
    allocation failed meanwhile)."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    kwargs: dict[str, Any] = {"options": replace(SMALL, transfer=transfer)}
    if how == "unit callback":

        async def unit_ready(unit: str, slabs: SlabSet) -> None:
            raise RuntimeError("injected")

        kwargs["on_unit_ready"] = unit_ready
    elif how == "progress callback":

        def progress(stats: asyncslab.LoadStatistics) -> None:
            if stats.bytes_landed:
                raise RuntimeError("injected")

        kwargs["progress"] = progress
    in_flight = threading.Event()  # a read (or copy) is in its thread
    if how == "read error" and transfer == "direct":
        failing_first_read(monkeypatch, others_take=0.02)
    elif transfer == "direct":
        in_flight = slow_reads(monkeypatch, 0.1)
    else:
        # Staged and mapped reads land through a copy: fail the first, slow the others.
        calls = itertools.count()
        copy = copy_module.CpuCopier.copy

        def slow_copy(*args: Any) -> None:
            if next(calls) == 0 and how == "read error":
                raise OSError(5, "injected EIO")
            in_flight.set()
            time.sleep(0.1)
            copy(*args)

        monkeypatch.setattr(copy_module.CpuCopier, "copy", slow_copy)
    gc.collect()
    with gc_paused():  # the collector off: only reference counts free
        slabs = SlabSet(p)
        backing = weakref.ref(slabs._memory.backing)
        if how == "start":
            task = slabs.start(ckpt, **kwargs)
            await until(in_flight.is_set)  # cancelled mid-load, not after a fixed sleep
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            del task
        elif how == "cancelled":
            load = asyncio.ensure_future(slabs.load(ckpt, **kwargs))
            await until(in_flight.is_set)
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            del load
        else:
            with pytest.raises(asyncslab.AsyncSlabError):
                await slabs.load(ckpt, **kwargs)
        assert slabs.state in ("failed", "cancelled")
        with pytest.raises(asyncslab.IncompleteLoadError) as err:
            await slabs.ready()  # the error is still there for ready()
        assert err.value.__cause__ is not None
        del err, slabs
        await asyncio.sleep(0)
        assert backing() is None


@pytest.mark.parametrize("how", ["from", "again"])
async def test_a_failed_load_leaves_coroutines_that_caught_its_cause_running(
    small_checkpoint: SyntheticCheckpoint, how: str
) -> None:
    """A unit callback raises ``from`` an error that a client's reader task caught and went
    on running after (reconnecting), or raises that error again (a request failing fast
    while disconnected): its traceback then still ends in the reader's frame. Freeing a
    failed load's frames must leave that frame alone: before Python 3.13, clearing a
    suspended coroutine's frame closes it, and the reader died with "cannot reuse already
    awaited coroutine"."""
    caught: list[BaseException] = []
    ticks = 0

    async def reader() -> None:
        nonlocal ticks
        while True:
            try:
                raise ConnectionResetError("peer reset")
            except ConnectionResetError as err:
                caught.append(err)  # this frame is in err's traceback, and stays alive
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.02)
    ckpt = Checkpoint.open(small_checkpoint.root)

    async def unit_ready(unit: str, slabs: SlabSet) -> None:
        if how == "again":
            raise caught[-1]
        raise RuntimeError("cannot warm up") from caught[-1]

    slabs = SlabSet(plan(ckpt))
    with pytest.raises(asyncslab.LoadError, match="cannot warm up|peer reset"):
        await slabs.load(ckpt, options=SMALL, on_unit_ready=unit_ready)
    before = ticks
    await asyncio.sleep(0.1)
    assert not task.done(), task
    assert ticks > before
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await slabs.aclose()


async def test_a_retry_begun_when_ready_raised_leaves_no_cycle_behind(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ready() raises while the failed load's task still drains; a server then resets and
    reloads at once. The failed load's frames must still be let go of when its task ends
    (that load is no longer the current one then), or the SlabSet, dropped later without
    aclose(), keeps its slabs until a full collection."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    failing_first_read(monkeypatch, others_take=0.02)
    gc.collect()
    with gc_paused():  # the collector off: only reference counts free
        slabs = SlabSet(plan(ckpt))
        backing = weakref.ref(slabs._memory.backing)
        task = slabs.start(ckpt, options=SMALL)
        with pytest.raises(asyncslab.IncompleteLoadError):
            await slabs.ready()
        task.add_done_callback(lambda t: t.exception())  # retrieved: only the retry counts
        del task
        monkeypatch.undo()
        slabs.reset()
        await slabs.load(ckpt, options=SMALL)
        assert_bit_identical(slabs, ckpt)
        del slabs
        # Freed by reference counts alone (the collector is off) once the failed load's
        # last thread result has been run by the loop: awaited, not given a fixed 50 ms.
        await until(lambda: backing() is None)


async def test_a_failed_loads_error_keeps_the_locals_of_the_frames_it_went_through(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    """A debugger or an error reporter walking the traceback of a failed load sees the
    locals of every frame, the user's callback included: nothing is cleared to free the
    slabs (the SlabSet keeps no live error, so nothing has to be)."""
    ckpt = Checkpoint.open(small_checkpoint.root)

    async def unit_ready(unit: str, slabs: SlabSet) -> None:
        warmed = {"unit": unit}
        raise RuntimeError(f"cannot warm up {warmed['unit']}")

    async with SlabSet(plan(ckpt)) as slabs:
        with pytest.raises(asyncslab.LoadError, match="cannot warm up") as info:
            await slabs.load(ckpt, options=SMALL, on_unit_ready=unit_ready)
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError)
        frames = [frame for frame, _ in traceback.walk_tb(cause.__traceback__)]
        callback = [f for f in frames if f.f_code is unit_ready.__code__]
        assert len(callback) == 1
        assert callback[0].f_locals["warmed"] == {"unit": callback[0].f_locals["unit"]}
        # What ready() raises later holds no frame, but says where the error was raised.
        with pytest.raises(asyncslab.IncompleteLoadError) as later:
            await slabs.ready()
        kept = later.value.__cause__
        assert isinstance(kept, asyncslab.LoadError)
        assert str(kept) == str(info.value)
        assert kept.__traceback__ is None
        assert isinstance(kept.__cause__, RuntimeError)
        assert any("unit_ready" in note for note in getattr(kept.__cause__, "__notes__", []))
        del info, cause, frames, callback, later, kept


async def test_a_failed_load_spares_a_load_draining_in_another_threads_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model B loads in another thread's event loop; its load fails and drains. Model A's
    unit callback asks B's loop for ``B.ready()`` and fails ``from`` its error, whose
    traceback holds B's load frame, suspended in its drain. Freeing A's failed load must
    leave that frame alone: clearing it closed B's load from the wrong thread, which then
    ended with "cannot reuse already awaited coroutine" instead of its read error."""
    spec = SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32, vocab=128)
    written_a = write_synthetic(tmp_path / "a", spec)
    written_b = write_synthetic(tmp_path / "b", spec)
    calls = itertools.count()
    # B's other reads are held until A's load has failed: B surely drains while A fails (a
    # fixed 0.5 s read left that to the scheduler), and B's first read fails only once
    # another of them is in its thread.
    b_other_started, b_hold = threading.Event(), threading.Event()

    def read(*args: Any, **kwargs: Any) -> int:
        if str(kwargs["path"]).startswith(str(written_b.root)):
            if next(calls) == 0:
                assert b_other_started.wait(HANG_S)
                raise asyncslab.errors.ReadError("injected EIO", file=kwargs["path"])
            b_other_started.set()
            assert b_hold.wait(HANG_S)
        return pread_scatter(*args, **kwargs)

    monkeypatch.setattr(copy_module, "pread_scatter", read)
    b_ckpt = Checkpoint.open(written_b.root)
    b_slabs = SlabSet(plan(b_ckpt))
    b_loop = asyncio.new_event_loop()
    ended: list[BaseException] = []

    async def load_b() -> None:
        try:
            await b_slabs.load(b_ckpt, options=SMALL)
        except BaseException as err:  # noqa: BLE001 - what B's load ended with is the point
            ended.append(err)

    thread = threading.Thread(target=b_loop.run_until_complete, args=(load_b(),))
    thread.start()
    try:
        # B's state changes in B's thread: polled (an asyncio.Event cannot be set from there
        # at the moment the load fails, before its drain).
        while b_slabs.state != "failed":  # noqa: ASYNC110
            await asyncio.sleep(0.01)

        async def unit_ready(unit: str, slabs: SlabSet) -> None:
            try:
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(b_slabs.ready(), b_loop))
            except asyncslab.IncompleteLoadError as err:
                raise RuntimeError("base weights unavailable") from err

        a_ckpt = Checkpoint.open(written_a.root)
        a_slabs = SlabSet(plan(a_ckpt))
        with pytest.raises(asyncslab.LoadError, match="base weights unavailable"):
            await a_slabs.load(a_ckpt, options=SMALL, on_unit_ready=unit_ready)
        await a_slabs.aclose()
        assert not b_hold.is_set()
        assert thread.is_alive()  # B was still draining meanwhile
    finally:
        b_hold.set()
        await asyncio.to_thread(thread.join, HANG_S)
        b_loop.close()
    assert len(ended) == 1
    assert isinstance(ended[0], asyncslab.errors.ReadError), repr(ended[0])


async def test_a_unit_callback_that_returned_keeps_its_frame(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    """Only a failed callback's frame is cleared (it lies in the load's error); one that
    returned keeps its locals for whatever kept its frame (a profiler, a stored error)."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    frames: list[Any] = []

    async def unit_ready(unit: str, slabs: SlabSet) -> None:
        payload = {"unit": unit}
        frames.append(inspect.currentframe())
        assert payload

    async with SlabSet(plan(ckpt)) as slabs:
        await slabs.load(ckpt, options=SMALL, on_unit_ready=unit_ready)
        assert frames
        assert all(f.f_locals["payload"] == {"unit": f.f_locals["unit"]} for f in frames)


async def test_a_paced_load_reads_nothing_before_its_pace_allows_and_closes_at_once(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``max_bytes_per_s`` holds each read back until the bytes up to its end are due at
    that rate: at 1 byte/s no read of a 300 KB load may start for hours. Guards against the
    option being dropped (the neighbour it was set for loses its storage bandwidth after
    all), and against a thread waiting for its pace that aclose() cannot wake (a shutdown
    hanging for the whole delay)."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    # The same checkpoint under another root, loaded unpaced meanwhile: how long "meanwhile"
    # is comes from a whole load having happened beside the paced one, not from a fixed
    # 0.2 s that a loaded machine may spend before the paced load's first step.
    shutil.copytree(small_checkpoint.root, tmp_path / "unpaced")
    unpaced = Checkpoint.open(tmp_path / "unpaced")
    reads: list[str] = []

    def counting(*args: Any, **kwargs: Any) -> int:
        if not str(kwargs["path"]).startswith(str(unpaced.root)):
            reads.append(kwargs["path"])
        return pread_scatter(*args, **kwargs)

    monkeypatch.setattr(copy_module, "pread_scatter", counting)
    slabs = SlabSet(plan(ckpt))
    task = slabs.start(ckpt, options=replace(SMALL, max_bytes_per_s=1.0))
    await asyncio.sleep(0)  # the paced load's first step: its reads are scheduled
    async with SlabSet(plan(unpaced)) as beside:
        await beside.load(unpaced, options=SMALL)  # unpaced, the whole load lands
        assert beside.complete
    stats = slabs.statistics()
    assert (stats.state, stats.reads, stats.bytes_landed, reads) == ("loading", 0, 0, [])
    async with asyncio.timeout(HANG_S / 2):  # a hang guard: the close must not wait for the pace
        await slabs.aclose()
    assert task.cancelled()
    assert io_threads() == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"io_workers": 0}, "io_workers must be positive"),
        ({"read_size": 0}, "read_size must be positive"),
        ({"staging_bytes": -1}, "staging_bytes must be positive"),
        ({"staging_buffers": 0}, "staging_buffers must be positive"),
        ({"streams": 0}, "streams must be positive"),
        ({"coalesce_gap": -1}, "coalesce_gap must be >= 0"),
        ({"staging_bytes": 3, "staging_buffers": 4}, "at least one byte"),
        ({"max_bytes_per_s": 0}, "max_bytes_per_s must be positive"),
        ({"max_bytes_per_s": -1e9}, "max_bytes_per_s must be positive"),
        ({"read_timeout": -math.inf}, "read_timeout must be positive"),
    ],
)
async def test_load_options_refuse_values_with_no_meaning_naming_the_option(
    options: dict[str, Any], message: str
) -> None:
    """Refused when the options are made, naming the option. Accepted, each failed later
    and far from the cause (no I/O thread: a load that never reads; a zero or negative rate:
    a ZeroDivisionError in a thread, or pacing silently off; a negative gap or zero-byte
    buffers: a schedule or a division that breaks mid-load)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LoadOptions(**options)


@pytest.mark.parametrize(
    "options",
    [
        LoadOptions(read_size=16 << 10, coalesce_gap=1 << 20, io_workers=2),
        LoadOptions(transfer="staged", staging_bytes=2 * (16 << 10), staging_buffers=2),
        LoadOptions(transfer="mapped", staging_bytes=2 * (16 << 10), staging_buffers=2),
    ],
    ids=["direct", "staged", "mapped"],
)
async def test_bytes_landed_counts_only_routed_bytes_when_reads_span_skipped_tensors(
    tmp_path: Path, options: LoadOptions
) -> None:
    """A rank's plan skips the other rank's slices, and coalesced reads read through them:
    ``bytes_read`` counts those, ``bytes_landed`` must not. Counted as landed, progress
    went past 100 % (landed > needed), and the GB/s and ETA derived from it were wrong."""
    spec = SyntheticSpec(tp_ranks=2, n_layers=2, n_experts=4, hidden=64, intermediate=32, vocab=128)
    ckpt = Checkpoint.open(write_synthetic(tmp_path, spec).root)
    p = plan(ckpt, rank=0)
    assert p.skipped
    seen: list[tuple[int, int]] = []
    async with SlabSet(p) as slabs:
        await slabs.load(
            ckpt, options=replace(options, progress_interval=0),
            progress=lambda s: seen.append((s.bytes_landed, s.bytes_needed)),
        )  # fmt: skip
        stats = slabs.statistics()
        assert_bit_identical(slabs, ckpt)
    assert stats.bytes_landed == stats.bytes_needed == sum(r.nbytes for r in p.routes)
    assert stats.bytes_read > stats.bytes_landed  # the reads did span skipped bytes
    assert seen
    assert all(landed <= needed for landed, needed in seen)


async def test_progress_is_not_called_per_read_within_its_interval(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    """With an interval longer than the load, reads that land call nothing: the callback
    is called once when the reads end and once with the final state. Called on every
    landing instead, a callback that logs or pushes a metric ran thousands of times a
    second on the event loop, the very cost ``progress_interval`` exists to bound."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    seen: list[asyncslab.LoadStatistics] = []
    async with SlabSet(plan(ckpt)) as slabs:
        options = replace(SMALL, progress_interval=3600.0)
        await slabs.load(ckpt, options=options, progress=seen.append)
        reads = slabs.statistics().reads
    assert reads > 10
    assert [s.state for s in seen] == ["loading", "complete"]
    assert seen[0].bytes_landed == seen[1].bytes_landed == seen[1].bytes_needed


async def test_reset_after_a_failed_load_leaves_no_figure_or_error_of_it(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reset() makes the slabs empty: statistics must not go on reporting the failed load's
    error, reads or bytes (a health check would show an empty SlabSet as broken, or a
    progress bar start from the old figures), and ready() must not blame that load."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    failing_first_read(monkeypatch, others_take=0.0)
    async with SlabSet(plan(ckpt)) as slabs:
        with pytest.raises(asyncslab.errors.ReadError, match="injected EIO"):
            await slabs.load(ckpt, options=SMALL)
        assert slabs.statistics().error
        slabs.reset()
        stats = slabs.statistics()
        assert (stats.state, stats.error, stats.transfer) == ("empty", None, "")
        assert (stats.reads, stats.bytes_read, stats.bytes_landed, stats.bytes_needed) == (0,) * 4
        assert (stats.tensors_landed, stats.units_complete, stats.elapsed_s) == (0, 0, 0.0)
        with pytest.raises(asyncslab.IncompleteLoadError) as info:
            await slabs.ready()
        assert info.value.__cause__ is None


@pytest.mark.parametrize("transfer", ["direct", "staged", "mapped"])
@pytest.mark.parametrize("ending", ["complete", "failed"])
async def test_aclose_frees_the_slabs_while_the_slabset_is_still_held(
    small_checkpoint: SyntheticCheckpoint, transfer: str, ending: str
) -> None:
    """A server keeps its SlabSet object after closing it (for statistics(), say): the close
    must let go of the slab memory itself, not wait for the object to go. The last load
    keeps its figures, not the memory it wrote."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    kwargs: dict[str, Any] = {"options": replace(SMALL, transfer=transfer)}
    if ending == "failed":

        async def unit_ready(unit: str, slabs: SlabSet) -> None:
            raise RuntimeError("injected")

        kwargs["on_unit_ready"] = unit_ready
    gc.collect()
    with gc_paused():  # the collector off: only reference counts free
        slabs = SlabSet(plan(ckpt))
        backing = weakref.ref(slabs._memory.backing)
        if ending == "failed":
            with pytest.raises(asyncslab.LoadError):
                await slabs.load(ckpt, **kwargs)
        else:
            await slabs.load(ckpt, **kwargs)
        landed = slabs.statistics().bytes_landed
        await slabs.aclose()
        await asyncio.sleep(0)
        assert backing() is None
        assert slabs.statistics().bytes_landed == landed > 0
        assert slabs.statistics().state == ending


async def test_a_load_driven_elsewhere_fills_gates_and_voids_through_slabs_loads(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # The seam the distributed load uses: a load whose bytes someone else moves is begun,
    # landed, finished and voided through ``slabs.loads``, and the slabs gate and report
    # as after any load.
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    reference = await asyncslab.load(ckpt, p)
    source = reference.loads.current.sink.backing
    nbytes = route_column(p.routes, "nbytes")
    async with SlabSet(p) as slabs:
        await slabs.loads.settled()  # nothing earlier: returns at once
        shared = slabs.loads.begin_shared(ckpt, p, LoadOptions())
        assert slabs.state == "loading"
        with pytest.raises(asyncslab.LoadError, match="already running"):
            await slabs.load(ckpt)
        assert shared.sink.backing is not None
        assert source is not None
        shared.sink.backing.copy_(source)  # the bytes, moved "elsewhere"
        shared.begin(None)
        for route, n in enumerate(nbytes):
            shared.land(route, n)
        assert shared.complete
        shared.finish("complete")
        await slabs.ready()
        assert_bit_identical(slabs, ckpt)
        stats = slabs.statistics()
        assert (stats.state, stats.transfer, stats.bytes_landed) == (
            "complete",
            "shared",
            sum(nbytes),
        )

        # Failed elsewhere after some units landed: voided, none of them is handed out,
        # and ready() raises with the load's error.
        slabs.reset()
        shared = slabs.loads.begin_shared(ckpt, p, LoadOptions())
        shared.begin(None)
        for route in range(len(nbytes) // 2):
            shared.land(route, nbytes[route])
        shared.finish("failed", asyncslab.LoadError("stopped: rank 1 failed"))
        slabs.loads.void()
        assert slabs.state == "failed"
        assert not slabs.loads.closed
        for name in p.slabs:
            with pytest.raises(asyncslab.IncompleteLoadError):
                slabs.slab(name)
        with pytest.raises(asyncslab.IncompleteLoadError) as caught:
            await slabs.ready()
        assert "rank 1 failed" in str(caught.value.__cause__)
    assert slabs.loads.closed
    await reference.aclose()

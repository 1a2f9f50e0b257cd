"""Per-unit completeness (the tracker) as a user meets it: a unit with nothing to read is
ready at once, an incomplete unit's error blames only what did not arrive, completion
times are relative to the load's start, a waiter left behind by a closed event loop does
not break the next load, and a zero-byte tensor landing twice is caught."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncslab
from asyncslab import Checkpoint, Dense, LoadOptions, LoadStatistics, SlabSet, TensorInfo, plan
from asyncslab.loading import _copy as copy_module
from asyncslab.loading._read import pread_scatter
from asyncslab.loading._tracker import Tracker
from asyncslab.rules import Claim, SlabSpec
from asyncslab.testing import SyntheticCheckpoint
from support.faults import HANG_S
from tests.helpers import assert_bit_identical

try:
    import uvloop
except ImportError:  # pragma: no cover - platforms without uvloop
    uvloop = None

SMALL = LoadOptions(read_size=64 << 10, coalesce_gap=256, io_workers=3)

LOOP_FACTORIES: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
if uvloop is not None:
    LOOP_FACTORIES.append(uvloop.new_event_loop)


class _SpareSlots:
    """A rule that claims no tensor and declares one slab of zero slots in unit "spare":
    a unit with no route at all (an engine's spare capacity, say)."""

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        return Claim(slabs=(SlabSpec("spare.slots", "spare", torch.float16, (0,), (4,)),))


@pytest.mark.asyncio
async def test_a_unit_without_routes_is_ready(tmp_path: Path) -> None:
    """Guards against a hang: a unit with no tensor to land (a slab of zero slots) must
    complete when the load begins, else ``ready(unit)`` waits forever and the load ends
    with the unit incomplete."""
    save_file(
        {"model.layers.0.weight": torch.arange(16, dtype=torch.float16).reshape(4, 4)},
        str(tmp_path / "model.safetensors"),
    )
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt, [_SpareSlots(), Dense()])
    assert p.units["spare"] == ("spare.slots",)
    assert all(r.unit != "spare" for r in p.routes)  # the unit really has no route
    async with SlabSet(p) as slabs:
        task = slabs.start(ckpt, options=SMALL)
        # Waiting before the load's first step: the wait must be woken, not just pass.
        await asyncio.wait_for(slabs.ready("spare"), HANG_S)
        assert await asyncio.wait_for(task, HANG_S) is slabs
        await asyncio.wait_for(slabs.ready("spare"), HANG_S)
        assert slabs.complete
        assert slabs.slab("spare.slots").shape == (0, 4)
        assert_bit_identical(slabs, ckpt)


@pytest.mark.asyncio
async def test_incomplete_unit_blames_only_tensors_that_did_not_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards against wrong blame: after a read fails, the IncompleteLoadError for a unit
    names the tensor whose read failed, not its neighbour that had already landed."""
    arrived, lost = "model.layers.0.arrived", "model.layers.0.lost"
    save_file(
        {
            arrived: torch.ones(1024, dtype=torch.float32),
            lost: torch.full((1024,), 2.0, dtype=torch.float32),
        },
        str(tmp_path / "model.safetensors"),
    )
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt)
    assert [r.tensor for r in p.routes] == [arrived, lost]  # read in this order
    lost_offset = p.route(lost).src_offset
    first_landed = threading.Event()

    def progress(stats: LoadStatistics) -> None:
        if stats.tensors_landed:
            first_landed.set()

    def read(*args: Any, **kwargs: Any) -> int:
        if args[2] == lost_offset:
            # Fail only once the first read has landed (its landing is queued to the loop
            # after the read returns; a failure seen first would stop it from landing).
            assert first_landed.wait(HANG_S)
            raise asyncslab.errors.ReadError("injected EIO", file=kwargs["path"])
        return pread_scatter(*args, **kwargs)

    monkeypatch.setattr(copy_module, "pread_scatter", read)
    # One read per tensor (4 KiB each), one after the other.
    options = LoadOptions(io_workers=1, read_size=4096, coalesce_gap=0, progress_interval=0)
    async with SlabSet(p) as slabs:
        with pytest.raises(asyncslab.errors.ReadError, match="injected EIO"):
            await asyncio.wait_for(slabs.load(ckpt, options=options, progress=progress), HANG_S)
        assert slabs.statistics().tensors_landed == 1
        with pytest.raises(asyncslab.IncompleteLoadError) as info:
            slabs.view(arrived)
        message = str(info.value)
        assert "1 of 2 tensors landed" in message
        assert lost in message
        assert arrived not in message, message
        assert info.value.details["landed"] == 1
        assert info.value.details["total"] == 2
        with pytest.raises(asyncslab.IncompleteLoadError) as waited:
            await asyncio.wait_for(slabs.ready("layers.0"), HANG_S)
        assert arrived not in str(waited.value)


@pytest.mark.asyncio
async def test_unit_completion_times_are_seconds_since_the_load_began(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    """Guards against wrong statistics: ``unit_completed_at`` is seconds since the load
    started (within its elapsed time), not a raw clock reading."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    async with SlabSet(p) as slabs:
        for _ in range(2):  # a reload counts from its own start
            await slabs.load(ckpt, options=SMALL)
            stats = slabs.statistics()
            assert set(stats.unit_completed_at) == set(p.units)
            for unit, at in stats.unit_completed_at.items():
                assert 0 <= at <= stats.elapsed_s, (unit, at, stats.elapsed_s)


@pytest.mark.parametrize("factory", LOOP_FACTORIES, ids=lambda f: f.__module__.split(".")[0])
def test_a_waiter_of_a_closed_loop_does_not_break_the_next_load(
    small_checkpoint: SyntheticCheckpoint,
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """Guards against a later load failing with "Event loop is closed": a wait left
    pending in an event loop that was closed (not run to its end, as asyncio.run would) is
    skipped when its unit completes under another loop, not woken into the dead loop.

    Driven on the tracker: through a SlabSet every waiter is woken when its load ends, so
    only a loop closed mid-wait leaves one behind."""
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    tracker = Tracker(p)
    unit = next(iter(p.units))
    dead = factory()
    destroyed: list[dict[str, Any]] = []
    try:
        # "Task was destroyed but it is pending" when the abandoned wait is collected.
        dead.set_exception_handler(lambda _, context: destroyed.append(context))
        abandoned = dead.create_task(tracker.wait(unit))
        dead.run_until_complete(asyncio.sleep(0))  # the wait registers its future
        assert not abandoned.done()
    finally:
        dead.close()

    async def load_again() -> None:
        tracker.reset()
        tracker.begin(None)
        for index, route in enumerate(p.routes):
            tracker.land(index, route.nbytes)  # raised "Event loop is closed"
        assert all(tracker.is_complete(u) for u in p.units)
        await asyncio.wait_for(tracker.wait(unit), HANG_S)

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(load_again())
    del abandoned


@pytest.mark.asyncio
async def test_a_zero_byte_tensor_landing_twice_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards against a unit handed out before its bytes arrived: a zero-byte tensor
    landing twice (a broken schedule) must be a DuplicateLandingError, not counted twice,
    which would complete its unit while another of its tensors is still unread."""
    from asyncslab.loading import _strategy_direct as _direct
    from asyncslab.loading._schedule import Schedule, schedule

    empty, weight = "model.layers.0.empty", "model.layers.0.weight"
    save_file(
        {empty: torch.zeros(0, dtype=torch.float16), weight: torch.ones(4, 4)},
        str(tmp_path / "model.safetensors"),
    )
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt)
    assert {r.unit for r in p.routes} == {"layers.0"}
    assert p.route(empty).nbytes == 0

    def doubled(*args: Any, **kwargs: Any) -> Schedule:
        s = schedule(*args, **kwargs)
        assert s.empty  # zero-byte routes land without a read, from this list
        return Schedule(s.ops, s.empty + s.empty, s.bytes_needed, s.bytes_read)

    monkeypatch.setattr(_direct, "schedule", doubled)
    async with SlabSet(p) as slabs:
        with pytest.raises(asyncslab.DuplicateLandingError, match="landed twice") as info:
            await asyncio.wait_for(slabs.load(ckpt, options=LoadOptions(io_workers=1)), HANG_S)
        assert info.value.tensor == empty
        assert slabs.state == "failed"

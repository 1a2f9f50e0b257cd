"""Fault and cancellation helpers shared by the tests and the benchmarks' soaks
(``benchmarks/leak_soak.py``): the hang guard, the bytes a load must land, a load cancelled
at a random point, and the small-read load options of each read path."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet

__all__ = [
    "CANCEL_MODES",
    "HANG_S",
    "PATHS",
    "SMALL",
    "SMALL_STAGED",
    "cancel_somewhere",
    "expected_bytes",
    "raw_bytes",
]

HANG_S = 60.0
"""A hang guard: how long a test waits for something that must happen before it calls it
stuck. Never an assertion of speed: a correct run on a loaded machine is far within it."""

# Many small reads: every load below takes dozens of awaits, so faults and cancellations
# land in the middle of it.
SMALL = LoadOptions(read_size=4 << 10, coalesce_gap=128, io_workers=3, read_timeout=HANG_S)
# The same through the staging buffers and copies a GPU target uses (on the CPU here): the
# same reads, by as many threads.
SMALL_STAGED = LoadOptions(
    transfer="staged",
    staging_bytes=3 * (4 << 10),
    staging_buffers=3,
    coalesce_gap=128,
    read_timeout=HANG_S,
)
PATHS = {"direct": SMALL, "staged": SMALL_STAGED}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, for bit-exact comparison (NaN bit patterns included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


_EXPECTED: dict[Path, dict[str, torch.Tensor]] = {}


def expected_bytes(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Raw bytes of every tensor as the reference reads them (cached per checkpoint)."""
    key = ckpt.root.resolve()
    if key not in _EXPECTED:
        out = {}
        for shard in ckpt.files:
            with safe_open(shard.path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    out[name] = raw_bytes(f.get_tensor(name)).clone()
        _EXPECTED[key] = out
    return _EXPECTED[key]


async def cancel_somewhere(
    slabs: SlabSet, ckpt: Checkpoint, rng: random.Random, mode: str, options: LoadOptions
) -> None:
    """One load, cancelled at a random point (it may finish first)."""

    async def spin(n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    # Some right at the start (before the task ran, before a thread started), the rest
    # spread over a paced load (~5-15 ms; an idle loop iteration takes ~5-10 us) and a
    # little past it.
    iterations = rng.randrange(4) if rng.random() < 0.2 else rng.randrange(3000)
    delay = 0.0 if rng.random() < 0.1 else rng.uniform(0.0, 0.02)
    if mode == "task.cancel":
        task = slabs.start(ckpt, options=options)
        await spin(iterations)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    elif mode == "landed":  # right after the k-th tensor landed: surely mid-load
        k = rng.randrange(1, len(slabs.plan.routes))
        started: list[asyncio.Task[SlabSet]] = []

        # Cancelled from the progress report of the landing that reached k (nothing lands
        # after a cancel): polling for it let the loop land on meanwhile, to the end of the
        # load when the machine was busy.
        def cancel_at_k(stats: asyncslab.LoadStatistics) -> None:
            if stats.tensors_landed >= k and started and not started[0].cancelling():
                started[0].cancel()

        task = slabs.start(
            ckpt, options=replace(options, progress_interval=0), progress=cancel_at_k
        )
        started.append(task)
        try:
            await task
        except asyncio.CancelledError:
            pass
    elif mode == "delay":
        task = slabs.start(ckpt, options=options)
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    elif mode == "double-cancel":  # a second cancel lands while the load drains
        task = slabs.start(ckpt, options=options)
        await spin(iterations)
        task.cancel()
        await spin(rng.randrange(3))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    elif mode == "outer-task":  # the task awaiting slabs.load() is cancelled
        outer = asyncio.ensure_future(slabs.load(ckpt, options=options))
        await spin(iterations)
        outer.cancel()
        try:
            await outer
        except asyncio.CancelledError:
            pass
    elif mode == "timeout":
        try:
            async with asyncio.timeout(delay):
                await slabs.load(ckpt, options=options)
        except TimeoutError:
            pass
    elif mode == "aclose":
        slabs.start(ckpt, options=options)
        await spin(iterations)
        await slabs.aclose()
    else:  # pragma: no cover
        raise AssertionError(mode)


CANCEL_MODES = [
    "task.cancel", "landed", "delay", "double-cancel", "outer-task", "timeout", "aclose",
]  # fmt: skip

"""Helpers shared by tests (``from tests.helpers import ...``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import asyncslab
from asyncslab import Checkpoint, IncompleteLoadError, SlabSet
from asyncslab.testing import verify_slabs
from support.faults import HANG_S, expected_bytes, raw_bytes


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What the running loop's exception handler is given meanwhile ("Task exception was
    never retrieved", ...), instead of logging it."""
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: logged.append(context))
    try:
        yield logged
    finally:
        loop.set_exception_handler(previous)


def assert_bit_identical(slabs: asyncslab.SlabSet, checkpoint: asyncslab.Checkpoint) -> int:
    """Every tensor of the last load's plan equals, in its slot, what the safetensors library
    reads from ``checkpoint``; returns the count."""
    run_plan = slabs.loads.current.plan  # the last load's: its files, its tensors
    assert [f.path for f in run_plan.files] == [f.path for f in checkpoint.files]
    result = verify_slabs(run_plan, slabs)
    assert result.ok, result.describe()
    return result.tensors


def open_fds() -> frozenset[tuple[int, str]]:
    """The process's open file descriptors and what each names, network sockets left out.

    Compare two snapshots for a leak. Network sockets are not the loader's (a local load opens
    files, never one), and an object-store client cached by an earlier test closes its pooled
    connections on its own idle timer, at any point of a later test."""
    unix = _unix_socket_inodes()
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:[") and target[8:-1] not in unix:
            continue
        fds.add((int(name), target))
    return frozenset(fds)


def _unix_socket_inodes() -> set[str]:
    with open("/proc/self/net/unix") as table:
        next(table)  # the header
        return {fields[6] for line in table if len(fields := line.split()) > 6}


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncslab-io")]


async def until(condition: Callable[[], bool], limit: float = HANG_S) -> None:
    """Await ``condition()`` turning true, the loop running meanwhile (for a condition that
    a thread or another loop changes, which no asyncio.Event can report). ``limit`` is a
    hang guard only: the test fails if the condition never comes."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still waiting after {limit} s: {condition}"
        await asyncio.sleep(0.001)


def slow_reads(monkeypatch: pytest.MonkeyPatch, delay: float) -> threading.Event:
    """Make every read of a load (CPU or staged) take ``delay`` seconds longer. Returns an
    event set once a read is inside its delay: a read is then in flight for sure."""
    from asyncslab.loading import _copy
    from asyncslab.loading._read import pread_scatter

    in_flight = threading.Event()

    def slow(*args: object, **kwargs: object) -> int:
        in_flight.set()
        time.sleep(delay)
        return pread_scatter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_copy, "pread_scatter", slow)
    return in_flight


def staging_released(slabs: asyncslab.SlabSet) -> bool:
    """The last load's staging buffers were dropped (its transfer holds none any more)."""
    strategy = slabs.loads.current.strategy
    staging = strategy.staging() if strategy is not None else None
    return staging is None or staging.buffers == 0


# --- faults: what a broken or cancelled load must leave behind -------------------------


def assert_units_all_or_nothing(slabs: SlabSet, ckpt: Checkpoint) -> tuple[int, int]:
    """Each unit is either complete — every slab handed out, every tensor bit-exact — or
    refused through every accessor. Returns (complete, incomplete) unit counts."""
    expected = expected_bytes(ckpt)
    p = slabs.plan
    done = slabs.statistics().unit_completed_at
    routes_of: dict[str, list[asyncslab.rules.Route]] = {u: [] for u in p.units}
    for r in p.routes:
        routes_of[r.unit].append(r)
    complete = incomplete = 0
    for unit, names in p.units.items():
        if unit in done:
            complete += 1
            for name in names:
                slabs.slab(name)
            for r in routes_of[unit]:
                assert torch.equal(raw_bytes(slabs.view(r.tensor)), expected[r.tensor]), r.tensor
        else:
            incomplete += 1
            for name in names:
                with pytest.raises(IncompleteLoadError, match=unit):
                    slabs.slab(name)
                with pytest.raises(IncompleteLoadError):
                    slabs.slabs[name]
            for r in routes_of[unit]:
                with pytest.raises(IncompleteLoadError):
                    slabs.view(r.tensor)
                with pytest.raises(IncompleteLoadError):
                    slabs.slot(r.slab, r.slot)
    assert complete == slabs.statistics().units_complete
    return complete, incomplete


def assert_bit_exact(slabs: SlabSet, ckpt: Checkpoint) -> None:
    assert slabs.state == "complete"
    complete, incomplete = assert_units_all_or_nothing(slabs, ckpt)
    assert incomplete == 0
    assert complete == len(slabs.plan.units)


async def wait_io_threads_gone(limit: float = HANG_S) -> list[threading.Thread]:
    """I/O threads exit shortly after a load returns; wait for them (``limit`` is a hang
    guard: on a loaded machine "shortly" can be long)."""
    deadline = time.monotonic() + limit
    while io_threads() and time.monotonic() < deadline:  # noqa: ASYNC110 - polling threads
        await asyncio.sleep(0.005)
    return io_threads()


async def released(held: Callable[[], bool], limit: float = HANG_S) -> bool:
    """Whether ``held()`` turns False within ``limit`` seconds (a hang guard), the loop
    running meanwhile.

    A thread's last result reaches the event loop as a callback queued before the thread
    exits; until the loop has run it, that result (and the read's frames in a traceback)
    still holds what the read used. So "released once the reads returned" is judged after
    the loop has had its turn, not in the instant the threads are seen gone."""
    deadline = time.monotonic() + limit
    while True:
        gc.collect()
        if not held() or time.monotonic() >= deadline:
            return not held()
        await asyncio.sleep(0.01)

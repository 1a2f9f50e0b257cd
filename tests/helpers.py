"""Helpers shared by tests (imported as ``helpers``; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import asyncslab
from asyncslab.testing import verify_slabs


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


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, for bit-exact comparison (NaN bit patterns included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(slabs: asyncslab.SlabSet, checkpoint: asyncslab.Checkpoint) -> int:
    """Every tensor of the last load's plan equals, in its slot, what the safetensors library
    reads from ``checkpoint``; returns the count."""
    run_plan = slabs._run_plan  # the last load's: its files, its tensors
    assert [f.path for f in run_plan.files] == [f.path for f in checkpoint.files]
    result = verify_slabs(run_plan, slabs)
    assert result.ok, result.describe()
    return result.tensors


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncslab-io")]


def slow_reads(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Make every read of a load (CPU or staged) take ``delay`` seconds longer."""
    from asyncslab import _copy
    from asyncslab._read import pread_scatter

    def slow(*args: object, **kwargs: object) -> int:
        time.sleep(delay)
        return pread_scatter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_copy, "pread_scatter", slow)


def staging_released(slabs: asyncslab.SlabSet) -> bool:
    """The last load's staging buffers were dropped (its transfer holds none any more)."""
    strategy = slabs._load.strategy
    staging = strategy.staging() if strategy is not None else None
    return staging is None or staging.buffers == 0

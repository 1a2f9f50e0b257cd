"""Loading, the staging buffers of a staged (GPU) load, one per I/O thread."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncslab.loading._pinned import (
    StagingBuffers,
    StagingStatistics,
    pinned_bytes,
    staging_budget,
)


def test_staging_buffers_one_per_thread_made_when_first_used() -> None:
    made: list[int] = []
    fail = [True]

    def make(size: int) -> torch.Tensor:
        if fail and fail.pop():
            raise RuntimeError("cannot pin")
        made.append(size)
        return torch.empty(size, dtype=torch.uint8)

    with pytest.raises(ValueError, match="cannot hold"):
        StagingBuffers(2, 3, make)
    staging = StagingBuffers(3 * 1024 + 2, 3, make)  # the rest of the budget goes unused
    assert staging.statistics().buffers == 0  # nothing pinned before a read asks
    with pytest.raises(RuntimeError, match="cannot pin"):
        staging.use(1).__enter__()
    assert staging.statistics() == StagingStatistics(0, 1024, 0, 0)  # the slot stayed empty
    with staging.use(1) as first:
        assert staging.statistics().in_use == 1024
    with staging.use(1) as again:
        assert again is first  # a thread reuses its own buffer
    with pytest.raises(KeyError):  # noqa: PT012 - the error must cross the use block
        with staging.use(0) as other:
            seen = other
            raise KeyError("a read that fails inside the block")
    assert seen is not first
    assert seen.numel() == 1024
    assert made == [1024, 1024]
    stats = staging.statistics()
    assert (stats.buffers, stats.in_use, stats.peak_in_use) == (2, 0, 1024)
    staging.close()
    assert staging.statistics().buffers == 0


def test_staging_buffers_count_concurrent_use() -> None:
    staging = StagingBuffers(4 * 256, 4, lambda size: torch.empty(size, dtype=torch.uint8))
    inside = threading.Barrier(5)
    leave = threading.Event()
    seen: list[int] = []

    def work(worker: int) -> None:
        with staging.use(worker) as buffer:
            seen.append(buffer.data_ptr())
            inside.wait(5)
            leave.wait(5)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    inside.wait(5)  # all four are inside their blocks
    assert staging.statistics().in_use == 4 * 256
    leave.set()
    for t in threads:
        t.join()
    assert len(set(seen)) == 4
    assert staging.statistics() == StagingStatistics(4, 256, 0, 4 * 256)


@pytest.mark.parametrize(
    ("budget", "buffers", "pinned", "expected"),
    [
        (256 << 20, 8, True, 256 << 20),  # the default: 32 MiB each, a power of two
        (384 << 20, 8, True, 256 << 20),  # 48 MiB each would pin 64 MiB each
        ((64 << 20) + 5, 2, True, 64 << 20),
        (3 * (16 << 10), 3, True, 3 * (16 << 10)),
        (7, 7, True, 7),
        (384 << 20, 8, False, 384 << 20),  # unpinned (a CPU target's staged reads): as asked
        (100, 3, False, 99),
    ],
)
def test_pinned_staging_is_sized_as_torch_pins_it(
    budget: int, buffers: int, pinned: bool, expected: int
) -> None:
    """torch's pinned-memory allocator rounds each block up to a power of two: the buffers
    are rounded down to one, so that the budget reported is what is pinned, within the
    budget asked."""
    got = staging_budget(budget, buffers, pinned)
    assert got == expected
    size = got // buffers
    assert got <= budget
    if pinned:
        assert size & (size - 1) == 0


@pytest.mark.parametrize(
    ("size", "held"),
    [(0, 0), (1, 1), (2, 2), (3, 4), (64 << 10, 64 << 10), ((16 << 20) + 1, 32 << 20)],
)
def test_pinned_bytes_is_the_power_of_two_torch_pins(size: int, held: int) -> None:
    # A shared distributed load's chunk buffer (16 MiB and its status byte) holds 32 MiB
    # of pinned memory; its statistics said 16 MiB.
    assert pinned_bytes(size) == held

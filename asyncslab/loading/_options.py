"""How a load runs (:class:`LoadOptions`) and what it reports (:class:`LoadStatistics`):
the vocabulary the loader, its transfers and the distributed load share."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Literal

import torch

from ..errors import LoadError

__all__ = [
    "LoadOptions",
    "LoadStatistics",
    "ProgressCallback",
    "State",
    "Transfer",
    "UnitCallback",
    "resolve_transfer",
]

State = Literal["empty", "loading", "complete", "failed", "cancelled"]
Transfer = Literal["auto", "direct", "staged", "mapped"]
_TRANSFERS: tuple[Transfer, ...] = ("auto", "direct", "staged", "mapped")
# Given the SlabSet (typed as such where SlabSet is: _slabs).
UnitCallback = Callable[[str, Any], Awaitable[None]]
ProgressCallback = Callable[["LoadStatistics"], None]


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How a load runs. The defaults suit a server start; benchmarks sweep them.

    ``io_workers``: positional reads in flight (CPU target), one I/O thread each.
    ``read_size``: target size of one coalesced read. ``coalesce_gap``: largest gap
    between two tensors read through rather than split into two reads. ``staging_bytes`` /
    ``staging_buffers``: the pinned buffers of a CUDA target, one per I/O thread (one read
    in flight each, of up to ``staging_bytes // staging_buffers`` bytes, rounded down to a
    power of two: torch pins a power of two whatever the size asked).
    ``streams``: CUDA copy streams.
    ``read_timeout``: seconds one read may take before the load fails (``None``: forever).
    ``io_nice``: added to the nice value of the I/O threads (Linux, where it is per thread;
    ignored elsewhere), so that the event loop, and anything else of normal priority, gets a
    core the moment it wants one, while the load still takes every idle cycle (the lag it
    saves is measured in docs/performance.md). Not 19: an I/O thread holds the GIL briefly
    between two reads, and the loop waiting for it should not wait behind everything else on
    the machine. 0 leaves the threads as they are.
    ``transfer``: how bytes reach the slabs. ``"direct"`` (CPU targets): read straight into
    the slabs. ``"staged"``: read into the pinned staging buffers, then copy. ``"mapped"``:
    map the shards and copy straight out of the page cache, each read's pages registered
    with CUDA while they are copied from (no staging buffers; Linux; see
    ``_strategy_mapped``).
    ``"auto"``: direct on a CPU, staged on CUDA. Staged and mapped on a CPU target test
    those paths without a GPU (slower than direct). Mapped reads are cut at multiples of
    ``staging_bytes // staging_buffers`` and run on ``staging_buffers`` threads, as staged
    ones.
    ``progress_interval``: seconds between two calls of a load's progress callback while
    it runs (it is also called at the end); 0 calls it on every read that lands, and only
    then.
    ``max_bytes_per_s``: pace reads to at most this rate (``None``: as fast as possible),
    to leave storage bandwidth to a neighbour — or to watch a small load in slow motion.
    ``request_size``, ``request_concurrency``, ``request_retries``: a checkpoint in object
    storage (``s3://``) is read with ranged GETs of at most ``request_size`` bytes,
    ``request_concurrency`` in flight (so at most their product is held in memory at once),
    each retried ``request_retries`` times after a transient failure, all within
    ``read_timeout`` (docs/object-storage.md). ``presigned_gets``: an ``s3://`` or ``az://``
    store that can sign has obstore presign each object's URL, and the standard library's
    HTTP client read each body straight into its slots; False makes every GET through
    obstore.
    """

    io_workers: int = 4
    read_size: int = 16 << 20
    coalesce_gap: int = 64 << 10
    staging_bytes: int = 256 << 20
    staging_buffers: int = 8
    streams: int = 4
    read_timeout: float | None = 60.0
    io_nice: int = 10
    progress_interval: float = 0.1
    transfer: Transfer = "auto"
    max_bytes_per_s: float | None = None
    request_size: int = 8 << 20
    request_concurrency: int = 16
    request_retries: int = 3
    presigned_gets: bool = True

    def __post_init__(self) -> None:
        # Checked here, not deep in a load: a float count or size would fail there as a bare
        # TypeError naming no option, and a bool is an int that means nothing here
        # (test_load_options_refuse_wrong_values_naming_the_option).
        for name in (
            "io_workers", "read_size", "coalesce_gap", "staging_bytes", "staging_buffers",
            "streams", "io_nice", "request_size", "request_concurrency", "request_retries",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"LoadOptions.{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # a NumPy integer, say, as an int
        for name in (
            "io_workers", "read_size", "staging_bytes", "staging_buffers", "streams",
            "request_size", "request_concurrency",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"LoadOptions.{name} must be positive")
        if self.coalesce_gap < 0:
            raise ValueError("LoadOptions.coalesce_gap must be >= 0")
        if self.request_retries < 0:
            raise ValueError("LoadOptions.request_retries must be >= 0")
        for name, optional in (
            ("read_timeout", True), ("progress_interval", False), ("max_bytes_per_s", True)
        ):  # fmt: skip
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, Real):
                kind = "a number or None" if optional else "a number"
                raise TypeError(f"LoadOptions.{name} must be {kind}, got {value!r}")
        if self.read_timeout is not None and not 0 < self.read_timeout <= math.inf:
            # 0 often means "no timeout" elsewhere; here it would fail every read, and the
            # SlabSet with it (a read past read_timeout makes it unusable). None is "never".
            raise ValueError(
                f"LoadOptions.read_timeout must be positive seconds, or None for no timeout; "
                f"got {self.read_timeout!r}"
            )
        if self.staging_bytes < self.staging_buffers:
            raise ValueError(
                f"LoadOptions.staging_bytes ({self.staging_bytes}) must give each of the "
                f"{self.staging_buffers} staging buffers at least one byte"
            )
        if not 0 <= self.io_nice <= 19:
            raise ValueError("LoadOptions.io_nice must be in 0..19 (raising priority needs root)")
        if not 0 <= self.progress_interval < math.inf:  # NaN included
            raise ValueError("LoadOptions.progress_interval must be a finite number >= 0")
        if self.max_bytes_per_s is not None and not self.max_bytes_per_s > 0:  # NaN too
            raise ValueError("LoadOptions.max_bytes_per_s must be positive")
        if not isinstance(self.presigned_gets, bool):
            got = self.presigned_gets
            raise TypeError(f"LoadOptions.presigned_gets must be a bool, got {got!r}")
        if self.transfer not in _TRANSFERS:
            raise ValueError(
                f"LoadOptions.transfer must be one of {', '.join(_TRANSFERS)}, "
                f"got {self.transfer!r}"
            )


@dataclass(frozen=True, slots=True)
class LoadStatistics:
    """A snapshot of a load (live while it runs, final after). ``transfer``: how its bytes
    reach the slabs (``"direct"``, ``"staged"`` or ``"mapped"``, ``"shared"`` for a
    distributed load sharing reads; ``""`` before a load)."""

    state: State
    device: str
    files: int
    tensors: int
    tensors_landed: int
    units: int
    units_complete: int
    bytes_total: int
    bytes_needed: int
    bytes_read: int
    bytes_landed: int
    reads: int
    elapsed_s: float
    staging_budget: int
    staging_peak: int
    unit_completed_at: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    transfer: str = ""

    @property
    def gbps(self) -> float:
        """Bytes landed per second, in GB/s (10^9)."""
        return self.bytes_landed / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the average rate so far; ``None`` until 1 % has landed and a
        second has passed: a first small read says nothing of the rate (a slow first read
        of a 100 GiB load would give an ETA of a day)."""
        if self.bytes_landed == 0 or self.state != "loading":
            return None
        if self.elapsed_s < 1.0 or self.bytes_landed * 100 < self.bytes_needed:
            return None
        rate = self.bytes_landed / self.elapsed_s
        return (self.bytes_needed - self.bytes_landed) / rate


def resolve_transfer(transfer: Transfer, device: torch.device) -> Transfer:
    """The transfer a load onto ``device`` uses: ``auto`` resolved, ``direct`` refused for
    a CUDA target (a read cannot land in device memory)."""
    if transfer == "auto":
        return "staged" if device.type == "cuda" else "direct"
    if transfer == "direct" and device.type != "cpu":
        raise LoadError(
            f"transfer='direct' reads into host memory; {device} needs 'staged' or 'mapped'"
        )
    return transfer

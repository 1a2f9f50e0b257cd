"""The orchestration: allocate slabs once, then run plans through read → (stage → copy) →
track, with every task owned by one ``asyncio.TaskGroup``.

Ownership and lifetime: a :class:`SlabSet` owns its slab tensors for its whole life; loads
write into them in place, so every pointer stays valid across :meth:`SlabSet.reset` and
reloads (captured CUDA graphs keep working). A load owns its file descriptors, I/O threads
and staging buffers, and releases all of them before it returns or raises — also when it is
cancelled, after waiting for reads already inside a thread.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import math
import operator
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Literal, TypeVar

import torch

from ._copy import Copier, CpuCopier, CudaCopier, direct_scatters, read_direct, read_staged
from ._errors import (
    AsyncSlabError,
    ClosedError,
    FileChangedError,
    IncompleteLoadError,
    LoadError,
    PlanError,
    ReadError,
    ReadTimeoutError,
    first_line,
)
from ._format import Checkpoint, _gc_paused
from ._mapped import PAGE, CudaRegistry, Mappings, PopulateRegistry, Registry, transfer
from ._plan import Plan
from ._read import IoPool, ReadFeed, Scatter, retrieve
from ._schedule import ReadOp, Schedule, schedule, windows
from ._staging import StagingBuffers, staging_budget
from ._tracker import Tracker

__all__ = ["LoadOptions", "LoadStatistics", "SlabSet", "load"]

T = TypeVar("T")

State = Literal["empty", "loading", "complete", "failed", "cancelled"]
Transfer = Literal["auto", "direct", "staged", "mapped"]
_TRANSFERS: tuple[Transfer, ...] = ("auto", "direct", "staged", "mapped")
UnitCallback = Callable[[str, "SlabSet"], Awaitable[None]]
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
    saves is measured in benchmarks/README.md). Not 19: an I/O thread holds the GIL briefly
    between two reads, and the loop waiting for it should not wait behind everything else on
    the machine. 0 leaves the threads as they are.
    ``transfer``: how bytes reach the slabs. ``"direct"`` (CPU targets): read straight into
    the slabs. ``"staged"``: read into the pinned staging buffers, then copy. ``"mapped"``:
    map the shards and copy straight out of the page cache, each read's pages registered
    with CUDA while they are copied from (no staging buffers; Linux; see ``_mapped``).
    ``"auto"``: direct on a CPU, staged on CUDA. Staged and mapped on a CPU target test
    those paths without a GPU (slower than direct). Mapped reads are cut at multiples of
    ``staging_bytes // staging_buffers`` and run on ``staging_buffers`` threads, as staged
    ones.
    ``progress_interval``: seconds between two calls of a load's progress callback while
    it runs (it is also called at the end); 0 calls it on every read that lands, and only
    then.
    ``max_bytes_per_s``: pace reads to at most this rate (``None``: as fast as possible),
    to leave storage bandwidth to a neighbour — or to watch a small load in slow motion.
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

    def __post_init__(self) -> None:
        # Checked here, not deep in a load: a float count or size failed there as a bare
        # TypeError naming no option, and a bool is an int that means nothing here.
        for name in (
            "io_workers", "read_size", "coalesce_gap", "staging_bytes", "staging_buffers",
            "streams", "io_nice",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"LoadOptions.{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # a NumPy integer, say, as an int
        for name in ("io_workers", "read_size", "staging_bytes", "staging_buffers", "streams"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LoadOptions.{name} must be positive")
        if self.coalesce_gap < 0:
            raise ValueError("LoadOptions.coalesce_gap must be >= 0")
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
            # 0 often means "no timeout" elsewhere; here it failed every read, and the
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


class _SlabMapping(Mapping[str, torch.Tensor]):
    """``slabs.slabs[name]``: a slab, only once its unit is complete."""

    def __init__(self, owner: SlabSet) -> None:
        self._owner = owner

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._owner.slab(name)

    def __contains__(self, name: object) -> bool:
        # Membership is about the plan; only reading an incomplete slab is refused.
        return name in self._owner.plan.slabs

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner.plan.slabs)

    def __len__(self) -> int:
        return len(self._owner.plan.slabs)


class SlabSet:
    """The slabs of a plan on one device, and the loads that fill them.

    Allocation happens once, here; loads write in place. A slab is handed out (``slab``,
    ``slabs[name]``, ``slot``, ``view``) only when its unit is complete, else
    :class:`IncompleteLoadError` names what is missing. Use as ``async with`` or call
    :meth:`aclose`, which cancels a running load and frees the slabs.

    ``tensors=`` makes it load into tensors it did not allocate (an engine's parameters): one
    per slab of the plan, of its dtype and shape, contiguous, none sharing a byte with
    another. They are written in place and never freed here.
    """

    # Per route of the plan being loaded: the byte tensor its slab lies in (see _adopt).
    _route_bytes: list[torch.Tensor]

    def __init__(
        self,
        plan: Plan,
        device: str | torch.device | None = None,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if device is None:
            device = _device_of(tensors) if tensors else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported (cpu or cuda)")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LoadError(f"device {self.device} requested, but CUDA is not available")
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means the current device when the slabs are made; pinned here, as the
            # copies run on I/O threads, whose current device is device 0 (on several GPUs
            # their streams, events and registrations would be on the wrong one).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.plan = plan
        self._tensors: dict[str, torch.Tensor] = {}
        # The given tensors' bytes, per slab; None where the slabs are views of one
        # allocation of asyncslab's own.
        self._given: dict[str, torch.Tensor] | None = None
        if tensors is not None:
            # An engine's own tensors (its parameters, or views of them): written in place,
            # never reallocated; the SlabSet gates access to them as to its own slabs.
            self._given = _given_bytes(plan, tensors, self.device)
            self._tensors.update(tensors)
            self._offset = dict.fromkeys(plan.slabs, 0)
            self._backing = torch.empty(0, dtype=torch.uint8, device=self.device)
            empty: list[str] = []
        else:
            # One allocation holds every slab; slab tensors are views of it, made when first
            # asked for. A slab of its own each cost ~20 µs (allocation, views, a buffer for
            # reads): seconds for a plan of 300,000 small tensors.
            self._offset, total, empty = slab_layout(plan, self.device)
            try:
                self._backing = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
            except RuntimeError as err:
                raise LoadError(
                    f"cannot allocate {total} bytes for {len(plan.slabs)} slabs on "
                    f"{self.device}: {first_line(err)}"
                ) from err
        for name in empty:
            spec = plan.slabs[name]
            # A zero-size shape whose other dimensions pass 2**63 is valid in a header but
            # not in torch (a view would not notice): refuse it now.
            try:
                torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            except (RuntimeError, TypeError) as err:
                raise LoadError(
                    f"cannot make slab {name!r} of shape {list(spec.shape)} "
                    f"({spec.dtype}): {first_line(err)}",
                    slab=name,
                ) from err
        self._adopt(plan)
        self._state: State = "empty"
        self._task: asyncio.Task[SlabSet] | None = None
        # Every load task not yet ended (a failed one still drains its threads while the next
        # may have begun), and the unit callbacks running: aclose() waits for the former and
        # must not be awaited from the latter.
        self._live: set[asyncio.Task[SlabSet]] = set()
        self._callbacks: set[asyncio.Task[None]] = set()
        self._broken: str | None = None
        self._closed = False
        self._closing = False
        self._generation = 0
        # The last load's task once it ended, weakly: a failed task holds its error, whose
        # frames hold this SlabSet (see _delivered).
        self._ended_task: weakref.ref[asyncio.Task[SlabSet]] | None = None
        self._error: str | None = None
        self._reset_counters()

    def __repr__(self) -> str:
        return (
            f"SlabSet({len(self.plan.slabs)} slabs, {self.plan.nbytes} bytes on {self.device}, "
            f"state={self._state!r})"
        )

    # --- access ------------------------------------------------------------------------

    @property
    def slabs(self) -> Mapping[str, torch.Tensor]:
        return _SlabMapping(self)

    @property
    def state(self) -> State:
        self._settle()
        return self._state

    @property
    def complete(self) -> bool:
        return all(self._tracker.is_complete(u) for u in self.plan.units)

    def slab(self, name: str) -> torch.Tensor:
        """The whole slab ``name``; its unit must be complete."""
        self._check_open()
        spec = self.plan.slabs.get(name)
        if spec is None:
            raise KeyError(f"no slab {name!r} in the plan")
        self._tracker.check(spec.unit)
        return self._slab_tensor(name)

    def slot(self, name: str, slot: tuple[int, ...]) -> torch.Tensor:
        """A view of one slot of slab ``name`` (a prefix of the slot dimensions gives a
        stacked view). Only in-range integer slots: anything else could index a copy."""
        slab = self.slab(name)
        dims = self.plan.slabs[name].slot_dims
        if (
            not isinstance(slot, tuple)
            or len(slot) > len(dims)
            or not all(type(i) is int and 0 <= i < n for i, n in zip(slot, dims, strict=False))
        ):
            raise IndexError(f"slot {slot!r} is outside slab {name!r} (slot dims {list(dims)})")
        return slab[slot]

    def view(self, tensor: str) -> torch.Tensor:
        """The view a checkpoint tensor landed in (its shape and dtype)."""
        location = self._run_plan.where(tensor)  # the last load's plan: its tensors
        return self.slot(location.slab, location.slot)

    async def ready(self, unit: str | None = None) -> None:
        """Wait until ``unit`` is complete; without one, until the load has ended with every
        unit complete (its threads and files released: a reload may start at once).

        Raises :class:`IncompleteLoadError` if no load is running to complete it, or if
        the load fails (its error is the ``__cause__``) — without ``unit``, even if it
        fails after every unit landed (a unit callback, the final progress call): its
        slabs are exact, but what the server does with them did not finish. A load that
        begins while this waits (a retry, a swap) is waited for in turn: what counts is
        the state the slabs are left in.
        """
        self._check_open()
        self._settle()
        units = list(self.plan.units) if unit is None else [unit]
        try:
            while True:
                for u in units:
                    if self._state != "loading":
                        self._check_ended(u)
                    await self._tracker.wait(u)
                if unit is not None:
                    return
                task = self._task
                if task is None or task.done():
                    self._check_ended(None)
                    return
                await asyncio.wait([task])
                # Its caller may have reset the slabs, or started another load, before this
                # resumed: judge the slabs as they are now, not the load waited for.
                self._settle()
        except IncompleteLoadError as err:
            self._delivered(err.__cause__)
            raise

    def _check_ended(self, unit: str | None) -> None:
        """Outside a load: ``unit`` (or, for None, the last load) is complete, else
        :class:`IncompleteLoadError`, caused by the last load's error if it broke."""
        error = self._tracker.error if self._state in ("failed", "cancelled") else None
        try:
            if unit is not None:
                self._tracker.check(unit)
            elif error is not None:
                how = "failed" if self._state == "failed" else "was cancelled"
                raise IncompleteLoadError(f"the load {how} after its units landed: {self._error}")
        except IncompleteLoadError as err:
            if error is not None:
                raise err from error
            raise

    def statistics(self) -> LoadStatistics:
        self._settle()
        staging = self._staging.statistics() if self._staging is not None else None
        return LoadStatistics(
            state=self._state,
            device=str(self.device),
            files=len(self._run_plan.files),
            tensors=len(self._run_plan.routes),
            tensors_landed=self._tracker.landed_routes,
            units=len(self.plan.units),
            units_complete=self._tracker.complete_units,
            bytes_total=self.plan.nbytes,
            bytes_needed=self._bytes_needed,
            bytes_read=self._bytes_read,
            bytes_landed=self._bytes_landed,
            reads=self._reads,
            elapsed_s=(self._ended or time.perf_counter()) - self._started
            if self._started
            else 0.0,
            staging_budget=self._staging_budget,
            staging_peak=staging.peak_in_use if staging else self._staging_peak,
            unit_completed_at={
                u: s.completed_at
                for u, s in self._tracker.states().items()
                if s.completed_at is not None
            },
            error=self._error,
            transfer=self._transfer,
        )

    # --- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        """Mark every unit incomplete; keeps every allocation (pointers stay valid)."""
        self._check_open()
        self._settle()
        if self._state == "loading":
            raise LoadError("cannot reset while a load is running")
        self._tracker.reset()
        self._state = "empty"
        self._error = None
        self._reset_counters()

    def start(
        self,
        checkpoint: Checkpoint,
        *,
        plan: Plan | None = None,
        options: LoadOptions | None = None,
        on_unit_ready: UnitCallback | None = None,
        progress: ProgressCallback | None = None,
    ) -> asyncio.Task[SlabSet]:
        """Begin a load in the background and return its task (owned by this SlabSet:
        :meth:`aclose` cancels it). ``ready()`` and ``statistics()`` work at once."""
        options = options or LoadOptions()
        asyncio.get_running_loop()  # outside one, refused before the state changes
        _check_progress(progress)
        self._begin(checkpoint, plan, options)
        return self._spawn(self._run(checkpoint, options, on_unit_ready, progress))

    async def load(
        self,
        checkpoint: Checkpoint,
        *,
        plan: Plan | None = None,
        options: LoadOptions | None = None,
        on_unit_ready: UnitCallback | None = None,
        progress: ProgressCallback | None = None,
    ) -> SlabSet:
        """Load ``checkpoint`` into these slabs and return ``self`` when every unit is
        complete. ``plan`` (default: the one the slabs were made for) may be another
        checkpoint's plan with the same slab layout."""
        options = options or LoadOptions()
        _check_progress(progress)
        self._begin(checkpoint, plan, options)
        # A task of its own, so that aclose() can cancel this load and wait for its drain
        # (freeing the slabs under running reads would be a use-after-free).
        task = self._spawn(self._run(checkpoint, options, on_unit_ready, progress))
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closing and task.cancelled() and not (current and current.cancelling()):
                raise ClosedError("the SlabSet was closed while this load ran") from None
            raise
        finally:
            # The task's error keeps this frame in its traceback: a cycle through ``task``.
            del task

    async def aclose(self) -> None:
        """Cancel a running load, wait for it to release everything, free the slabs.
        Idempotent; concurrent calls all return once the slabs are freed."""
        if self._closed:
            return
        if asyncio.current_task() in self._callbacks:
            raise LoadError(
                "aclose() from an on_unit_ready callback would wait for the load, which waits "
                "for this callback: raise from the callback to fail the load instead"
            )
        self._closing = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        # Every load task still running: this one, and a failed one still draining its
        # threads (which a load cancelled before its first step never waited for). Another
        # aclose() meanwhile waits the same: the slabs go only once nothing writes into them.
        # A cancelled caller leaves them allocated.
        while live := [task for task in self._live if not task.done()]:
            for task in live:
                task.add_done_callback(retrieve)  # their end is this close's doing
            await asyncio.wait(live)
        if self._closed:
            return
        self._task = None
        self._closed = True
        self._tensors.clear()
        self._given = None
        self._route_bytes = []
        self._backing = torch.empty(0, dtype=torch.uint8, device=self.device)

    async def __aenter__(self) -> SlabSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- internals ---------------------------------------------------------------------

    def _slab_tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            spec = self.plan.slabs[name]
            start = self._offset[name]
            tensor = self._backing[start : start + spec.nbytes].view(spec.dtype).view(spec.shape)
            self._tensors[name] = tensor
        return tensor

    def _adopt(self, plan: Plan) -> None:
        self._run_plan = plan
        # Per route: the byte tensor its slab lies in (the backing, or a given tensor's
        # bytes), and where in it the slab starts.
        slabs = list(map(operator.attrgetter("slab"), plan.routes))
        self._route_base = list(map(self._offset.__getitem__, slabs))
        if self._given is None:
            self._route_bytes = [self._backing] * len(slabs)
        else:
            self._route_bytes = list(map(self._given.__getitem__, slabs))
        self._tracker = Tracker(plan)
        # Plans are immutable and the backing stays put, so a reload with the same options
        # reuses its reads, destinations included.
        self._read_plans: dict[tuple[Transfer, int, int], _Reads] = {}

    def _reset_counters(self) -> None:
        self._bytes_needed = 0
        self._bytes_read = 0
        self._bytes_landed = 0
        self._reads = 0
        self._started = 0.0
        self._ended: float | None = None
        self._staging: StagingBuffers | None = None
        self._staging_budget = 0
        self._staging_peak = 0
        self._transfer: str = ""

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                "this SlabSet was closed: it holds its slabs no more (a view or bound "
                "parameter still held keeps their memory)"
            )

    def _spawn(self, run: Coroutine[object, object, SlabSet]) -> asyncio.Task[SlabSet]:
        task = asyncio.get_running_loop().create_task(run, name="asyncslab-load")
        self._task = task
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        generation = self._generation

        def settle(task: asyncio.Task[SlabSet]) -> None:
            if self._generation == generation:  # not a later load's
                self._settle(task)
            if self._task is task:
                # An ended task holds its result (this SlabSet) or its error (whose frames
                # hold it): kept here, either is a cycle that only the collector frees, and
                # a dropped SlabSet would keep its slabs (VRAM on a GPU) until then.
                self._task = None
                self._ended_task = weakref.ref(task)

        # Wakes ready() waiters of a load whose task never ran; _settle() in the accessors
        # covers the moment between the task's end and this callback.
        task.add_done_callback(settle)
        return task

    async def _after_earlier_loads(self) -> None:
        """Wait for every earlier load task to end. A failed or cancelled load is
        ``failed``/``cancelled`` (and a ready() caller may start the next) while its task
        still drains its threads: for up to ``read_timeout``, a stuck read may still write
        into the slabs, and only at the end of the drain is the SlabSet marked unusable.
        Waited for even if cancelled meanwhile: aclose() must not free the slabs under
        that read."""
        me = asyncio.current_task()
        earlier = [task for task in self._live if task is not me and not task.done()]
        if earlier:
            await _uncancellable(asyncio.wait(earlier))

    def _delivered(self, error: BaseException | None) -> None:
        """A caller of ready() got the load's error as its cause: asyncio need not log the
        task's exception as never retrieved, which would report one failure twice, the
        second time as if nobody had seen it."""
        task = self._task or (self._ended_task() if self._ended_task else None)
        if error is not None and task is not None:
            # Its task may still be releasing threads and files: mark it when it ends.
            task.add_done_callback(retrieve)

    def _settle(self, task: asyncio.Task[SlabSet] | None = None) -> None:
        """End a load whose task is done but never ran: cancelled before its first step, it
        skipped _run, whose cleanup sets the state. Else the SlabSet would stay "loading",
        refusing every later load, and ready() would wait forever."""
        task = task or self._task
        if self._state == "loading" and task is not None and task.done():
            self._finish("cancelled", asyncio.CancelledError())

    def _begin(self, checkpoint: Checkpoint, plan: Plan | None, options: LoadOptions) -> None:
        self._check_open()
        self._settle()
        transfer = _transfer(options.transfer, self.device)  # refused before anything starts
        if self._broken is not None:
            raise LoadError(f"these slabs cannot be reused: {self._broken}")
        if self._state == "loading":
            raise LoadError("a load into these slabs is already running")
        plan = plan or self.plan
        if plan is not self.plan and plan.layout_fingerprint != self.plan.layout_fingerprint:
            raise PlanError(
                "plan's slab layout differs from the one these slabs were allocated for "
                f"({plan.layout_fingerprint} vs {self.plan.layout_fingerprint})"
            )
        planned = [(f.path, f.size) for f in plan.files]
        given = [(f.path, f.size) for f in checkpoint.files]
        if planned != given:
            raise PlanError(
                "the plan was made for other files than this checkpoint's; plan it with "
                "asyncslab.plan(checkpoint) and pass plan="
            )
        _check_files(plan)
        if plan is not self._run_plan:
            self._adopt(plan)
        if self._task is not None and self._task.done():
            # An earlier load's: _settle() must not take it for this one's (a distributed
            # load sharing reads runs without a task of its own).
            self._task = None
        self._generation += 1
        self._state = "loading"
        self._error = None
        self._reset_counters()
        self._transfer = transfer
        self._started = time.perf_counter()
        self._bytes_needed = sum(r.nbytes for r in plan.routes)
        self._tracker.reset()

    async def _run(
        self,
        checkpoint: Checkpoint,
        options: LoadOptions,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> SlabSet:
        plan = self._run_plan
        generation = self._generation
        read_plans = self._read_plans  # a later plan's _adopt() replaces them
        cuda = self.device.type == "cuda"
        transfer = _transfer(options.transfer, self.device)
        direct = transfer == "direct"
        # A staged read fills one staging buffer: no larger than the buffer as allocated
        # (pinned ones are rounded down, see staging_budget); a mapped read's window is
        # the buffer size asked, as no buffer is made.
        budget = staging_budget(options.staging_bytes, options.staging_buffers, cuda)
        if direct:
            read_size = options.read_size
        elif transfer == "staged":
            read_size = budget // options.staging_buffers
        else:
            read_size = options.staging_bytes // options.staging_buffers
        workers = options.io_workers if direct else options.staging_buffers
        # One thread per read in flight: a cold cache needs the reads in flight (two on two
        # cores left storage idle), and niced threads with short syscalls (see _read) leave
        # the event loop a core the moment it wakes.
        pool = IoPool(workers, nice=options.io_nice)
        fds: dict[int, int] = {}
        mappings: Mappings | None = None
        staging: StagingBuffers | None = None
        loaded = False
        try:
            await self._after_earlier_loads()
            if self._broken is not None:  # found by the previous load's release
                raise LoadError(f"these slabs cannot be reused: {self._broken}")
            # Planning the reads takes tens of ms for ten thousand tensors: off the loop.
            key = (transfer, read_size, options.coalesce_gap)
            reads = self._read_plans.get(key)
            if reads is None:
                reads = await pool.run(self._plan_reads, key)
                self._read_plans[key] = reads
            sched = reads.schedule
            for i, shard in enumerate(plan.files):
                fds[i] = _open_checked(
                    shard.path, shard.size, shard.inode, shard.mtime_ns, shards=len(plan.files)
                )
            paths = [str(shard.path) for shard in plan.files]  # for errors
            copier = CudaCopier(self.device, options.streams) if cuda else CpuCopier()
            if direct:
                read_one = self._direct_reads(reads, fds, paths)
            elif transfer == "mapped":
                try:
                    mappings = Mappings(
                        [fds[i] for i in range(len(paths))], [f.size for f in plan.files], paths
                    )
                except OSError as err:
                    raise ReadError(f"cannot map the shards: {err.strerror or err}") from err
                registry = CudaRegistry(self.device) if cuda else PopulateRegistry()
                read_one = self._mapped_reads(reads, mappings, registry, copier, paths)
            else:
                # Pinning blocks for long: each I/O thread pins its own buffer when it first
                # reads (see _staging).
                staging = StagingBuffers(
                    budget, options.staging_buffers, lambda size: _staging_buffer(size, cuda)
                )
                self._staging = staging
                self._staging_budget = budget
                read_one = self._staged_reads(reads, fds, paths, staging, copier)
            error = await self._read_and_call_back(
                sched, paths, read_one, pool, options, workers, on_unit_ready, progress
            )
            if error is not None:
                # Raised here, not in the handler that caught the task group's errors: as
                # that group's context, the error would hold the group's frames, and they
                # the task group, whose parent task holds the error (a cycle).
                try:
                    raise error from error.__cause__
                finally:
                    error = None
            if not self.complete:
                missing = [u for u in plan.units if not self._tracker.is_complete(u)]
                raise IncompleteLoadError(f"load finished with incomplete units {missing[:5]}")
            loaded = True
        except asyncio.CancelledError as err:
            self._finish("cancelled", err)
            raise
        except AsyncSlabError as err:
            self._finish("failed", err)
            raise
        except Exception as err:
            raise self._failed(err) from err
        finally:
            try:
                # All of the release, even if cancelled meanwhile (the cancel is re-raised
                # after it): leaving early leaked the fds and the I/O threads.
                await _uncancellable(
                    self._release_load(
                        pool, fds, mappings, staging, options, generation, read_plans
                    )
                )
            except asyncio.CancelledError:
                if loaded:  # every unit had landed; the cancel came while releasing
                    self._finish("complete")
                self._report_end(progress, generation)
                raise
            if not loaded:
                self._report_end(progress, generation)
        self._finish("complete")
        if progress is not None:
            try:
                _refuse_awaitable(progress(self.statistics()), "progress")
            except Exception as err:  # as one during the load: the load failed
                raise self._failed(err) from err
        return self

    def _failed(self, err: Exception) -> LoadError:
        """Fail the load with ``err`` wrapped. (Not a local of the frame raising it: that
        frame lies in its traceback.)"""
        wrapped = LoadError(f"load failed: {err!r}")
        wrapped.__cause__ = err  # before _finish keeps a copy of it
        self._finish("failed", wrapped)
        return wrapped

    async def _read_and_call_back(
        self,
        sched: Schedule,
        paths: Sequence[str],
        read_one: _ReadOne,
        pool: IoPool,
        options: LoadOptions,
        workers: int,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> BaseException | None:
        """The reads, and a unit callback per unit as it completes, in one task group; the
        error that broke them (the rest are its consequences: cancelled siblings)."""
        callbacks = self._callbacks
        try:
            async with asyncio.TaskGroup() as tg:

                def unit_done(unit: str) -> None:
                    if on_unit_ready is not None:
                        task = tg.create_task(_callback(on_unit_ready, unit, self))
                        callbacks.add(task)
                        task.add_done_callback(callbacks.discard)

                self._tracker.begin(unit_done)
                for route in sched.empty:
                    self._tracker.land(route, 0)
                workers = min(workers, max(1, len(sched.ops)))
                tg.create_task(
                    self._read_all(sched.ops, paths, read_one, pool, options, workers, progress)
                )
        except BaseExceptionGroup as group:
            # Nobody sees the group: its traceback goes. It holds the task group's exit
            # frame, which holds the group (a cycle through the error it wraps).
            group.__traceback__ = None
            return _first_error(group)
        except asyncio.CancelledError as err:
            # The same for a cancellation the task group passes on, raised again from here.
            err.__traceback__ = None
            raise
        finally:
            # unit_done stays with the tracker until the load finishes: it must not hold
            # the task group, whose parent task holds a failed load's error.
            tg = None  # type: ignore[assignment]
        return None

    def _report_end(self, progress: ProgressCallback | None, generation: int) -> None:
        """The final progress call of a load that failed or was cancelled: without it, a bar
        or a health check fed by the callback would go on saying "loading"."""
        if progress is None or self._generation != generation:  # a later load began
            return
        try:
            _refuse_awaitable(progress(self.statistics()), "progress")
        except Exception:
            # The load has failed already, with the error that matters; a callback that
            # also fails to report it must not replace that error.
            pass

    async def _release_load(
        self,
        pool: IoPool,
        fds: Mapping[int, int],
        mappings: Mappings | None,
        staging: StagingBuffers | None,
        options: LoadOptions,
        generation: int,
        read_plans: dict[tuple[Transfer, int, int], _Reads],
    ) -> None:
        drained = await pool.drain(options.read_timeout)
        await pool.close(wait=drained)
        if staging is not None and self._generation == generation:  # no later load began
            self._staging = None
            self._staging_peak = staging.statistics().peak_in_use
        if drained:
            _release(list(fds.values()), staging, mappings)
        else:
            # A read stuck in a thread still reads its fd (or copies out of a mapping) and
            # writes into these slabs (or a staging buffer) when it wakes: closing the fd now
            # would let an unrelated open reuse its number, and aclose() would free the
            # memory under it. Keep all of them until the last such read returns.
            keep = [self._backing, self._given, read_plans]
            pool.when_idle(lambda: _release(list(fds.values()), staging, mappings, keep))
            self._broken = (
                "a read thread did not return within read_timeout and may still write "
                "into them; allocate a new SlabSet"
            )

    def _finish(self, state: State, error: BaseException | None = None) -> None:
        self._state = state
        self._error = None if error is None else (str(error) or type(error).__name__)
        self._ended = time.perf_counter()
        if error is None:
            self._tracker.finish()
        else:
            self._tracker.fail(error)

    def _plan_reads(self, key: tuple[Transfer, int, int]) -> _Reads:
        """Runs on an I/O thread: the reads of a transfer and, for direct reads, the
        destinations of every read (the backing never moves while this SlabSet is open)."""
        with _gc_paused():  # many small objects, none cyclic (see _format)
            return self._plan_reads_now(key)

    def _plan_reads_now(self, key: tuple[Transfer, int, int]) -> _Reads:
        transfer, read_size, gap = key
        plan = self._run_plan
        if transfer == "mapped":
            # Windows of whole pages: at least one page, else a multiple of pages.
            window = max(PAGE, read_size - read_size % PAGE)
            return _Reads(windows(plan, window=window))
        sched = schedule(plan, max_read=read_size, gap=gap)
        if transfer == "staged":
            return _Reads(sched)
        scratch = torch.empty(max(1, gap), dtype=torch.uint8)
        if self._given is None:
            start = self._backing.data_ptr()
            addresses = [start + base for base in self._route_base]
        else:
            at = {name: given.data_ptr() for name, given in self._given.items()}
            addresses = [at[route.slab] for route in plan.routes]
        scatters = direct_scatters(sched.ops, addresses, scratch.data_ptr())
        return _Reads(sched, scatters, scratch)

    def _direct_reads(
        self, reads: _Reads, fds: Mapping[int, int], paths: Sequence[str]
    ) -> _ReadOne:
        """Reads straight into host slabs, each scattered by one ready-made iovec array."""
        ops, scatters = reads.schedule.ops, reads.scatters
        assert scatters is not None

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            return read_direct(fds[op.file], op, scatters[index], paths[op.file])

        return read_one

    def _staged_reads(
        self,
        reads: _Reads,
        fds: Mapping[int, int],
        paths: Sequence[str],
        staging: StagingBuffers,
        copier: Copier,
    ) -> _ReadOne:
        """Reads into the thread's own staging buffer, then copies into the slabs; returns
        once the copies completed, so the thread's next read may overwrite the buffer."""
        ops = reads.schedule.ops
        copy = self._copy_named(copier, paths)

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            with staging.use(worker) as buffer:
                n = read_staged(fds[op.file], op, buffer, paths[op.file])
                copy(op, buffer, worker)
            return n

        return read_one

    def _mapped_reads(
        self,
        reads: _Reads,
        mappings: Mappings,
        registry: Registry,
        copier: Copier,
        paths: Sequence[str],
    ) -> _ReadOne:
        """Copies straight out of the mapped shards, each read's pages registered for the
        time of its copies (see _mapped); returns once the copies completed."""
        ops = reads.schedule.ops
        copy = self._copy_named(copier, paths)

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            return transfer(
                op, mappings, registry, lambda o, src: copy(o, src, worker), paths[op.file]
            )

        return read_one

    def _copy_named(
        self, copier: Copier, paths: Sequence[str]
    ) -> Callable[[ReadOp, torch.Tensor, int], None]:
        """``copier.copy`` for one read's bytes in ``source``, a failure raised as a
        :class:`LoadError` naming the read and its first tensor."""
        slabs = weakref.ref(self)  # as in _read_all: the closure must not keep the slabs
        route_base = self._route_base
        routes, device = self._run_plan.routes, self.device

        def copy(op: ReadOp, source: torch.Tensor, worker: int) -> None:
            try:
                owner = slabs()
                if owner is None:  # a read stuck past read_timeout, returning too late
                    raise LoadError("the SlabSet is gone")
                copier.copy(op, source, owner._route_bytes, route_base, worker)
            except Exception as err:
                first = routes[op.pieces[0][0]]
                raise LoadError(
                    f"copy to {device} of the read of {op.nbytes} bytes at offset "
                    f"{op.offset} ({len(op.pieces)} pieces, the first for "
                    f"{first.describe()}) failed: {first_line(err)}",
                    file=paths[op.file],
                    tensor=first.tensor,
                    offset=op.offset,
                    slab=first.slab,
                    slot=first.slot,
                ) from err

        return copy

    async def _read_all(
        self,
        ops: Sequence[ReadOp],
        paths: Sequence[str],
        read_one: _ReadOne,
        pool: IoPool,
        options: LoadOptions,
        workers: int,
        progress: ProgressCallback | None,
    ) -> None:
        """Every read of ``ops``, by ``workers`` I/O threads that each take the next read
        themselves (``read_one(thread, index)``) and report it here without waiting (see
        ReadFeed); this task lands what arrives and watches for reads taking longer than
        ``read_timeout``."""
        feed = ReadFeed(
            [op.nbytes for op in ops],
            workers,
            max_bytes_per_s=options.max_bytes_per_s,
            started=self._started,
        )
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        land = self._tracker.land
        broken: list[BaseException] = []

        def fail(err: BaseException) -> None:
            broken.append(err)
            feed.stop()

        ticker = _Ticker(progress, options.progress_interval, self.statistics, fail)

        def landed(index: int, n: int) -> None:  # on the loop thread, in arrival order
            # A load that is over or being torn down (this task cancelled: the load was
            # cancelled, or a unit callback failed) lands nothing more, so no unit completes
            # and no callback is started for a task group that is shutting down.
            if feed.stopped or (me is not None and me.cancelling()):
                return
            try:
                self._reads += 1
                self._bytes_read += n
                total = 0
                for route, _, _, nbytes in ops[index].pieces:
                    land(route, nbytes)
                    total += nbytes
                self._bytes_landed += total
                ticker.tick()
            except Exception as err:  # a landing or progress-callback error ends the load
                fail(err)

        def drive(worker: int) -> None:  # on an I/O thread
            try:
                while (index := feed.take(worker)) is not None:
                    n = read_one(worker, index)
                    feed.finished(worker)
                    # Queued before this thread's own completion: every read a thread
                    # finished has landed by the time its drive() is seen to return.
                    loop.call_soon_threadsafe(landed, index, n)
                    # Give up the core between reads: with every core busy reading, a
                    # waking event loop otherwise waited milliseconds for one (2 cores,
                    # 4 threads, 3 GiB pre-touched: lag p99 4.8-6.1 ms -> 2.5-3.1, load
                    # time unchanged).
                    _yield()
            except BaseException:
                feed.stop()
                raise

        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    drives = [tg.create_task(pool.run(drive, w)) for w in range(workers)]
                    if options.read_timeout is not None:
                        tg.create_task(_watch(feed, drives, options.read_timeout, ops, paths))
            except BaseException as err:
                # Raised by the task group, it holds the group's exit frame, which holds
                # the error: a cycle through the group and this task (see
                # _read_and_call_back). The errors it wraps keep their own tracebacks.
                err.__traceback__ = None
                raise
            if broken:
                raise broken.pop()
            if not (me is not None and me.cancelling()):
                ticker.flush()
        finally:
            feed.stop()
            ticker.close()
            # A failed load's traceback holds this frame and the drives' (whose closures
            # hold these cells): the task group, its tasks and this task would be a cycle
            # with the error, which holds the destination.
            tg = drives = me = None  # type: ignore[assignment]
            broken.clear()


_ReadOne = Callable[[int, int], int]


def _transfer(transfer: Transfer, device: torch.device) -> Transfer:
    """The transfer a load onto ``device`` uses: ``auto`` resolved, ``direct`` refused for
    a CUDA target (a read cannot land in device memory)."""
    if transfer == "auto":
        return "staged" if device.type == "cuda" else "direct"
    if transfer == "direct" and device.type != "cpu":
        raise LoadError(
            f"transfer='direct' reads into host memory; {device} needs 'staged' or 'mapped'"
        )
    return transfer


_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


async def _watch(
    feed: ReadFeed,
    drives: Sequence[asyncio.Task[None]],
    limit: float,
    ops: Sequence[ReadOp],
    paths: Sequence[str],
) -> None:
    """Until every drive has returned: fail with :class:`ReadTimeoutError` once a read has
    been in flight for ``limit`` seconds. Wakes only when the oldest read would expire."""
    while True:
        oldest = feed.oldest()
        now = time.perf_counter()
        if oldest is not None and now - oldest[0] >= limit:
            op = ops[oldest[1]]
            raise ReadTimeoutError(
                f"read of {op.nbytes} bytes at offset {op.offset} took longer than "
                f"read_timeout={limit}s",
                file=paths[op.file],
                offset=op.offset,
            )
        wait = limit if oldest is None else oldest[0] + limit - now
        _, pending = await asyncio.wait(drives, timeout=max(wait, 0.001))
        if not pending:
            return


@dataclass(frozen=True, slots=True)
class _Reads:
    """A plan's reads for one (read size, gap); for direct reads into host slabs also each
    read's destinations and the scratch buffer that takes the gaps between tensors."""

    schedule: Schedule
    scatters: tuple[Scatter, ...] | None = None
    scratch: torch.Tensor | None = None


def slab_layout(plan: Plan, device: torch.device) -> tuple[dict[str, int], int, list[str]]:
    """Where each slab starts in the one allocation that holds them all, the allocation's
    size, and the zero-size slabs. Offsets are multiples of 64 bytes on a CPU (a cache
    line), 256 on CUDA (the alignment its allocator gives a tensor of its own)."""
    align = 256 if device.type == "cuda" else 64
    offsets: dict[str, int] = {}
    empty: list[str] = []
    total = 0
    for name, spec in plan.slabs.items():
        total = -(-total // align) * align
        offsets[name] = total
        nbytes = spec.nbytes
        total += nbytes
        if nbytes == 0:
            empty.append(name)
    return offsets, total, empty


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(tensors.values())).device


def _given_bytes(
    plan: Plan, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each given slab tensor's bytes, after checking that the tensors are the plan's slabs
    exactly: every slab one, of its dtype and shape, contiguous, on ``device``, and no two
    sharing a byte (each byte is written once; two slabs in one would be a race)."""
    missing = [name for name in plan.slabs if name not in tensors]
    extra = [name for name in tensors if name not in plan.slabs]
    if missing or extra:
        what = f"no tensor for slab {missing[0]!r}" if missing else f"{extra[0]!r} is no slab"
        raise PlanError(
            f"tensors= must hold one tensor per slab of the plan: {what} "
            f"({len(missing)} missing, {len(extra)} not in the plan)",
            slab=(missing or extra)[0],
        )
    spans: list[tuple[int, int, str]] = []
    given: dict[str, torch.Tensor] = {}
    for name, spec in plan.slabs.items():
        tensor = tensors[name]
        got = (tensor.dtype, tuple(tensor.shape))
        if got != (spec.dtype, spec.shape):
            raise PlanError(
                f"tensor for slab {name!r} is {got[0]} {list(got[1])}, the plan's slab "
                f"{spec.dtype} {list(spec.shape)}",
                slab=name,
                expected=(spec.dtype, spec.shape),
                got=got,
            )
        if tensor.device != device:
            raise PlanError(
                f"tensor for slab {name!r} is on {tensor.device}, not {device}", slab=name
            )
        if not tensor.is_contiguous():
            raise PlanError(
                f"tensor for slab {name!r} is not contiguous: reads write its bytes in order",
                slab=name,
            )
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        given[name] = flat
        if spec.nbytes:
            spans.append((flat.data_ptr(), flat.data_ptr() + spec.nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise PlanError(
                f"the tensors for slabs {first!r} and {second!r} share memory: a byte would "
                "be written twice",
                slab=second,
            )
    return given


class _Ticker:
    """Calls the progress callback while the reads run: at once for a read that lands
    ``interval`` seconds or more after the last call, else from a timer at the end of that
    interval — so the latest figures go out within one interval even if nothing lands
    after them (a stalled read, the last read), and a stall still shows (elapsed time,
    falling rate). ``interval`` 0 calls on every landing, and only then.

    A callback failing fails the load: on a landing, the caller's error handling sees it;
    from the timer, ``fail`` gets it."""

    def __init__(
        self,
        callback: ProgressCallback | None,
        interval: float,
        snapshot: Callable[[], LoadStatistics],
        fail: Callable[[BaseException], None],
    ) -> None:
        self._callback = callback
        self._interval = interval
        self._snapshot = snapshot
        self._fail = fail
        self._last = time.perf_counter()
        self._sent = True  # nothing landed since the last call
        self._timer: asyncio.TimerHandle | None = None
        if callback is not None and interval > 0:
            self._timer = asyncio.get_running_loop().call_later(interval, self._beat)

    def tick(self) -> None:
        """A read landed (on the loop thread)."""
        if self._callback is None:
            return
        self._sent = False
        now = time.perf_counter()
        if now - self._last >= self._interval:
            self._send(now)

    def close(self) -> None:
        """The reads ended: no more calls from the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def flush(self) -> None:
        """Send what landed since the last call (the reads ended well: the figures of the
        last reads go out now, not after the unit callbacks)."""
        if self._callback is not None and not self._sent:
            self._send(time.perf_counter())

    def _send(self, now: float) -> None:
        assert self._callback is not None
        self._last = now
        self._sent = True
        result: object = self._callback(self._snapshot())
        _refuse_awaitable(result, "progress")

    def _beat(self) -> None:
        now = time.perf_counter()
        wait = self._last + self._interval - now
        if wait <= 0:
            try:
                self._send(now)
            except Exception as err:
                self._timer = None
                self._fail(err)
                return
            wait = self._interval
        self._timer = asyncio.get_running_loop().call_later(wait, self._beat)


def _check_progress(progress: ProgressCallback | None) -> None:
    if progress is None:
        return
    if not callable(progress):
        raise TypeError(f"progress must be callable, got {type(progress).__name__}")
    if inspect.iscoroutinefunction(progress) or inspect.iscoroutinefunction(
        type(progress).__call__  # an object with an async __call__
    ):
        raise TypeError(
            "progress is an async function; the loader calls it without awaiting (it must "
            "not hold the load up), so it must be a plain function"
        )


def _refuse_awaitable(result: object, what: str) -> None:
    """A callback the loader calls without awaiting returned an awaitable (an ``async def``
    given as ``progress``): it would never run, silently."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # no "never awaited" warning on top of the error
        raise TypeError(
            f"the {what} callback returned {type(result).__name__}; it is called without "
            "being awaited, so it must be a plain function"
        )


async def _callback(callback: UnitCallback, unit: str, slabs: SlabSet) -> None:
    await _await_callback(callback(unit, slabs), unit)


async def _await_callback(pending: object, unit: str) -> None:
    """What a unit callback returned, awaited; its failures as the load reports them."""
    try:
        if not inspect.isawaitable(pending):
            # A plain function: it ran, but the loader awaits the callback (it may do I/O),
            # and torch's "NoneType can't be used in 'await'" would not say why.
            raise LoadError(
                f"on_unit_ready must be an async function (for unit {unit!r} it returned "
                f"{type(pending).__name__}, not an awaitable)"
            )
        await pending
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the load is being torn down
            raise
        # The callback's own doing (it awaited something cancelled): a TaskGroup would take
        # it for a clean end, and the load would report the unit post-processed.
        raise LoadError(f"on_unit_ready callback for unit {unit!r} was cancelled") from None
    except AsyncSlabError:
        raise
    except Exception as err:
        raise LoadError(f"on_unit_ready callback failed for unit {unit!r}: {err!r}") from err


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that broke the load; the rest are consequences (cancelled siblings)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


async def _uncancellable(awaitable: Awaitable[T]) -> T:
    """Finish cleanup even if the task is cancelled again meanwhile, then re-raise."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def _staging_buffer(size: int, pin: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


def _release(
    fds: Sequence[int],
    staging: StagingBuffers | None,
    mappings: Mappings | None,
    *keep: object,
) -> None:
    """Close a load's fds, drop its staging buffers, unmap its shards (``keep``: kept alive
    until now)."""
    for fd in fds:
        os.close(fd)
    if staging is not None:
        staging.close()
    if mappings is not None:
        mappings.close()


def _open_file_limit() -> str:
    try:
        import resource  # Unix only
    except ImportError:  # pragma: no cover - Windows
        return "a limited number of"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "any number of" if soft == resource.RLIM_INFINITY else str(soft)


def _open_checked(
    path: os.PathLike[str], size: int, inode: int, mtime_ns: int, *, shards: int
) -> int:
    """Open one of a load's ``shards`` files, refusing one that changed since planning."""
    try:
        # O_NONBLOCK: a FIFO put in the file's place after planning would otherwise block
        # this open, on the event-loop thread, until a writer comes.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno == errno.EMFILE:
            why += (
                f" (a load keeps all {shards} shard files of its plan open; "
                f"this process may have {_open_file_limit()} files open: raise that limit, "
                "RLIMIT_NOFILE, e.g. with `ulimit -n`)"
            )
        raise ReadError(f"cannot open: {why}", file=path) from err
    try:
        _check_unchanged(path, os.fstat(fd), size, inode, mtime_ns)
    except FileChangedError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # the planned regular file: reads block as usual
    return fd


def _check_unchanged(
    path: os.PathLike[str], st: os.stat_result, size: int, inode: int, mtime_ns: int
) -> None:
    if (st.st_size, st.st_ino, st.st_mtime_ns) != (size, inode, mtime_ns):
        what = f"size {size} -> {st.st_size}" if st.st_size != size else "replaced or modified"
        raise FileChangedError(
            f"file changed since it was planned ({what}); open and plan it again", file=path
        )


def _check_files(plan: Plan) -> None:
    """Before a load changes anything: every shard still as planned. Else a swap refused
    at its first open would have reset the slabs of the model being served. (The open
    checks again: a file may change in between.)"""
    for shard in plan.files:
        try:
            st = os.stat(shard.path)
        except OSError as err:
            raise ReadError(f"cannot open: {err.strerror or err}", file=shard.path) from err
        _check_unchanged(shard.path, st, shard.size, shard.inode, shard.mtime_ns)


async def load(
    checkpoint: Checkpoint,
    plan: Plan,
    *,
    device: str | torch.device = "cpu",
    options: LoadOptions | None = None,
    into: SlabSet | None = None,
    on_unit_ready: UnitCallback | None = None,
    progress: ProgressCallback | None = None,
) -> SlabSet:
    """Execute a validated plan: allocate its slabs on ``device`` (or reuse ``into``'s,
    in place) and write every tensor once into its slot. Returns the complete
    :class:`SlabSet`; on failure or cancellation everything the load held is released and
    the error says which file and tensor broke it."""
    slabs = into if into is not None else SlabSet(plan, device)
    try:
        return await slabs.load(
            checkpoint,
            plan=plan,
            options=options,
            on_unit_ready=on_unit_ready,
            progress=progress,
        )
    except BaseException:
        if into is None:
            await slabs.aclose()
        raise

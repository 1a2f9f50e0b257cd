"""The long-lived side of loading: :class:`SlabSet` holds the slabs (its one allocation,
or tensors it was given), hands them out only once complete, and runs at most one load at a
time into them (a :class:`~._load.Load`, which owns that load's resources).

Ownership and lifetime: a :class:`SlabSet` owns its slab tensors for its whole life; loads
write into them in place, so every pointer stays valid across :meth:`SlabSet.reset` and
reloads (captured CUDA graphs keep working; ``test_reload_keeps_every_pointer``). It keeps
no live error and no ended task: dropped after a failed load, it frees its memory at once,
without waiting for the cyclic collector
(``test_a_dropped_slabset_whose_load_failed_frees_its_slabs_without_the_collector``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping

import torch

from .._failures import first_line
from ..checkpoint import Checkpoint
from ..errors import ClosedError, IncompleteLoadError, LoadError, PlanError
from ..planning import Plan, route_column
from ._load import Health, Load, check_files, check_progress, uncancellable
from ._options import (
    LoadOptions,
    LoadStatistics,
    ProgressCallback,
    State,
    resolve_transfer,
)
from ._read import retrieve
from ._sink import Reads, Sink
from ._strategy import choose
from ._strategy_remote import reads_objects
from ._tracker import Tracker

__all__ = [
    "LoadOptions",
    "LoadStatistics",
    "SlabSet",
    "begin_shared",
    "is_closed",
    "load",
    "settled",
    "slab_layout",
    "void",
]

UnitCallback = Callable[[str, "SlabSet"], Awaitable[None]]


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

    ``clock=`` is what each read in flight is timed on against ``read_timeout`` (seconds,
    never going back; default ``time.perf_counter``): a test passes a clock it moves itself,
    so that whether a read is late is its decision, not a busy machine's.
    """

    # Per route of the plan being loaded: the byte tensor its slab lies in (see _adopt).
    _route_bytes: list[torch.Tensor]

    def __init__(
        self,
        plan: Plan,
        device: str | torch.device | None = None,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._clock = clock
        self.device = _device(device, tensors)
        self.plan = plan
        # The slab tensors made so far; the given tensors' bytes, per slab (None where the
        # slabs are views of one allocation of asyncslab's own); each slab's offset in the
        # backing.
        self._tensors, self._given, self._offset, self._backing = _memory(
            plan, tensors, self.device
        )
        self._health = Health()
        self._adopt(plan)
        self._load = self._idle()
        self._task: asyncio.Task[SlabSet] | None = None
        # Every load task not yet ended (a failed one still drains its threads while the next
        # may have begun), and the unit callbacks running: aclose() waits for the former and
        # must not be awaited from the latter.
        self._live: set[asyncio.Task[SlabSet]] = set()
        self._callbacks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._closing = False
        self._generation = 0
        # The last load's task once it ended, weakly: a failed task holds its error, whose
        # frames hold this SlabSet (see _delivered).
        self._ended_task: weakref.ref[asyncio.Task[SlabSet]] | None = None

    def __repr__(self) -> str:
        return (
            f"SlabSet({len(self.plan.slabs)} slabs, {self.plan.nbytes} bytes on {self.device}, "
            f"state={self._load.state!r})"
        )

    # --- access ------------------------------------------------------------------------

    @property
    def slabs(self) -> Mapping[str, torch.Tensor]:
        return _SlabMapping(self)

    @property
    def state(self) -> State:
        self._settle()
        return self._load.state

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
                    if self._load.state != "loading":
                        _check_ended(self._load, u)
                    await self._tracker.wait(u)
                if unit is not None:
                    return
                task = self._task
                if task is None or task.done():
                    _check_ended(self._load, None)
                    return
                await asyncio.wait([task])
                # Its caller may have reset the slabs, or started another load, before this
                # resumed: judge the slabs as they are now, not the load waited for.
                self._settle()
        except IncompleteLoadError as err:
            self._delivered(err.__cause__)
            raise

    def statistics(self) -> LoadStatistics:
        self._settle()
        return self._load.statistics(self.device)

    # --- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        """Mark every unit incomplete; keeps every allocation (pointers stay valid)."""
        self._check_open()
        self._settle()
        if self._load.state == "loading":
            raise LoadError("cannot reset while a load is running")
        self._tracker.reset()
        self._load = self._idle()

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
        check_progress(progress)
        load = self._begin(checkpoint, plan, options)
        return self._spawn(self._run(load, on_unit_ready, progress))

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
        check_progress(progress)
        load = self._begin(checkpoint, plan, options)
        # A task of its own, so that aclose() can cancel this load and wait for its drain
        # (freeing the slabs under running reads would be a use-after-free).
        task = self._spawn(self._run(load, on_unit_ready, progress))
        del load
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
        self._load.sink.release()
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
        slabs = route_column(plan.routes, "slab")
        self._route_base = list(map(self._offset.__getitem__, slabs))
        if self._given is None:
            self._route_bytes = [self._backing] * len(slabs)
        else:
            self._route_bytes = list(map(self._given.__getitem__, slabs))
        self._tracker = Tracker(plan)
        # Plans are immutable and the slabs stay put, so a reload with the same options
        # reuses its reads, destinations included.
        self._read_plans: dict[tuple[str, int, int], Reads] = {}

    def _sink(self) -> Sink:
        backing = self._backing if self._given is None else None
        return Sink(
            self._run_plan,
            self.device,
            self._route_bytes,
            self._route_base,
            self._tracker,
            backing=backing,
        )

    def _idle(self) -> Load:
        """What statistics() reports before a load, and after a reset."""
        return Load(
            self._run_plan,
            self._sink(),
            LoadOptions(),
            None,
            transfer="",
            read_plans=self._read_plans,
            health=self._health,
            state="empty",
        )

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
                # a dropped SlabSet would keep its slabs (VRAM on a GPU) until then
                # (test_a_dropped_slabset_frees_its_slabs_without_the_garbage_collector).
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
            await uncancellable(asyncio.wait(earlier))

    def _delivered(self, error: BaseException | None) -> None:
        """A caller of ready() got the load's error as its cause: asyncio need not log the
        task's exception as never retrieved, which would report one failure twice, the
        second time as if nobody had seen it
        (``test_a_failure_ready_reported_is_not_logged_again_as_never_retrieved``)."""
        task = self._task or (self._ended_task() if self._ended_task else None)
        if error is not None and task is not None:
            # Its task may still be releasing threads and files: mark it when it ends.
            task.add_done_callback(retrieve)

    def _settle(self, task: asyncio.Task[SlabSet] | None = None) -> None:
        """End a load whose task is done but never ran: cancelled before its first step, it
        skipped _run, whose cleanup sets the state. Else the SlabSet would stay "loading",
        refusing every later load, and ready() would wait forever."""
        task = task or self._task
        if self._load.state == "loading" and task is not None and task.done():
            self._load.finish("cancelled", asyncio.CancelledError())

    def _begin(
        self,
        checkpoint: Checkpoint,
        plan: Plan | None,
        options: LoadOptions,
        *,
        shared: bool = False,
    ) -> Load:
        self._check_open()
        self._settle()
        resolve_transfer(options.transfer, self.device)  # refused before anything starts
        if self._health.broken is not None:
            raise LoadError(f"these slabs cannot be reused: {self._health.broken}")
        if self._load.state == "loading":
            raise LoadError("a load into these slabs is already running")
        plan = _plan_for(checkpoint, plan or self.plan, self.plan)
        strategy = None if shared else choose(options, self.device, objects=reads_objects(plan))
        if plan is not self._run_plan:
            self._adopt(plan)
        if self._task is not None and self._task.done():
            # An earlier load's: _settle() must not take it for this one's (a distributed
            # load sharing reads runs without a task of its own).
            self._task = None
        self._load.superseded = True
        self._tracker.reset()
        self._load = Load(
            plan,
            self._sink(),
            options,
            strategy,
            transfer="shared" if strategy is None else strategy.name,
            read_plans=self._read_plans,
            health=self._health,
            clock=self._clock,
        )
        return self._load

    async def _run(
        self,
        load: Load,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> SlabSet:
        await load.run(self, self._before, on_unit_ready, progress, self._callbacks)
        return self

    async def _before(self) -> None:
        await self._after_earlier_loads()
        if self._health.broken is not None:  # found by the previous load's release
            raise LoadError(f"these slabs cannot be reused: {self._health.broken}")


def _check_ended(last: Load, unit: str | None) -> None:
    """Outside a load: ``unit`` (or, for None, the ``last`` load) is complete, else
    :class:`IncompleteLoadError`, caused by the last load's error if it broke."""
    tracker = last.tracker
    error = tracker.error if last.state in ("failed", "cancelled") else None
    try:
        if unit is not None:
            tracker.check(unit)
        elif error is not None:
            how = "failed" if last.state == "failed" else "was cancelled"
            raise IncompleteLoadError(f"the load {how} after its units landed: {last.error}")
    except IncompleteLoadError as err:
        if error is not None:
            raise err from error
        raise


def _plan_for(checkpoint: Checkpoint, plan: Plan, own: Plan) -> Plan:
    """``plan``, checked for a load of ``checkpoint`` into slabs allocated for ``own``: the
    same slab layout, the checkpoint's files as planned."""
    if plan is not own and plan.layout_fingerprint != own.layout_fingerprint:
        raise PlanError(
            "plan's slab layout differs from the one these slabs were allocated for "
            f"({plan.layout_fingerprint} vs {own.layout_fingerprint})"
        )
    planned = [(f.path, f.size) for f in plan.files]
    given = [(f.path, f.size) for f in checkpoint.files]
    if planned != given:
        raise PlanError(
            "the plan was made for other files than this checkpoint's; plan it with "
            "asyncslab.plan(checkpoint) and pass plan="
        )
    check_files(plan)
    return plan


def _device(
    device: str | torch.device | None, tensors: Mapping[str, torch.Tensor] | None
) -> torch.device:
    """The device the slabs go on: ``device``, else the given tensors', else the CPU."""
    if device is None:
        device = _device_of(tensors) if tensors else "cpu"
    chosen = torch.device(device)
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {chosen} is not supported (cpu or cuda)")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {chosen} requested, but CUDA is not available")
    if chosen.type == "cuda" and chosen.index is None:
        # "cuda" means the current device when the slabs are made; pinned here, as the
        # copies run on I/O threads, whose current device is device 0 (on several GPUs
        # their streams, events and registrations would be on the wrong one;
        # test_cuda_device_without_an_index_is_the_current_one).
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _memory(
    plan: Plan, tensors: Mapping[str, torch.Tensor] | None, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, int], torch.Tensor]:
    """The slabs' memory, as :class:`SlabSet` keeps it: the slab tensors made so far, the
    given tensors' bytes per slab (``None`` for an allocation of asyncslab's own), each
    slab's offset in the backing, and the backing."""
    if tensors is None:
        offsets, backing = _allocate(plan, device)
        return {}, None, offsets, backing
    # An engine's own tensors (its parameters, or views of them): written in place, never
    # reallocated; the SlabSet gates access to them as to its own slabs.
    given = _given_bytes(plan, tensors, device)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    return dict(tensors), given, dict.fromkeys(plan.slabs, 0), empty


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


def _allocate(plan: Plan, device: torch.device) -> tuple[dict[str, int], torch.Tensor]:
    """Every slab's offset in one allocation, and the allocation."""
    # One allocation holds every slab; slab tensors are views of it, made when first asked
    # for. An allocation per slab (with its views and a buffer for reads) costs a fixed
    # overhead per slab, which a plan of hundreds of thousands of small tensors multiplies
    # into seconds (figures in docs/performance.md).
    offsets, total, empty = slab_layout(plan, device)
    try:
        backing = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    except RuntimeError as err:
        raise LoadError(
            f"cannot allocate {total} bytes for {len(plan.slabs)} slabs on "
            f"{device}: {first_line(err)}"
        ) from err
    for name in empty:
        spec = plan.slabs[name]
        # A zero-size shape whose other dimensions pass 2**63 is valid in a header but not
        # in torch (a view would not notice): refuse it now.
        try:
            torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        except (RuntimeError, TypeError) as err:
            raise LoadError(
                f"cannot make slab {name!r} of shape {list(spec.shape)} "
                f"({spec.dtype}): {first_line(err)}",
                slab=name,
            ) from err
    return offsets, backing


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


# --- for the distributed load, which moves the bytes itself ----------------------------------


def begin_shared(slabs: SlabSet, checkpoint: Checkpoint, plan: Plan, options: LoadOptions) -> Load:
    """Begin a load of ``slabs`` whose bytes someone else moves (through the returned
    load's :meth:`~._load.Load.land`), and who ends it (:meth:`~._load.Load.finish`)."""
    return slabs._begin(checkpoint, plan, options, shared=True)


async def settled(slabs: SlabSet) -> None:
    """Until no earlier load of ``slabs`` is still releasing (it may still write)."""
    await slabs._after_earlier_loads()


def is_closed(slabs: SlabSet) -> bool:
    return slabs._closed


def void(slabs: SlabSet) -> None:
    """No unit of the failed last load of ``slabs`` stays usable (see Load.void)."""
    slabs._load.void()


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

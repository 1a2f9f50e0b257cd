"""The loads of one :class:`~._slabs.SlabSet`, one at a time (:class:`Loads`): each begun
here against the slabs' memory, run to its end as a task of its own — or, shared, driven by
whoever moves its bytes (the distributed load) — and the last one kept for what it reports.

A load runs start to end on its own (:meth:`~._load.Load.run`); its task's end is the one
moment it reports back here. Nothing here holds the ``SlabSet``: an ended task, or an error
whose frames hold one, is kept only weakly, so a dropped ``SlabSet`` frees its slabs at once.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from ..checkpoint import Checkpoint
from ..errors import ClosedError, IncompleteLoadError, LoadError, PlanError
from ..planning import Plan
from ._load import Health, Load, check_files, uncancellable
from ._memory import SlabMemory
from ._options import LoadOptions, ProgressCallback, State, UnitCallback, resolve_transfer
from ._read import retrieve
from ._strategy import choose
from ._strategy_remote import reads_objects

__all__ = ["Loads"]

T = TypeVar("T")


class Loads:
    """The loads into ``memory``: at most one running, each a :class:`~._load.Load`.

    A SlabSet runs its own (:meth:`start`). A distributed load, which moves the bytes
    itself, drives one through this interface:

    * ``await loads.settled()`` — no earlier load still releasing (it may still write);
    * ``load = loads.begin_shared(checkpoint, plan, options)`` — a load whose bytes land
      through ``load.land`` and that ``load.finish`` ends, gated and reported as any other;
    * ``loads.closed`` — whether the SlabSet's owner closed it meanwhile;
    * ``loads.void()`` — after a failure elsewhere, no unit of the last load stays usable.
    """

    def __init__(self, memory: SlabMemory, clock: Callable[[], float] = time.perf_counter):
        self._memory = memory
        self._clock = clock
        self._health = Health()
        self._current = self._idle()
        # The running load's task; every load task not yet ended (a failed one still drains
        # its threads while the next may have begun).
        self._task: asyncio.Task[object] | None = None
        self._live: set[asyncio.Task[object]] = set()
        # The last load's task once it ended, weakly: a failed task holds its error, whose
        # frames hold the SlabSet (see _delivered).
        self._ended_task: weakref.ref[asyncio.Task[object]] | None = None
        self._closing = False
        self._closed = False

    @property
    def current(self) -> Load:
        """The running load, else the last one (an idle one, ``"empty"``, before any and
        after a reset)."""
        self._end_unstarted()
        return self._current

    @property
    def state(self) -> State:
        return self.current.state

    @property
    def closing(self) -> bool:
        """:meth:`close` began (a load cancelled now was cancelled by it)."""
        return self._closing

    @property
    def closed(self) -> bool:
        """:meth:`close` ended: the slabs are freed, nothing is handed out any more."""
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                "this SlabSet was closed: it holds its slabs no more (a view or bound "
                "parameter still held keeps their memory)"
            )

    # --- beginning and running -----------------------------------------------------------

    def begin(self, checkpoint: Checkpoint, plan: Plan | None, options: LoadOptions) -> Load:
        """A load of ``checkpoint`` by its transfer strategy, to :meth:`start`."""
        return self._begin(checkpoint, plan, options, shared=False)

    def begin_shared(self, checkpoint: Checkpoint, plan: Plan, options: LoadOptions) -> Load:
        """A load whose bytes someone else moves (through :meth:`~._load.Load.land`), and
        who ends it (:meth:`~._load.Load.finish`)."""
        return self._begin(checkpoint, plan, options, shared=True)

    def start(
        self,
        load: Load,
        owner: T,
        on_unit_ready: UnitCallback | None,
        progress: ProgressCallback | None,
    ) -> asyncio.Task[T]:
        """Run ``load`` (just begun) in a task of its own, which returns ``owner`` (its
        SlabSet, handed to ``on_unit_ready``); it first waits for every earlier load still
        releasing."""
        earlier = [task for task in self._live if not task.done()]
        run = _run(load, earlier, owner, on_unit_ready, progress)
        task = asyncio.get_running_loop().create_task(run, name="asyncslab-load")
        self._task = task
        self._live.add(task)
        task.add_done_callback(self._live.discard)

        def ended(task: asyncio.Task[T]) -> None:
            # The load reports back here once, as its task ends.
            self._end_unstarted(load, task)
            if self._task is task:
                # An ended task holds its result (the SlabSet) or its error (whose frames
                # hold it): kept here, either is a cycle that only the collector frees, and
                # a dropped SlabSet would keep its slabs (VRAM on a GPU) until then
                # (test_a_dropped_slabset_frees_its_slabs_without_the_garbage_collector).
                self._task = None
                self._ended_task = weakref.ref(task)

        task.add_done_callback(ended)
        return task

    async def settled(self) -> None:
        """Until no earlier load is still releasing. A failed or cancelled load is
        ``failed``/``cancelled`` while its task still drains its threads: for up to
        ``read_timeout``, a stuck read may still write into the slabs."""
        me = asyncio.current_task()
        earlier = [task for task in self._live if task is not me and not task.done()]
        if earlier:
            # Waited for even if cancelled meanwhile: the slabs must not be freed (or
            # reloaded) under that read.
            await uncancellable(asyncio.wait(earlier))

    # --- after a load ----------------------------------------------------------------------

    async def wait(self, unit: str | None) -> None:
        """What ``SlabSet.ready(unit)`` waits for (see there)."""
        self._end_unstarted()
        units = list(self._memory.plan.units) if unit is None else [unit]
        try:
            while True:
                for u in units:
                    if self._current.state != "loading":
                        _check_ended(self._current, u)
                    await self._current.tracker.wait(u)
                if unit is not None:
                    return
                task = self._task
                if task is None or task.done():
                    _check_ended(self._current, None)
                    return
                await asyncio.wait([task])
                # Its caller may have reset the slabs, or started another load, before this
                # resumed: judge the slabs as they are now, not the load waited for.
                self._end_unstarted()
        except IncompleteLoadError as err:
            self._delivered(err.__cause__)
            raise

    def reset(self) -> None:
        """Every unit incomplete, the last load forgotten."""
        if self.state == "loading":
            raise LoadError("cannot reset while a load is running")
        self._memory.tracker.reset()
        self._current = self._idle()

    def void(self) -> None:
        """No unit of the failed last load stays usable (see :meth:`~._load.Load.void`)."""
        self._current.void()

    async def close(self) -> None:
        """Cancel a running load, wait for every load task to release everything, free the
        memory. Idempotent; concurrent calls all return once the memory is freed."""
        if self._closed:
            return
        if asyncio.current_task() in self._current.callbacks:
            raise LoadError(
                "aclose() from an on_unit_ready callback would wait for the load, which waits "
                "for this callback: raise from the callback to fail the load instead"
            )
        self._closing = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        # Every load task still running: this one, and a failed one still draining its
        # threads (which a load cancelled before its first step never waited for). Another
        # close() meanwhile waits the same: the slabs go only once nothing writes into them.
        # A cancelled caller leaves them allocated.
        while live := [task for task in self._live if not task.done()]:
            for task in live:
                task.add_done_callback(retrieve)  # their end is this close's doing
            await asyncio.wait(live)
        if self._closed:
            return
        self._task = None
        self._closed = True
        self._memory.free()
        self._current.sink.release()

    # --- internals -------------------------------------------------------------------------

    def _begin(
        self, checkpoint: Checkpoint, plan: Plan | None, options: LoadOptions, *, shared: bool
    ) -> Load:
        memory = self._memory
        self.check_open()
        self._end_unstarted()
        resolve_transfer(options.transfer, memory.device)  # refused before anything starts
        if self._health.broken is not None:
            raise LoadError(f"these slabs cannot be reused: {self._health.broken}")
        if self.state == "loading":
            raise LoadError("a load into these slabs is already running")
        plan = _plan_for(checkpoint, plan or memory.plan, memory.plan)
        strategy = None if shared else choose(options, memory.device, objects=reads_objects(plan))
        if plan is not memory.run_plan:
            memory.adopt(plan)
        if self._task is not None and self._task.done():
            # An earlier load's: it must not be taken for this one's (a shared load runs
            # without a task of its own).
            self._task = None
        self._current.superseded = True
        memory.tracker.reset()
        self._current = Load(
            plan,
            memory.sink(),
            options,
            strategy,
            transfer="shared" if strategy is None else strategy.name,
            read_plans=memory.read_plans,
            health=self._health,
            clock=self._clock,
        )
        return self._current

    def _idle(self) -> Load:
        """What statistics() reports before a load, and after a reset."""
        return Load(
            self._memory.run_plan,
            self._memory.sink(),
            LoadOptions(),
            None,
            transfer="",
            read_plans=self._memory.read_plans,
            health=self._health,
            state="empty",
        )

    def _end_unstarted(self, load: Load | None = None, task: asyncio.Task[T] | None = None) -> None:
        """End a load whose task is done but never ran: cancelled before its first step, it
        skipped :meth:`~._load.Load.run`, whose cleanup sets the state. Else the slabs would
        stay "loading", refusing every later load, and ready() would wait forever. (The
        accessors call this too: for the moment between a task's end and its callback.)"""
        load = load or self._current
        done = task.done() if task is not None else self._task is not None and self._task.done()
        if load is self._current and load.state == "loading" and done:
            load.finish("cancelled", asyncio.CancelledError())

    def _delivered(self, error: BaseException | None) -> None:
        """A caller of ready() got the load's error as its cause: asyncio need not log the
        task's exception as never retrieved, which would report one failure twice, the
        second time as if nobody had seen it
        (``test_a_failure_ready_reported_is_not_logged_again_as_never_retrieved``)."""
        task = self._task or (self._ended_task() if self._ended_task else None)
        if error is not None and task is not None:
            # Its task may still be releasing threads and files: mark it when it ends.
            task.add_done_callback(retrieve)


async def _run(
    load: Load,
    earlier: list[asyncio.Task[object]],
    owner: T,
    on_unit_ready: UnitCallback | None,
    progress: ProgressCallback | None,
) -> T:
    await load.run(earlier, owner, on_unit_ready, progress)
    return owner


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

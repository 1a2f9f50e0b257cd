"""The long-lived side of loading: :class:`SlabSet` holds the slabs (its one allocation,
or tensors it was given: a :class:`~._memory.SlabMemory`), hands them out only once
complete, and runs at most one load at a time into them (its :class:`~._loads.Loads`, each a
:class:`~._load.Load`, which owns that load's resources).

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
from collections.abc import Awaitable, Callable, Iterator, Mapping

import torch

from ..checkpoint import Checkpoint
from ..errors import ClosedError, LoadError
from ..planning import Plan
from ._load import check_progress
from ._loads import Loads
from ._memory import SlabMemory, device_for
from ._options import LoadOptions, LoadStatistics, ProgressCallback, State

__all__ = ["LoadOptions", "LoadStatistics", "SlabSet", "load"]

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

    def __init__(
        self,
        plan: Plan,
        device: str | torch.device | None = None,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device = device_for(device, tensors)
        self.plan = plan
        self._memory = SlabMemory(plan, self.device, tensors)
        self._loads = Loads(self._memory, clock)

    def __repr__(self) -> str:
        return (
            f"SlabSet({len(self.plan.slabs)} slabs, {self.plan.nbytes} bytes on {self.device}, "
            f"state={self._loads.current.state!r})"
        )

    # --- access ------------------------------------------------------------------------

    @property
    def slabs(self) -> Mapping[str, torch.Tensor]:
        return _SlabMapping(self)

    @property
    def state(self) -> State:
        return self._loads.state

    @property
    def complete(self) -> bool:
        tracker = self._memory.tracker
        return all(tracker.is_complete(u) for u in self.plan.units)

    @property
    def loads(self) -> Loads:
        """The loads into these slabs, one at a time. Loading needs none of it: it is how
        a load that moves its bytes itself (:mod:`asyncslab.distributed`) begins one here,
        waits for an earlier one, and voids one that failed elsewhere."""
        return self._loads

    def slab(self, name: str) -> torch.Tensor:
        """The whole slab ``name``; its unit must be complete."""
        self._loads.check_open()
        spec = self.plan.slabs.get(name)
        if spec is None:
            raise KeyError(f"no slab {name!r} in the plan")
        self._check_held(spec.unit)
        self._memory.tracker.check(spec.unit)
        return self._memory.tensor(name)

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
        location = self._memory.run_plan.where(tensor)  # the last load's plan: its tensors
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
        self._loads.check_open()
        await self._loads.wait(unit)

    def statistics(self) -> LoadStatistics:
        return self._loads.current.statistics(self.device)

    # --- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        """Mark every unit incomplete; keeps every allocation (pointers stay valid)."""
        self._loads.check_open()
        self._check_held()
        self._loads.reset()

    def release(self, unit: str) -> None:
        """Let go of complete ``unit``'s tensors, given with ``tensors=``, while the load goes
        on: from an ``on_unit_ready`` callback, an engine that replaces a layer's weights as
        that layer lands (repacking them) then frees the old ones at once, not at the load's
        end. The unit's slabs are handed out no more, and this SlabSet loads no more (a
        reload would write into memory the engine may have freed)."""
        self._loads.check_open()
        if unit not in self.plan.units:
            raise KeyError(f"unit {unit!r} is not in the plan")
        if not self._memory.given:
            raise LoadError(
                "release() lets go of tensors given with tensors=; this SlabSet's slabs "
                "are one allocation of its own, freed whole by aclose()"
            )
        self._memory.tracker.check(unit)
        self._memory.release(unit)

    def _check_held(self, unit: str | None = None) -> None:
        released = self._memory.released
        if released and (unit is None or unit in released):
            which = unit if unit is not None else sorted(released)[0]
            raise ClosedError(
                f"unit {which!r} was released (SlabSet.release): its tensors are the "
                "engine's alone" + ("" if unit is not None else "; this SlabSet loads no more")
            )

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
        self._check_held()
        load = self._loads.begin(checkpoint, plan, options)
        return self._loads.start(load, self, on_unit_ready, progress)

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
        self._check_held()
        load = self._loads.begin(checkpoint, plan, options)
        # A task of its own, so that aclose() can cancel this load and wait for its drain
        # (freeing the slabs under running reads would be a use-after-free).
        task = self._loads.start(load, self, on_unit_ready, progress)
        del load
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._loads.closing and task.cancelled() and not (current and current.cancelling()):
                raise ClosedError("the SlabSet was closed while this load ran") from None
            raise
        finally:
            # The task's error keeps this frame in its traceback: a cycle through ``task``.
            del task

    async def aclose(self) -> None:
        """Cancel a running load, wait for it to release everything, free the slabs.
        Idempotent; concurrent calls all return once the slabs are freed."""
        await self._loads.close()

    async def __aenter__(self) -> SlabSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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

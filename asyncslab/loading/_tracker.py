"""Loading, the tracker: per-unit completeness. A slab is handed out only when every slot of
its unit has landed (and, on a GPU, its copy has finished): an uninitialised backing never escapes.

Landing is counted in bytes per route, so a large tensor split into chunks lands when its
last chunk does; a route landing more bytes than it has is a :class:`DuplicateLandingError`.
All methods run on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .._failures import detached
from ..errors import DuplicateLandingError, IncompleteLoadError
from ..planning import Plan, route_column

__all__ = ["Tracker", "UnitState"]


@dataclass(frozen=True, slots=True)
class UnitState:
    """A snapshot of one unit: routes landed of total, and when it completed (seconds since
    the load started), if it has."""

    unit: str
    landed: int
    total: int
    completed_at: float | None


class Tracker:
    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._route_unit = route_column(plan.routes, "unit")
        self._route_bytes = route_column(plan.routes, "nbytes")
        self._unit_total: dict[str, int] = {u: 0 for u in plan.units}
        for unit in self._route_unit:
            self._unit_total[unit] += 1
        self._on_complete: Callable[[str], None] | None = None
        # One future per waiting call, made in the waiter's loop: an Event would bind to the
        # first loop that waited on it, and a SlabSet reused under another loop (a second
        # asyncio.run) would then fail every ready() with "bound to a different event loop"
        # (test_a_slabset_loads_under_one_event_loop_after_another).
        self._waiters: dict[str, list[asyncio.Future[BaseException | None]]] = {}
        self._error: BaseException | None = None
        self.reset()

    def reset(self) -> None:
        """Every unit incomplete again; allocations elsewhere are untouched."""
        self._remaining = list(self._route_bytes)
        self._done = bytearray(len(self._route_bytes))
        self._landed_routes = dict.fromkeys(self._unit_total, 0)
        self._completed_at: dict[str, float] = {}
        self._started = time.perf_counter()
        self._error = None
        # Waiters stay across a reset: they wait for the next completion.

    def begin(self, on_complete: Callable[[str], None] | None) -> None:
        """Start counting a load (after :meth:`reset`); units without routes complete now."""
        self._on_complete = on_complete
        for unit, total in self._unit_total.items():
            if total == 0:
                self._complete(unit)

    def fail(self, error: BaseException) -> None:
        """The load broke: wake every waiter with ``error`` (units stay incomplete). Later
        waiters get a detached copy: the live error's frames hold the load's owner, which
        holds this tracker."""
        self._error = detached(error)
        for unit in list(self._waiters):
            self._wake(unit, error)
        self._on_complete = None

    def finish(self) -> None:
        self._on_complete = None

    def land(self, route: int, nbytes: int) -> None:
        remaining = self._remaining[route] - nbytes
        if self._done[route] or remaining < 0:
            r = self._plan.routes[route]
            raise DuplicateLandingError(
                f"landed twice in {r.describe()}", file=r.file, tensor=r.tensor, slot=r.slot
            )
        self._remaining[route] = remaining
        if remaining == 0:
            self._done[route] = 1
            unit = self._route_unit[route]
            landed = self._landed_routes[unit] + 1
            self._landed_routes[unit] = landed
            if landed == self._unit_total[unit]:
                self._complete(unit)

    def _complete(self, unit: str) -> None:
        self._completed_at[unit] = time.perf_counter() - self._started
        self._wake(unit)
        if self._on_complete is not None:
            self._on_complete(unit)

    def _wake(self, unit: str, error: BaseException | None = None) -> None:
        for waiter in self._waiters.pop(unit, ()):
            # Done: its caller was cancelled. Closed loop: nobody is left to wake, and waking
            # it would fail the landing with "Event loop is closed"
            # (test_a_waiter_of_a_closed_loop_does_not_break_the_next_load).
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_result(error)

    @property
    def error(self) -> BaseException | None:
        """What broke the last load, until the next :meth:`reset`."""
        return self._error

    def is_complete(self, unit: str) -> bool:
        return unit in self._completed_at

    @property
    def complete_units(self) -> int:
        return len(self._completed_at)

    @property
    def landed_routes(self) -> int:
        return sum(self._landed_routes.values())

    def missing(self, unit: str, limit: int = 8) -> list[str]:
        """Names of tensors of ``unit`` that have not landed (at most ``limit``)."""
        out = []
        for i, r in enumerate(self._plan.routes):
            if r.unit == unit and not self._done[i]:
                out.append(f"{r.tensor} -> {r.slab}{list(r.slot)}")
                if len(out) == limit:
                    break
        return out

    def _unknown(self, unit: str) -> KeyError:
        # Unit names are the plan's ("layers.3", "globals"): show some, a guess rarely fits.
        units = sorted(self._unit_total)
        shown = ", ".join(map(repr, units[:6])) + (" ..." if len(units) > 6 else "")
        return KeyError(f"unit {unit!r} is not in the plan; its {len(units)} units: {shown}")

    def check(self, unit: str) -> None:
        if unit not in self._unit_total:
            raise self._unknown(unit)
        if not self.is_complete(unit):
            landed = self._landed_routes[unit]
            total = self._unit_total[unit]
            missing = self.missing(unit)
            raise IncompleteLoadError(
                f"unit {unit!r} is incomplete: {landed} of {total} tensors landed; missing "
                + ", ".join(missing)
                + (" ..." if total - landed > len(missing) else ""),
                unit=unit,
                landed=landed,
                total=total,
            )

    async def wait(self, unit: str) -> None:
        """Until ``unit`` completes; raises the load's error if the load broke first."""
        if unit not in self._unit_total:
            raise self._unknown(unit)
        if self.is_complete(unit):
            return
        error = self._error
        if error is None:
            waiter: asyncio.Future[BaseException | None]
            waiter = asyncio.get_running_loop().create_future()
            waiters = self._waiters.setdefault(unit, [])
            waiters.append(waiter)
            try:
                error = await waiter
            finally:
                if not waiter.done() or waiter.cancelled():
                    # Cancelled: not left behind for every later wait to step over.
                    with contextlib.suppress(ValueError):
                        waiters.remove(waiter)
                del waiter
        if not self.is_complete(unit):
            try:
                raise IncompleteLoadError(
                    f"unit {unit!r} will not complete: the load failed", unit=unit
                ) from error
            finally:
                del error  # this frame is in the raised error's traceback: no cycle

    def states(self) -> Mapping[str, UnitState]:
        return {
            u: UnitState(u, self._landed_routes[u], t, self._completed_at.get(u))
            for u, t in self._unit_total.items()
        }

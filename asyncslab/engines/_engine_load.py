"""A checkpoint loaded into an engine's own tensors, the engine's own loader deciding where.

The sequence every engine adapter runs, and nothing of any one engine: record the engine's
loader on stand-ins (:func:`~asyncslab.engines._recording.capture`), plan into the tensors
it writes with every byte covered once (:func:`~asyncslab.engines._coverage.plan_into`),
load that plan in place, then hand the tensors the loader transforms (a cast, a computed
value) to the loader itself, as views of the files' mappings, or from object storage read
a window at a time (:func:`~asyncslab.engines._stream.stream_tensors`).
An adapter describes its engine as an :class:`Engine` (its loader, its parameters, the names
it knows the checkpoint's tensors by) and keeps only its engine's glue: finding the files,
options from its configuration, its logging, its report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._os import run
from ..checkpoint import Checkpoint
from ..errors import LoadError
from ..loading import LoadOptions, LoadStatistics, ProgressCallback, SlabSet
from ..planning import Plan
from ._coverage import IntoPlan, plan_into
from ._derive import Derivation, capture_derived
from ._hugepages import advise_huge_pages
from ._placement import Placement, placement
from ._prefault import Prefault
from ._recording import Capture
from ._stream import stream_tensors

__all__ = ["Engine", "EngineLoad", "WeightLoader", "host", "load_into_engine", "run_sync"]

T = TypeVar("T")

#: An engine's own weight loader: it takes ``(name, tensor)`` pairs and copies each where
#: it belongs (vLLM's ``model.load_weights``).
WeightLoader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@dataclass(frozen=True, slots=True)
class Engine:
    """What the sequence needs of an engine, as its adapter found it.

    ``load`` is the engine's own loader: run once on stand-ins to record where each tensor
    goes, then again on the real tensors it transforms. ``parameters`` must each be covered
    byte for byte (by checkpoint tensors, or by what the loader fills itself), except those
    named in ``optional``, which may instead be left as the engine set them. ``buffers`` may
    be written too, and need not be. ``names`` maps the names the loader takes to checkpoint
    names (the loader is given exactly these); ``None``: every checkpoint tensor, under its
    own name. ``stand_ins`` is the device of the tensors the engine's own reader would hand
    its loader. ``order`` is a sort key of the names the loader takes, in the order the
    engine's own reader hands them over: where the loader writes one byte from several
    tensors by design, the last stands (:mod:`._overwrites`); ``None``: checkpoint order.
    """

    load: WeightLoader
    parameters: Sequence[tuple[str, torch.Tensor]]
    buffers: tuple[tuple[str, torch.Tensor], ...] = ()
    names: Mapping[str, str] | None = None
    optional: frozenset[str] = frozenset()
    stand_ins: str = "cpu"
    order: Callable[[str], Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one load into an engine's tensors did.

    ``bytes`` were read straight into the engine's tensors by ``runs`` routes;
    ``transformed`` (checkpoint names, with ``transformed_bytes``) went through the
    engine's loader instead; ``skipped`` it took and dropped; ``defaulted`` are optional
    parameters no checkpoint tensor wrote; ``overwritten`` were not read, every byte of
    theirs written again by a later tensor as the engine's loader does. The loader was run
    on ``recorded`` tensors' stand-ins, the destinations of the others derived from theirs
    (:mod:`._derive`). Seconds: recording the loader (``capture_s``), planning from it with
    every byte checked (``plan_s``), the load, feeding the transformed tensors, and all of
    it."""

    files: int
    tensors: int
    bytes: int
    runs: int
    parameters: int
    transformed: tuple[str, ...]
    transformed_bytes: int
    skipped: tuple[str, ...]
    defaulted: tuple[str, ...]
    capture_s: float
    load_s: float
    transformed_s: float
    total_s: float
    recorded: int = 0
    plan_s: float = 0.0
    overwritten: tuple[str, ...] = ()
    #: The units handed to ``on_unit`` as they landed, in that order.
    handed: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes / self.load_s / 1e9 if self.load_s > 0 else 0.0


def load_into_engine(
    checkpoint: Checkpoint,
    engine: Engine,
    *,
    options: LoadOptions | None = None,
    progress: ProgressCallback | None = None,
    placed: Callable[[Placement], object] | None = None,
    on_unit: Callable[[str], object] | None = None,
) -> EngineLoad:
    """Load ``checkpoint`` into ``engine``'s tensors where its own loader would put each
    byte, in place (every parameter keeps its memory), and return what was done.

    Synchronous, as engines call their loaders: the load runs on an event loop of its own
    (in a thread where this thread runs one already). Raises
    :class:`~asyncslab.errors.CaptureError` if the loader fails on the stand-ins or replaces
    a parameter's memory, :class:`~asyncslab.errors.CoverageError` (before any read) for a
    parameter byte no tensor or two tensors write, and the load's errors. ``placed`` is
    given where each tensor the loader copies whole went (:mod:`._placement`), for a
    reload to read into again.

    ``on_unit`` is called in this thread with each layer (``layers.N``) once all its bytes
    are written, while later layers are read (:class:`_Handover`). By then the load holds
    nothing of it, nor ``engine.parameters`` where a list (emptied once planned): a
    parameter ``on_unit`` replaces is freed as it drops it. Its error cancels the load."""
    options = options or LoadOptions()
    started = time.perf_counter()
    device = _one_device(engine.parameters)
    parameters = len({id(p) for _, p in engine.parameters})
    names = engine.names if engine.names is not None else {n: n for n in checkpoint.tensors}
    # Before the first touch (the recording's fills are one), where huge pages are asked
    # for (off by default, see _hugepages): the parameters then fault in once per huge page
    # instead of once per 4 KiB.
    advise_huge_pages(p for _, p in engine.parameters)
    # The parameters faulted in on a thread of their own while the loader is recorded and
    # the checkpoint read (see _prefault); stopped before the engine's loader transforms
    # tensors, as its casts use every core.
    with Prefault(p for _, p in engine.parameters):
        captured, derivation = _record(checkpoint, engine, names)
        recorded = time.perf_counter()
        into = _plan(checkpoint, captured, engine, names, placed, on_unit is not None)
        del captured  # its views of every parameter, which outlive a layer's processing
        planned = time.perf_counter()
        views = dict(into.tensors)  # the SlabSet's from here on, let go of as layers land
        into = dataclasses.replace(into, tensors={})
        handover = _handover(checkpoint, engine, into, names, options, on_unit)
        if handover is not None:
            loaded = _load_handing_units(
                lambda ready: _load(checkpoint, into.plan, views, device, options, progress, ready),
                handover,
            )
        # Every tensor transformed (a model served in another dtype): nothing to read, no
        # loop, threads or slabs to start for it.
        elif into.plan.routes:
            loaded = run_sync(_load(checkpoint, into.plan, views, device, options, progress))
        else:
            loaded = None
    reads_done = time.perf_counter()
    rest = [n for n in into.transformed if handover is None or n not in handover.fed]
    if rest:
        _transform(checkpoint, engine, rest, names, options)
    finished = time.perf_counter()
    return EngineLoad(
        files=len(checkpoint.files),
        tensors=len(checkpoint.tensors),
        bytes=loaded.bytes_landed if loaded is not None else 0,
        runs=len(into.plan.routes),
        parameters=parameters,
        transformed=tuple(into.transformed),
        transformed_bytes=into.transformed_bytes,
        skipped=into.skipped,
        defaulted=into.defaulted,
        overwritten=into.overwritten,
        capture_s=recorded - started,
        plan_s=planned - recorded,
        recorded=derivation.recorded,
        load_s=loaded.elapsed_s if loaded is not None else 0.0,
        transformed_s=finished - reads_done,
        total_s=finished - started,
        handed=tuple(handover.handed) if handover is not None else (),
    )


def _record(
    checkpoint: Checkpoint, engine: Engine, names: Mapping[str, str]
) -> tuple[Capture, Derivation]:
    """The engine's loader recorded on stand-ins of the tensors it is given (``names``:
    the engine's name -> the checkpoint's)."""
    return capture_derived(
        engine.load,
        [
            (name, checkpoint.tensors[ck].dtype, checkpoint.tensors[ck].shape)
            for name, ck in names.items()
        ],
        [*engine.parameters, *engine.buffers],
        device=engine.stand_ins,
    )


def _plan(
    checkpoint: Checkpoint,
    captured: Capture,
    engine: Engine,
    names: Mapping[str, str],
    placed: Callable[[Placement], object] | None,
    handing: bool,
) -> IntoPlan:
    into = plan_into(
        checkpoint,
        captured,
        engine.parameters,
        names=names,
        optional=engine.optional,
        order=engine.order,
        units_written=handing,
    )
    if placed is not None:
        placed(
            placement(
                captured,
                checkpoint,
                names,
                [*engine.parameters, *engine.buffers],
                # A tensor whose bytes another writes too is read by the stream at reload,
                # in order, not into bytes a later tensor is read into.
                [*into.transformed, *into.skipped, *into.shared],
            )
        )
    return into


def _transform(
    checkpoint: Checkpoint,
    engine: Engine,
    transformed: Iterable[str],
    names: Mapping[str, str],
    options: LoadOptions,
) -> None:
    """The ``transformed`` checkpoint tensors handed to the engine's loader as its own reader
    would: views of the files' mappings, or from object storage a window at a time, so that
    host memory stays two windows where the transformed bytes can be the whole checkpoint
    (one served in another dtype)."""
    engine_name = {ck: name for name, ck in names.items()}
    tensors = stream_tensors(checkpoint, list(transformed), options=host(options))
    with contextlib.closing(tensors):
        engine.load((engine_name[n], t) for n, t in tensors)


async def _load(
    checkpoint: Checkpoint,
    plan: Plan,
    views: MutableMapping[str, torch.Tensor],
    device: torch.device,
    options: LoadOptions,
    progress: ProgressCallback | None,
    ready: Callable[[str], None] | None = None,
) -> LoadStatistics:
    """The plan's load into ``views`` (the engine's tensors; the SlabSet keeps them, this
    mapping is emptied). ``ready``: given each unit as it completes, the unit released."""
    slabs = SlabSet(plan, device, tensors=views)
    views.clear()
    landed = None
    if ready is not None:

        async def landed(unit: str, owner: SlabSet) -> None:
            owner.release(unit)
            ready(unit)

    try:
        await slabs.load(checkpoint, options=options, progress=progress, on_unit_ready=landed)
        return slabs.statistics()
    finally:
        # The SlabSet only lent itself the engine's tensors; closing it frees none of them.
        await slabs.aclose()


def _handover(
    checkpoint: Checkpoint,
    engine: Engine,
    into: IntoPlan,
    names: Mapping[str, str],
    options: LoadOptions,
    on_unit: Callable[[str], object] | None,
) -> _Handover | None:
    """How each layer is handed to ``on_unit`` as it lands, or ``None`` where none can be
    (no ``on_unit``, nothing read in place, or no layer known complete before the end).
    The engine's parameter list, if one, is emptied: the load needs it no more."""
    early = _early(into) if on_unit is not None and into.plan.routes else None
    if on_unit is None or early is None:
        return None
    if isinstance(engine.parameters, list):
        engine.parameters.clear()
    return _Handover(checkpoint, engine, names, options, on_unit, *early)


def _early(into: IntoPlan) -> tuple[dict[str, list[str]], frozenset[str]] | None:
    """Per layer, the transformed tensors that write into it alone, to be handed to the
    loader once its reads have landed, in the order the loader takes them; and the layers
    that wait for the load's end (written by a transformed tensor that writes elsewhere
    too, or writes a byte another tensor writes). ``None``: a transformed tensor of which
    the recording saw no write, so that no layer is known complete before the end."""
    feed: dict[str, list[str]] = {}
    late: set[str] = set()
    for name in into.transformed:
        units = into.transformed_units.get(name, frozenset())
        if not units:
            return None
        (unit, *others) = units
        if others or unit == "globals" or name in into.shared:
            late.update(units)
        else:
            feed.setdefault(unit, []).append(name)
    return feed, frozenset(late)


@dataclass
class _Handover:
    """Hands each layer to ``on_unit`` as it lands, after the transformed tensors that write
    into it alone (``feed``, to the loader in its order), unless it waits for the end
    (``late``: a transformed tensor writes it with another layer; the ``globals`` unit is
    never handed over); keeps what it handed and fed."""

    checkpoint: Checkpoint
    engine: Engine
    names: Mapping[str, str]
    options: LoadOptions
    on_unit: Callable[[str], object]
    feed: Mapping[str, list[str]]
    late: frozenset[str]
    handed: list[str] = dataclasses.field(default_factory=list)
    fed: set[str] = dataclasses.field(default_factory=set)

    def __call__(self, unit: str) -> None:
        if unit in self.late:
            return
        feed = self.feed.get(unit, [])
        if feed:
            _transform(self.checkpoint, self.engine, feed, self.names, self.options)
            self.fed.update(feed)
        self.on_unit(unit)
        self.handed.append(unit)


def _load_handing_units(
    load: Callable[[Callable[[str], None]], Coroutine[Any, Any, LoadStatistics]],
    hand: Callable[[str], object],
) -> LoadStatistics:
    """``load`` run on an event loop in a thread of its own, each layer's unit it reports
    ready given to ``hand`` in this thread (the engine's: its device, its modes) while the
    load goes on. An error of ``hand``'s cancels the load."""
    units: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []

    def ready(unit: str) -> None:
        if unit != "globals":
            units.put(unit)

    async def owned() -> LoadStatistics:
        task = asyncio.current_task()
        assert task is not None
        running.append((asyncio.get_running_loop(), task))
        return await load(ready)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncslab") as pool:
        future = pool.submit(run, owned())
        future.add_done_callback(lambda _: units.put(None))
        try:
            while (unit := units.get()) is not None:
                hand(unit)
        except BaseException:
            for loop, task in running:
                with contextlib.suppress(RuntimeError):  # its loop closed: the load ended
                    loop.call_soon_threadsafe(task.cancel)
            with contextlib.suppress(BaseException):
                future.result()
            raise
        return future.result()


def _one_device(parameters: Iterable[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {p.device for _, p in parameters}
    if len(devices) != 1:
        raise LoadError(
            "asyncslab loads into an engine's parameters on one device; this engine's are "
            f"on {sorted(map(str, devices))}"
        )
    (device,) = devices
    return device


def host(options: LoadOptions) -> LoadOptions:
    """``options`` for a load into host memory (a CUDA load's may ask for staging)."""
    return dataclasses.replace(options, transfer="auto")


def run_sync(work: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from an engine's synchronous call: on uvloop where
    installed, in a thread of its own if this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run(work)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncslab") as pool:
        return pool.submit(run, work).result()

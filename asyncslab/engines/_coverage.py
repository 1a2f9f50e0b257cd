"""A plan whose slabs are an engine's own tensors, from a
:class:`~asyncslab.engines._recording.Capture`.

Each byte run the engine's loader was recorded to copy becomes a slot, and the runs of one
size that lie end to end in one destination a slab (a layer's experts in their fused
parameter: one slab): a view of the destination's storage there, slot by run, and a route
per run reading its elements of the checkpoint tensor (``make_route(elements=...)``).
:func:`asyncslab.plan`'s checks then hold as for any plan (dtype, size, the route reading its
own tensor's bytes), and a :class:`~asyncslab.SlabSet` given those views writes into the
engine's memory in place.

Completeness is checked per byte, before any read: every byte of every required tensor (the
engine's parameters) is written by exactly one checkpoint tensor, or filled by the loader
itself. An optional one (a value the engine sets itself and takes from a checkpoint only if
there: vLLM's KV-cache scales) is either covered so or not written at all. A fused
parameter can look loaded with one expert's slot never written; that slot is named here,
with the checkpoint tensor that would have filled it where a sibling parameter (another
layer's) shows which one.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..checkpoint import Checkpoint, TensorInfo
from ..errors import CoverageError
from ..planning import (
    Claim,
    Plan,
    RouteTable,
    SlabSpec,
    make_route,
    numbers_of,
    plan,
    unit_of_layer,
)
from ._overwrites import resolve
from ._recording import Capture, Run, Write

__all__ = ["IntoPlan", "plan_into"]


@dataclass(frozen=True, slots=True)
class IntoPlan:
    """A plan into given tensors: ``tensors`` (slab name -> view) are what
    ``SlabSet(plan, tensors=...)`` takes. ``transformed`` (checkpoint tensor -> why) are
    loaded by the engine's own loader instead, ``skipped`` are those it takes and drops.
    ``defaulted`` are the optional tensors no checkpoint tensor writes: they keep the
    values the engine gave them. ``overwritten`` are tensors every byte of which a later
    tensor writes again, by the engine's design (:mod:`._overwrites`): not read;
    ``shared`` every tensor that writes a byte another writes too. ``transformed_units``:
    per transformed tensor, the units of the engine's tensors it writes (none where the
    recording saw it write nothing), where asked for."""

    plan: Plan
    tensors: Mapping[str, torch.Tensor]
    transformed: Mapping[str, str]
    skipped: tuple[str, ...]
    fills: int
    defaulted: tuple[str, ...] = ()
    overwritten: tuple[str, ...] = ()
    shared: frozenset[str] = frozenset()
    transformed_units: Mapping[str, frozenset[str]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def transformed_bytes(self) -> int:
        return sum(self.plan.extras["transformed_bytes"].values())


def plan_into(
    checkpoint: Checkpoint,
    captured: Capture,
    required: Iterable[tuple[str, torch.Tensor]],
    *,
    names: Mapping[str, str] | None = None,
    optional: Iterable[str] = (),
    order: Callable[[str], Any] | None = None,
    units_written: bool = False,
) -> IntoPlan:
    """Plan ``checkpoint`` into the destinations ``captured`` recorded, checking that every
    byte of each ``required`` tensor (the engine's parameters, by name) is covered exactly
    once; those named in ``optional`` may instead have no byte written. ``names`` maps the
    names the engine was given to checkpoint names (a prefix the engine adds), identity by
    default. Where the engine's loader writes a byte from several tensors by design (see
    :mod:`._overwrites`), the last in ``order`` (a sort key of the names the engine takes:
    its reading order; by default the checkpoint's) stands. ``units_written``: the plan's
    ``transformed_units`` filled in (a pass over every recorded copy: asked for by a load
    that hands layers over as they land)."""
    to_checkpoint = names or {}
    tensors = checkpoint.tensors
    stored = _stored_order(checkpoint, to_checkpoint)
    resolved = resolve(captured, order or stored, stored)
    captured = resolved.captured
    # Looked up once per tensor: a checkpoint's table builds each TensorInfo on access.
    infos: dict[str, TensorInfo] = {}

    def info(name: str) -> TensorInfo:
        found = infos.get(name)
        if found is None:
            found = infos[name] = tensors[to_checkpoint.get(name, name)]
        return found

    defaulted = _check_coverage(captured, list(required), frozenset(optional), resolved.shared)
    grids, views = _slabs(captured, info)
    # In checkpoint order, as they will be read.
    why = {to_checkpoint.get(n, n): w for n, w in captured.transformed.items()}
    transformed = {n: why[n] for n in tensors if n in why}
    # A tensor the loader took without a copy while recording is skipped, unless its values
    # were read: then what it does with the real ones is the loader's to say.
    untouched = (to_checkpoint.get(n, n) for n in captured.untouched)
    skipped = tuple(n for n in untouched if n not in why)
    overwritten = tuple(to_checkpoint.get(n, n) for n in resolved.overwritten)
    # Claimed by name, not by ignore= patterns or a Dense pattern of every name: a model
    # served in another dtype has every tensor transformed, and matching each name against
    # a pattern per name is quadratic.
    rule = _Claimed(grids, info, to_checkpoint, (*transformed, *skipped, *overwritten))
    loaded = plan(checkpoint, [rule])
    extras = dict(loaded.extras)
    extras["transformed_bytes"] = {n: tensors[n].nbytes for n in transformed}
    loaded = dataclasses.replace(loaded, extras=MappingProxyType(extras))
    return IntoPlan(
        plan=loaded,
        tensors=MappingProxyType(views),
        transformed=MappingProxyType(transformed),
        skipped=skipped,
        fills=len(captured.fills),
        defaulted=defaulted,
        overwritten=overwritten,
        shared=frozenset(to_checkpoint.get(n, n) for n in resolved.shared),
        transformed_units=(
            _units_written(captured, transformed, to_checkpoint)
            if units_written
            else MappingProxyType({})
        ),
    )


def _units_written(
    captured: Capture, transformed: Mapping[str, str], to_checkpoint: Mapping[str, str]
) -> Mapping[str, frozenset[str]]:
    """Per transformed checkpoint tensor, the units of the targets its writes and runs land
    in: a layer it alone completes can be handed to the engine once its reads have."""
    if not transformed:
        return MappingProxyType({})
    target_unit = [unit_of_layer(name) for name, _ in captured.targets]
    units: dict[str, set[str]] = defaultdict(set)
    pieces: Iterable[Write | Run] = itertools.chain(captured.writes, captured.runs)
    for piece in pieces:
        name = to_checkpoint.get(piece.tensor, piece.tensor)
        if name in transformed:
            units[name].add(target_unit[piece.target])
    return MappingProxyType({n: frozenset(units.get(n, ())) for n in transformed})


def _stored_order(
    checkpoint: Checkpoint, to_checkpoint: Mapping[str, str]
) -> Callable[[str], tuple[int, int]]:
    """A sort key of the engine's names by where their tensors lie: the checkpoint's order,
    in which the engine's loader is handed the transformed ones (``_stream`` reads in file
    order)."""
    tensors = checkpoint.tensors
    files = {f.path: i for i, f in enumerate(checkpoint.files)}

    def stored(name: str) -> tuple[int, int]:
        found = tensors[to_checkpoint.get(name, name)]
        return files[found.file], found.offset

    return stored


def _slabs(
    captured: Capture, info: Callable[[str], TensorInfo]
) -> tuple[list[_Grid], dict[str, torch.Tensor]]:
    """Each of :func:`_grids`' runs as a slab, and the view of the engine's tensor that
    slab is, by the slab's name."""
    grids: list[_Grid] = []
    views: dict[str, torch.Tensor] = {}
    for target, whole, runs in _grids(captured, info):
        name, flat = captured.targets[target]
        first = runs[0]
        source = info(first.tensor)
        # A run of a whole tensor takes its slot in the tensor's shape; a part of one (a
        # rank's rows, say) in its elements.
        item = source.shape if whole else (first.nbytes // source.dtype.itemsize,)
        spec = SlabSpec(
            name=f"{name}@{first.dst}",
            unit=unit_of_layer(name),
            dtype=source.dtype,
            slot_dims=(len(runs),),
            item_shape=item,
            labels={"target": name},
        )
        grids.append(_Grid(spec, whole, runs))
        end = first.dst + len(runs) * first.nbytes
        views[spec.name] = flat[first.dst : end].view(source.dtype).view(len(runs), *item)
    return grids, views


def _grids(
    captured: Capture, info: Callable[[str], TensorInfo]
) -> Iterator[tuple[int, bool, list[Run]]]:
    """The recorded runs as slabs: per destination, the runs of one size and dtype (and
    shape, where each is a whole tensor) that lie end to end, each one slot. A layer's
    experts written into their fused parameter are one slab (a few hundred slots) rather
    than a slab each: what a plan costs grows with its slabs, and an MoE model has tens of
    thousands of runs."""
    by_kind: dict[tuple[Any, ...], list[Run]] = defaultdict(list)
    for run in captured.runs:
        source = info(run.tensor)
        whole = run.src == 0 and run.nbytes == source.nbytes
        if (run.src | run.nbytes) % source.dtype.itemsize:
            # Only a run cut where a later tensor overwrites part of it can be: it would
            # have to start or end inside an element.
            raise CoverageError(
                f"a later tensor overwrites part of an element of {run.tensor!r} in "
                f"{captured.targets[run.target][0]!r}: asyncslab cannot read what stands",
                tensor=run.tensor,
            )
        by_kind[run.target, run.nbytes, source.dtype, source.shape if whole else None].append(run)
    for (target, nbytes, _, shape), runs in by_kind.items():
        runs.sort(key=_DST)
        at = 0
        for i in range(1, len(runs) + 1):
            if i == len(runs) or runs[i].dst != runs[i - 1].dst + nbytes:
                yield target, shape is not None, runs[at:i]
                at = i


_DST = operator.attrgetter("dst")


@dataclass(frozen=True, slots=True)
class _Grid:
    spec: SlabSpec
    #: Every run reads its whole tensor.
    whole: bool
    runs: list[Run]


class _Claimed:
    """A rule that claims what was decided already: every recorded run a route into its
    slot, and ``skipped`` (the transformed, those the loader drops) not placed."""

    def __init__(
        self,
        grids: list[_Grid],
        info: Callable[[str], TensorInfo],
        names: Mapping[str, str],
        skipped: tuple[str, ...],
    ) -> None:
        self._grids, self._info, self._names, self._skipped = grids, info, names, skipped

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        specs = tuple(g.spec for g in self._grids)
        numbers = numbers_of(checkpoint, pending)
        if numbers is not None and all(g.whole for g in self._grids):
            # Columns, as the built-in rules claim: no Route object per run, checked a
            # column at a time by the planner.
            names = self._names
            tensor, slab, slot = array.array("I"), array.array("I"), array.array("I")
            for i, grid in enumerate(self._grids):
                tensor.extend(numbers[names.get(r.tensor, r.tensor)] for r in grid.runs)
                slab.extend(itertools.repeat(i, len(grid.runs)))
                slot.extend(range(len(grid.runs)))
            units = list(dict.fromkeys(spec.unit for spec in specs))
            number = {u: i for i, u in enumerate(units)}
            unit = array.array("I", (number[specs[i].unit] for i in slab))
            table = RouteTable(checkpoint.table, specs, tensor, slab, slot, units, unit, {})
            return Claim(slabs=specs, routes=table, skipped=self._skipped)
        routes = []
        for grid in self._grids:
            for i, run in enumerate(grid.runs):
                source = self._info(run.tensor)
                if grid.whole:
                    routes.append(make_route(source, grid.spec, (i,)))
                    continue
                start = run.src // source.dtype.itemsize
                count = grid.spec.item_shape[0]
                routes.append(make_route(source, grid.spec, (i,), elements=(start, start + count)))
        return Claim(slabs=specs, routes=tuple(routes), skipped=self._skipped)


# --- completeness, per byte ------------------------------------------------------------


def _check_coverage(
    captured: Capture,
    required: Sequence[tuple[str, torch.Tensor]],
    optional: frozenset[str],
    shared: frozenset[str] = frozenset(),
) -> tuple[str, ...]:
    """Raise :class:`CoverageError` for a byte of a required tensor written by two
    checkpoint tensors (but for two of ``shared``, whose overlaps the engine's loader
    replays), or by none (nor filled by the loader). An ``optional`` tensor with no byte
    written is not an error: those are returned."""
    writes: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for run in captured.runs:
        writes[run.target].append((run.dst, run.dst + run.nbytes, run.tensor))
    for w in captured.writes:
        writes[w.target].append((w.start, w.end, w.tensor))
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for target, spans in writes.items():
        spans.sort()
        end, last = -1, ""
        for a, b, source in spans:
            if a < end and source != last and not (source in shared and last in shared):
                name = captured.targets[target][0]
                raise CoverageError(
                    f"{source!r} and {last!r} both write bytes [{a}, {min(b, end)}) of "
                    f"{name!r}: a byte may come from one checkpoint tensor only",
                    tensor=source,
                    slab=name,
                )
            if b > end:
                end, last = b, source
        covered[target].extend((a, b) for a, b, _ in spans)
    for fill in captured.fills:
        covered[fill.target].append((fill.start, fill.end))
    merged = {t: _merge(spans) for t, spans in covered.items()}
    by_ptr = {flat.untyped_storage().data_ptr(): i for i, (_, flat) in enumerate(captured.targets)}
    defaulted = []
    for name, tensor in required:
        if not tensor.numel():
            continue
        found = by_ptr.get(tensor.untyped_storage().data_ptr())
        start = int(tensor.storage_offset()) * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        holes = _holes(merged.get(found, []) if found is not None else [], start, end)
        if name in optional and holes == [(start, end)]:
            defaulted.append(name)
        elif holes:
            a, b = holes[0]
            guess = _guess(name, a - start, b - start, _writers(captured), required)
            hint = f"; by analogy, expected {guess!r}" if guess else ""
            where = _index_range(tensor, a - start, b - start)
            raise CoverageError(
                f"{where} of {name!r} (bytes [{a - start}, {b - start}) of "
                f"{end - start}) come from no checkpoint tensor{hint}"
                + (f" ({len(holes)} gaps in all)" if len(holes) > 1 else ""),
                tensor=guess,
                slab=name,
                missing=holes,
            )
    return tuple(defaulted)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _holes(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    holes = []
    at = start
    for a, b in spans:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            holes.append((at, a))
        at = max(at, b)
    if at < end:
        holes.append((at, end))
    return holes


def _writers(captured: Capture) -> dict[str, list[tuple[int, int, str]]]:
    """Per destination name, which checkpoint tensor wrote which bytes (storage offsets)."""
    out: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for run in captured.runs:
        out[captured.targets[run.target][0]].append((run.dst, run.dst + run.nbytes, run.tensor))
    for w in captured.writes:
        out[captured.targets[w.target][0]].append((w.start, w.end, w.tensor))
    return out


_NUMBER = re.compile(r"\d+")


def _guess(
    name: str,
    a: int,
    b: int,
    writers: Mapping[str, list[tuple[int, int, str]]],
    required: Sequence[tuple[str, torch.Tensor]],
) -> str | None:
    """The checkpoint tensor that would fill bytes ``[a, b)`` of ``name``, by analogy with a
    sibling (the same name but for its numbers: another layer's) whose same bytes a tensor
    filled: that tensor's name, with the sibling's numbers put back to ``name``'s."""
    shape = _NUMBER.sub("#", name)
    mine = _NUMBER.findall(name)
    offsets = {n: int(t.storage_offset()) * t.element_size() for n, t in required}
    for other, _ in required:
        if other == name or _NUMBER.sub("#", other) != shape or other not in writers:
            continue
        base = offsets[other]
        theirs = _NUMBER.findall(other)
        for start, end, tensor in writers[other]:
            if start - base <= a < end - base:
                changes = {t: m for t, m in zip(theirs, mine, strict=True) if t != m}
                parts = tensor.split(".")
                for i, part in enumerate(parts):
                    if part in changes and _same_context(parts, i, other, part):
                        parts[i] = changes[part]
                return ".".join(parts)
    return None


def _same_context(parts: list[str], i: int, other: str, number: str) -> bool:
    """Whether ``parts[i]`` (a number) follows the same word in the tensor's name as
    ``number`` does in the sibling's (``layers.3`` in both)."""
    before = parts[i - 1] if i else ""
    return f"{before}.{number}." in f"{other}." or not before


def _index_range(tensor: torch.Tensor, a: int, b: int) -> str:
    size = tensor.element_size()
    first, last = a // size, (b - 1) // size
    if tensor.dim() <= 1:
        return f"elements {first}..{last}"
    return f"indices {_unravel(first, tensor.shape)}..{_unravel(last, tensor.shape)}"


def _unravel(index: int, shape: torch.Size) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return out[::-1]

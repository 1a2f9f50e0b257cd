"""Bytes an engine's loader writes from several checkpoint tensors by design, the last
write standing, as the engine's own load leaves them.

vLLM fuses shards into one parameter (``q_proj``, ``k_proj`` and ``v_proj`` into
``qkv_proj``; an expert's ``gate_proj`` and ``up_proj`` into its ``w13`` slot), and some of a
fused parameter's small companions have room for one value, not one per shard:
compressed-tensors' ``weight_shape``, a static FP8 expert's ``w13_input_scale``. Each shard's
tensor is written there in turn; the last in the engine's reading order stands. A recording
shows that as two checkpoint tensors writing the same bytes, which is otherwise a broken
checkpoint (two spellings of one tensor, say) and refused.

The line between the two is drawn from the recording itself, with no table of names: two
tensors may write one byte only where they are the same companion (the last part of their
names) of two *shards*, modules whose other tensors the loader lays side by side, apart, in
one parameter (``...q_proj.weight`` and ``...k_proj.weight`` in ``qkv_proj.weight``). Two
spellings of one tensor land on the same bytes with every tensor of theirs, and stay
refused, as does anything else that overlaps.

:func:`resolve` keeps, of every byte so written, the last writer's: the others' byte runs
are cut (a tensor left with none is *overwritten*, never read). A tensor the engine's loader
transforms is written by that loader, after the main load, whole: where one is in such an
overlap, every later writer of its bytes goes through the loader too, after it, so that the
loader's order replays the engine's.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import CoverageError
from ._recording import READ_BACK, Capture, Run, Write

__all__ = ["Overwrites", "resolve", "SHARED_BY_DESIGN"]

#: Why a tensor that writes bytes an earlier, transformed tensor writes goes through the
#: engine's loader too.
SHARED_BY_DESIGN = (
    "an earlier tensor the loader transforms writes some of the same bytes: it goes "
    "through the loader too, after that one, as in the engine's own load"
)


@dataclass(frozen=True, slots=True)
class Overwrites:
    """A recording with every byte written once: ``captured`` with the runs of bytes a
    later tensor overwrites cut. ``overwritten`` are the tensors none of whose bytes stand
    (not read), ``shared`` every tensor that writes a byte another writes too."""

    captured: Capture
    overwritten: tuple[str, ...] = ()
    shared: frozenset[str] = frozenset()


class _Span(NamedTuple):
    start: int
    end: int
    tensor: str
    #: Index into the recording's runs, or ``-1 - i`` for its writes' ``i``.
    ref: int


def resolve(
    captured: Capture,
    order: Callable[[str], Any],
    replay_order: Callable[[str], Any],
) -> Overwrites:
    """Cut ``captured``'s runs to the bytes that stand when the tensors are loaded in
    ``order`` (a sort key of the names the loader takes: the engine's reading order);
    ``replay_order`` is the order in which transformed tensors will be handed to the
    loader. Raises :class:`CoverageError` for two tensors writing one byte that are not
    shards of one fused parameter, or whose order cannot be replayed."""
    clusters = _clusters(captured)
    if not clusters:
        return Overwrites(captured)
    siblings = _Siblings(captured)
    lost: dict[int, list[tuple[int, int]]] = defaultdict(list)
    beats: set[tuple[str, str]] = set()
    for target, cluster in clusters:
        _check_shards(captured, target, cluster, siblings)
        _decide(cluster, order, lost, beats)
    shared = frozenset(s.tensor for _, cluster in clusters for s in cluster)
    transformed = _replayed(captured, lost, beats)
    for winner, loser in sorted(beats):
        if loser in transformed and winner in transformed:
            if replay_order(loser) > replay_order(winner):
                raise CoverageError(
                    f"{loser!r} and {winner!r} both write bytes of one parameter, the engine "
                    f"keeping {winner!r}'s; both go through its loader, which would be handed "
                    f"{winner!r} first: asyncslab cannot replay the engine's order here",
                    tensor=loser,
                )
    return _cut(captured, lost, transformed, shared)


def _clusters(captured: Capture) -> list[tuple[int, list[_Span]]]:
    """Per destination, the groups of spans that overlap, where two tensors' do."""
    spans: dict[int, list[_Span]] = defaultdict(list)
    for i, r in enumerate(captured.runs):
        spans[r.target].append(_Span(r.dst, r.dst + r.nbytes, r.tensor, i))
    for i, w in enumerate(captured.writes):
        spans[w.target].append(_Span(w.start, w.end, w.tensor, -1 - i))
    out: list[tuple[int, list[_Span]]] = []
    for target, items in spans.items():
        items.sort()
        group, end = [items[0]], items[0].end
        for span in items[1:]:
            if span.start < end:
                group.append(span)
                end = max(end, span.end)
                continue
            if len({s.tensor for s in group}) > 1:
                out.append((target, group))
            group, end = [span], span.end
        if len({s.tensor for s in group}) > 1:
            out.append((target, group))
    return out


class _Siblings:
    """Per tensor, where the loader writes it ((target, start, end) spans); per module (a
    name without its last part), the last parts of its tensors."""

    def __init__(self, captured: Capture) -> None:
        self.spans: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for r in captured.runs:
            self.spans[r.tensor].append((r.target, r.dst, r.dst + r.nbytes))
        for w in captured.writes:
            self.spans[w.tensor].append((w.target, w.start, w.end))
        self.leaves: dict[str, set[str]] = defaultdict(set)
        for name in self.spans:
            module, _, leaf = name.rpartition(".")
            self.leaves[module].add(leaf)

    def shards(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are one companion of two shards of a fused parameter:
        ``P.x`` and ``Q.x`` where, for another ``y``, ``P.y`` and ``Q.y`` land in one
        destination, on bytes apart."""
        pa, _, leaf = a.rpartition(".")
        pb, _, other = b.rpartition(".")
        if not pa or not pb or pa == pb or leaf != other:
            return False
        for y in (self.leaves[pa] & self.leaves[pb]) - {leaf}:
            mine, theirs = self.spans[f"{pa}.{y}"], self.spans[f"{pb}.{y}"]
            common = {t for t, _, _ in mine} & {t for t, _, _ in theirs}
            if common and not _meet(mine, theirs):
                return True
        return False


def _meet(a: Iterable[tuple[int, int, int]], b: Iterable[tuple[int, int, int]]) -> bool:
    """Whether two sets of (target, start, end) spans share a byte."""
    by_target: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t, start, end in a:
        by_target[t].append((start, end))
    return any(start < e and s < end for t, start, end in b for s, e in by_target.get(t, ()))


def _check_shards(
    captured: Capture, target: int, cluster: list[_Span], siblings: _Siblings
) -> None:
    end, last = -1, ""
    for span in cluster:
        if span.start < end and span.tensor != last and not siblings.shards(span.tensor, last):
            name = captured.targets[target][0]
            raise CoverageError(
                f"{span.tensor!r} and {last!r} both write bytes [{span.start}, "
                f"{min(span.end, end)}) of {name!r}: a byte may come from one checkpoint "
                "tensor only, or from the same companion of two shards the engine fuses "
                "into one parameter (docs/vllm.md, 'Parameters several tensors write')",
                tensor=span.tensor,
                slab=name,
            )
        if span.end > end:
            end, last = span.end, span.tensor


def _decide(
    cluster: list[_Span],
    order: Callable[[str], Any],
    lost: dict[int, list[tuple[int, int]]],
    beats: set[tuple[str, str]],
) -> None:
    """Per piece of ``cluster`` between two of its spans' ends, the last writer in
    ``order`` keeps it: the others' spans lose it (``lost``, by span ref), and ``beats``
    gets (winner, loser)."""
    points = sorted({p for s in cluster for p in (s.start, s.end)})
    keys = {s.tensor: order(s.tensor) for s in cluster}
    for lo, hi in zip(points, points[1:], strict=False):
        over = [s for s in cluster if s.start <= lo and hi <= s.end]
        if not over:
            continue
        winner = max(over, key=lambda s: keys[s.tensor]).tensor
        for s in over:
            if s.tensor != winner:
                lost[s.ref].append((lo, hi))
                beats.add((winner, s.tensor))


def _replayed(
    captured: Capture, lost: dict[int, list[tuple[int, int]]], beats: set[tuple[str, str]]
) -> dict[str, str]:
    """The tensors the engine's loader will write (the transformed, less those none of whose
    bytes stand), grown until every later writer of a byte one of them writes is one too."""
    transformed = dict(captured.transformed)
    standing: dict[str, bool] = {}
    for i, w in enumerate(captured.writes):
        gone = _covered(lost.get(-1 - i, []), w.start, w.end)
        standing[w.tensor] = standing.get(w.tensor, False) or not gone
    for name, stands in standing.items():
        # A loader that read back the bytes it wrote must be handed every writer, in order.
        if not stands and not transformed.get(name, "").startswith(READ_BACK):
            transformed.pop(name, None)
    grown = True
    while grown:
        grown = False
        for winner, loser in beats:
            if loser in transformed and winner not in transformed:
                transformed[winner] = SHARED_BY_DESIGN
                grown = True
    return transformed


def _covered(pieces: list[tuple[int, int]], start: int, end: int) -> bool:
    at = start
    for a, b in sorted(pieces):
        if a > at:
            return False
        at = max(at, b)
    return at >= end


def _cut(
    captured: Capture,
    lost: dict[int, list[tuple[int, int]]],
    transformed: dict[str, str],
    shared: frozenset[str],
) -> Overwrites:
    runs: list[Run] = []
    writes: list[Write] = [
        w for w in captured.writes if w.tensor in transformed
    ]  # a tensor the loader writes writes every byte it did while recorded
    for i, run in enumerate(captured.runs):
        if run.tensor in transformed:
            writes.append(Write(run.tensor, run.target, run.dst, run.dst + run.nbytes))
            continue
        runs.extend(_kept(run, lost.get(i, [])))
    standing = {r.tensor for r in runs} | {w.tensor for w in writes}
    written = {r.tensor for r in captured.runs} | {w.tensor for w in captured.writes}
    overwritten = tuple(n for n in captured.yielded if n in written and n not in standing)
    resolved = dataclasses.replace(
        captured, runs=tuple(runs), writes=tuple(writes), transformed=transformed
    )
    return Overwrites(resolved, overwritten, shared)


def _kept(run: Run, lost: list[tuple[int, int]]) -> list[Run]:
    """The pieces of ``run`` whose destination bytes are not in ``lost``."""
    if not lost:
        return [run]
    out = []
    at, end = run.dst, run.dst + run.nbytes
    for a, b in sorted(lost) + [(end, end)]:
        if a > at:
            out.append(dataclasses.replace(run, src=run.src + at - run.dst, nbytes=a - at, dst=at))
        at = max(at, b)
    return out

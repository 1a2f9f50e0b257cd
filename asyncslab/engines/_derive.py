"""Recording an engine's loader on a model of many experts by running it on a few.

Running the loader on stand-ins (:func:`~asyncslab.engines._recording.capture`) costs what the
engine's own Python costs per tensor, tens of microseconds, and a mixture-of-experts
checkpoint has tens to hundreds of thousands of tensors that differ only in their layer and
expert numbers. :func:`capture_derived` records the loader on all of one layer's experts and
on a few of every other layer's, and derives the rest:

* Tensors are grouped into *families* by name with the numbers taken out, dtype and shape
  (``model.layers.#.mlp.experts.#.w1.weight``, bfloat16, ``[64, 256]``); a family's
  *members* share every number but the last (a layer's experts) and are told apart by it.
* The first member of each family in checkpoint order, the *reference*, is recorded whole:
  whatever the loader does with each expert index (a slot, a shard, nothing where another
  rank holds it) is seen, not assumed.
* Of every other member, the first, second and last expert and a few picked by a hash of its
  numbers are recorded; they must match the reference's same experts byte for byte, up to one
  renaming of the destinations (this layer's parameter for the reference's). Then every
  other expert of the member is the reference's same expert, so renamed.
* Where that does not hold (another layout, a transformed tensor, a fill, a member with other
  expert numbers), the member's remaining tensors are recorded too: nothing is guessed.

What it assumes, and no sample can prove: that the loader treats an expert index of one
layer as it treats the same index of the reference layer wherever the sampled experts say
so. A loader that singles out one expert of one layer only, unsampled, is outside it; one
that singles out an expert index in every layer is inside (the reference records it).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CaptureError
from ._recording import Capture, Run, Write, capture

__all__ = ["capture_derived", "Derivation"]


#: A member with fewer experts than this is recorded whole: deriving saves little there.
MIN_EXPERTS = 8
#: Experts of each non-reference member recorded besides its first, second and last.
PICKED = 3


@dataclass(frozen=True, slots=True)
class Derivation:
    """What :func:`capture_derived` recorded and derived: tensors ``recorded`` by running
    the loader, ``derived`` from a reference member, and the members it had to record
    whole, each with why (``fallbacks``)."""

    recorded: int
    derived: int
    fallbacks: tuple[tuple[str, str], ...]


def capture_derived(
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], Any],
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    targets: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
) -> tuple[Capture, Derivation]:
    """What :func:`~asyncslab.engines._recording.capture` records, from running ``load`` on
    a sample of ``tensors`` (see the module's docstring), and how it was had."""
    given = list(tensors)
    targets = list(targets)
    plans = _families(given)
    if not plans:
        return capture(load, given, targets, device=device), Derivation(len(given), 0, ())
    held = {name for family in plans for name in family.unsampled()}
    try:
        first = capture(load, [t for t in given if t[0] not in held], targets, device=device)
    except CaptureError:
        # A loader that needs tensors it was not given (a pair split across a sample):
        # whatever the full recording says, it says it alone.
        return capture(load, given, targets, device=device), Derivation(len(given), 0, ())
    record = _Records(first)
    derived = _Derived()
    again: list[str] = []
    fallbacks: list[tuple[str, str]] = []
    for family in plans:
        for member, why in family.derive(record, derived):
            fallbacks.append((member, why))
            again.extend(family.unsampled_of(member))
    second = None
    if again:
        pending = set(again)
        second = capture(load, [t for t in given if t[0] in pending], targets, device=device)
        if second.fills:
            # A fill recorded now could cover bytes the first pass assigned to a tensor,
            # which only one recording can tell.
            return capture(load, given, targets, device=device), Derivation(len(given), 0, ())
    parts = [first] if second is None else [first, second]
    done = _merge(parts, derived, [name for name, _, _ in given])
    recorded = len(given) - len(held) + len(again)
    return done, Derivation(recorded, len(given) - recorded, tuple(fallbacks))


@dataclass(frozen=True, slots=True)
class _Footprint:
    """What the loader did with one tensor: byte ``runs`` ``(src, nbytes, target, dst)``, or
    ``writes`` ``(target, start, end)`` and why it transformed it; or nothing (untouched)."""

    runs: tuple[tuple[int, int, int, int], ...]
    writes: tuple[tuple[int, int, int], ...]
    why: str | None
    untouched: bool


class _Records:
    """A first pass's recording, per tensor."""

    def __init__(self, captured: Capture) -> None:
        self.captured = captured
        self._runs: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
        for r in captured.runs:
            self._runs[r.tensor].append((r.src, r.nbytes, r.target, r.dst))
        self._writes: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for w in captured.writes:
            self._writes[w.tensor].append((w.target, w.start, w.end))
        self._untouched = frozenset(captured.untouched)
        self.sizes = [flat.numel() for _, flat in captured.targets]

    def of(self, name: str) -> _Footprint:
        return _Footprint(
            tuple(self._runs.get(name, ())),
            tuple(self._writes.get(name, ())),
            self.captured.transformed.get(name),
            name in self._untouched,
        )

    def fills(self, name: str) -> bool:
        return name in self.captured.filling


@dataclass(slots=True)
class _Derived:
    runs: list[Run] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    transformed: dict[str, str] = field(default_factory=dict)
    untouched: set[str] = field(default_factory=set)

    def add(self, name: str, like: _Footprint, renamed: Mapping[int, int]) -> None:
        """``name`` as the loader took ``like``'s tensor, destinations ``renamed``."""
        for src, nbytes, target, dst in like.runs:
            self.runs.append(Run(name, src, nbytes, renamed[target], dst))
        for target, start, end in like.writes:
            self.writes.append(Write(name, renamed[target], start, end))
        if like.why is not None:
            self.transformed[name] = like.why
        if like.untouched:
            self.untouched.add(name)


@dataclass(slots=True)
class _Family:
    #: Per member (every number of the name but the last, joined), the expert number ->
    #: tensor name; the reference first.
    members: dict[str, dict[int, str]]
    sampled: dict[str, frozenset[int]]

    @property
    def reference(self) -> str:
        return next(iter(self.members))

    def unsampled(self) -> Iterator[str]:
        for member in self.members:
            yield from self.unsampled_of(member)

    def unsampled_of(self, member: str) -> list[str]:
        picked = self.sampled[member]
        return [n for e, n in self.members[member].items() if e not in picked]

    def derive(self, record: _Records, out: _Derived) -> Iterator[tuple[str, str]]:
        """Add the tensors of every member the samples allow to ``out``; yield
        ``(member, why)`` for the others."""
        reference = {e: record.of(n) for e, n in self.members[self.reference].items()}
        filling = next((n for n in self.members[self.reference].values() if record.fills(n)), None)
        for member, experts in list(self.members.items())[1:]:
            if filling is not None:
                yield member, f"the loader fills bytes of its own while taking {filling!r}"
                continue
            renamed, why = self._renaming(record, reference, experts, self.sampled[member])
            if renamed is None:
                yield member, why
                continue
            for expert in experts.keys() - self.sampled[member]:
                out.add(experts[expert], reference[expert], renamed)

    def _renaming(
        self,
        record: _Records,
        reference: dict[int, _Footprint],
        experts: dict[int, str],
        sampled: frozenset[int],
    ) -> tuple[dict[int, int] | None, str]:
        """The destinations of the reference member's renamed to ``experts``'s, as their
        ``sampled`` experts show them, or None and why not."""
        renamed: dict[int, int] = {}
        for expert in sorted(sampled):
            mine = experts[expert]
            if record.fills(mine):
                return None, f"the loader fills bytes of its own while taking {mine!r}"
            ours, theirs = record.of(mine), reference[expert]
            if (ours.why, ours.untouched) != (theirs.why, theirs.untouched):
                return None, f"the loader takes {mine!r} otherwise than the reference layer's"
            pairs = [(a[2], b[2]) for a, b in zip(ours.runs, theirs.runs, strict=False)]
            pairs += [(a[0], b[0]) for a, b in zip(ours.writes, theirs.writes, strict=False)]
            shapes = (
                [r[:2] + r[3:] for r in ours.runs],
                [w[1:] for w in ours.writes],
            ) != (
                [r[:2] + r[3:] for r in theirs.runs],
                [w[1:] for w in theirs.writes],
            )
            if shapes:
                return None, f"{mine!r} lands elsewhere in its parameter than in the reference"
            for target, reference_target in pairs:
                if renamed.setdefault(reference_target, target) != target:
                    return None, f"{mine!r} lands in another parameter than its siblings"
        for footprint in reference.values():
            used = [r[2] for r in footprint.runs] + [w[0] for w in footprint.writes]
            for target in used:
                if target not in renamed:
                    return None, "no sampled expert shows where all the reference's bytes go"
                if record.sizes[renamed[target]] != record.sizes[target]:
                    return None, "its parameters differ in size from the reference's"
        return renamed, ""


def _families(given: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[_Family]:
    """The families worth deriving: every member holds the same expert numbers, at least
    :data:`MIN_EXPERTS` of them, and there are two members or more."""
    grouped: dict[tuple[Any, ...], dict[str, dict[int, str]]] = {}
    ambiguous = set()
    for name, dtype, shape in given:
        # Numbers between dots (a layer's, an expert's; the 1 of ``w1`` is part of a word).
        parts = name.split(".")
        numbers = [i for i, part in enumerate(parts) if part.isdigit() and part.isascii()]
        if not numbers:
            continue
        member = ".".join([parts[i] for i in numbers[:-1]])
        expert = int(parts[numbers[-1]])
        for i in numbers:
            parts[i] = "#"
        key = (".".join(parts), dtype, shape)
        experts = grouped.setdefault(key, {}).setdefault(member, {})
        if experts.setdefault(expert, name) != name:
            # Two names, one number ("07" and "7"): not a family this can reason about.
            ambiguous.add(key)
    out = []
    for key, members in grouped.items():
        if len(members) < 2 or key in ambiguous:
            continue
        held = {frozenset(experts) for experts in members.values()}
        if len(held) != 1:
            continue
        (every,) = held
        if len(every) < MIN_EXPERTS:
            continue
        order = sorted(every)
        sampled: dict[str, frozenset[int]] = {}
        for i, member in enumerate(members):
            if i == 0:
                sampled[member] = every
                continue
            seed = zlib.crc32(member.encode())
            picked = {order[0], order[1], order[-1]}
            picked.update(order[(seed + k * 7919) % len(order)] for k in range(PICKED))
            sampled[member] = frozenset(picked)
        out.append(_Family(members, sampled))
    return out


def _merge(parts: Sequence[Capture], derived: _Derived, order: list[str]) -> Capture:
    """One recording of the passes ``parts`` (run on the same targets) and the derived."""
    first = parts[0]
    ops: dict[str, int] = {}
    untouched = set(derived.untouched)
    transformed: dict[str, str] = dict(derived.transformed)
    for part in parts:
        for op, n in part.ops.items():
            ops[op] = ops.get(op, 0) + n
        untouched.update(part.untouched)
        transformed.update(part.transformed)
    return Capture(
        targets=first.targets,
        runs=tuple(r for part in parts for r in part.runs) + tuple(derived.runs),
        writes=tuple(w for part in parts for w in part.writes) + tuple(derived.writes),
        fills=tuple(f for part in parts for f in part.fills),
        transformed=transformed,
        yielded=tuple(order),
        untouched=tuple(n for n in order if n in untouched),
        ops=ops,
        filling=frozenset().union(*(part.filling for part in parts)),
    )

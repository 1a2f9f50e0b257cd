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

import re
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError
from ._recording import Capture, Run, capture

__all__ = ["capture_derived", "Derivation"]

#: A number between dots: a layer's, an expert's (``w1``'s is part of a word).
_NUMBER = re.compile(r"(?<![^.])[0-9]+(?![^.])")

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
    derived: list[Run] = []
    untouched: set[str] = set()
    again: list[str] = []
    fallbacks: list[tuple[str, str]] = []
    for family in plans:
        for member, why in family.derive(record, derived, untouched):
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
    done = _merge(parts, derived, untouched, [name for name, _, _ in given])
    recorded = len(given) - len(held) + len(again)
    return done, Derivation(recorded, len(given) - recorded, tuple(fallbacks))


class _Records:
    """A first pass's recording, per tensor."""

    def __init__(self, captured: Capture) -> None:
        self.captured = captured
        self.runs: dict[str, list[Run]] = defaultdict(list)
        for run in captured.runs:
            self.runs[run.tensor].append(run)
        self.untouched = frozenset(captured.untouched)
        self.sizes = [flat.numel() for _, flat in captured.targets]

    def plain(self, name: str) -> str | None:
        """Why ``name``'s recording cannot be carried to another tensor, if it cannot."""
        c = self.captured
        if name in c.transformed:
            return f"the loader transforms {name!r} ({c.transformed[name]})"
        if name in c.filling:
            return f"the loader fills bytes of its own while taking {name!r}"
        return None


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

    def derive(
        self, record: _Records, out: list[Run], untouched: set[str]
    ) -> Iterator[tuple[str, str]]:
        """Append the derived runs of every member that the samples allow to ``out`` (and
        their untouched tensors to ``untouched``); yield ``(member, why)`` for the others."""
        reference = self.members[self.reference]
        for name in reference.values():
            why = record.plain(name)
            if why is not None:
                for member in list(self.members)[1:]:
                    yield member, why
                return
        for member, experts in list(self.members.items())[1:]:
            renamed, why = self._renaming(record, reference, experts, self.sampled[member])
            if renamed is None:
                yield member, why
                continue
            for expert in experts.keys() - self.sampled[member]:
                name, source = experts[expert], reference[expert]
                if source in record.untouched:
                    untouched.add(name)
                for r in record.runs.get(source, ()):
                    out.append(Run(name, r.src, r.nbytes, renamed[r.target], r.dst))

    def _renaming(
        self,
        record: _Records,
        reference: dict[int, str],
        experts: dict[int, str],
        sampled: frozenset[int],
    ) -> tuple[dict[int, int] | None, str]:
        """The destinations of ``reference``'s experts renamed to ``experts``'s, as their
        ``sampled`` experts show them, or None and why not."""
        renamed: dict[int, int] = {}
        for expert in sorted(sampled):
            mine, theirs = experts[expert], reference[expert]
            why = record.plain(mine)
            if why is not None:
                return None, why
            if (mine in record.untouched) != (theirs in record.untouched):
                return None, f"the loader takes {mine!r} and {theirs!r} differently"
            ours, refs = record.runs.get(mine, []), record.runs.get(theirs, [])
            if len(ours) != len(refs):
                return None, f"{mine!r} lands in {len(ours)} runs, {theirs!r} in {len(refs)}"
            for a, b in zip(ours, refs, strict=True):
                if (a.src, a.nbytes, a.dst) != (b.src, b.nbytes, b.dst):
                    return None, f"{mine!r} lands elsewhere in its parameter than {theirs!r}"
                if renamed.setdefault(b.target, a.target) != a.target:
                    return None, f"{mine!r} lands in another parameter than its siblings"
        for name in reference.values():
            for r in record.runs.get(name, ()):
                target = renamed.get(r.target)
                if target is None:
                    return None, f"no sampled expert shows where {name!r}'s bytes go here"
                if record.sizes[target] != record.sizes[r.target]:
                    return None, "its parameters differ in size from the reference's"
        return renamed, ""


def _families(given: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[_Family]:
    """The families worth deriving: every member holds the same expert numbers, at least
    :data:`MIN_EXPERTS` of them, and there are two members or more."""
    grouped: dict[tuple[Any, ...], dict[str, dict[int, str]]] = {}
    ambiguous = set()
    for name, dtype, shape in given:
        numbers = _NUMBER.findall(name)
        if not numbers:
            continue
        key = (_NUMBER.sub("#", name), dtype, shape)
        experts = grouped.setdefault(key, {}).setdefault(".".join(numbers[:-1]), {})
        if experts.setdefault(int(numbers[-1]), name) != name:
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


def _merge(
    parts: Sequence[Capture], derived: list[Run], untouched: set[str], order: list[str]
) -> Capture:
    """One recording of the passes ``parts`` (run on the same targets) and the derived runs."""
    first = parts[0]
    ops: dict[str, int] = {}
    for part in parts:
        for op, n in part.ops.items():
            ops[op] = ops.get(op, 0) + n
    for part in parts:
        untouched.update(part.untouched)
    transformed: dict[str, str] = {}
    for part in parts:
        transformed.update(part.transformed)
    return Capture(
        targets=first.targets,
        runs=tuple(r for part in parts for r in part.runs) + tuple(derived),
        writes=tuple(w for part in parts for w in part.writes),
        fills=tuple(f for part in parts for f in part.fills),
        transformed=transformed,
        yielded=tuple(order),
        untouched=tuple(n for n in order if n in untouched),
        ops=ops,
        filling=frozenset().union(*(part.filling for part in parts)),
    )

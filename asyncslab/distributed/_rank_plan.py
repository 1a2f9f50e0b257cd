"""This rank's plan of a checkpoint loaded by every rank of a ``torch.distributed`` group.

Public as :mod:`asyncslab.distributed`. :func:`rank_plan` builds it from the group's rank
and size: the whole checkpoint (``replicated``), this rank's slices of a pre-sliced
checkpoint (``pre-sliced``), this rank's rows of whole projection weights (``rows``), this
rank's experts (``experts``), or rows and experts together (``rows+experts``). The plan
records what it was made for, so that the distributed load's pre-flight (``_agreement``) can
check that every rank planned its own part of one mode.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from ..checkpoint import Checkpoint, TensorInfo
from ..errors import PlanError
from ..planning import (
    EXL3_EXPERT_PATTERN,
    Claim,
    Dense,
    Plan,
    RowSlice,
    Rule,
    TieredMoE,
    load_tier_map,
    plan,
)

__all__ = ["DEFAULT_ROWS", "MODES", "Mode", "RoundRobinExperts", "rank_plan"]

Mode = Literal["replicated", "pre-sliced", "rows", "experts", "rows+experts"]
MODES: tuple[str, ...] = ("replicated", "pre-sliced", "rows", "experts", "rows+experts")

#: Tensors ``rows`` mode slices by rows: the linear projections and the embeddings.
DEFAULT_ROWS = r".*(?:_proj|embed_tokens|lm_head)\.weight"


def _group_rank_world(group: Any, rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError(
            "torch.distributed is not initialized; call init_process_group first, or pass "
            "rank= and world="
        )
    got_rank = dist.get_rank(group) if rank is None else rank
    got_world = dist.get_world_size(group) if world is None else world
    if got_rank < 0:
        raise PlanError("this process is not a member of the given process group")
    return got_rank, got_world


@dataclass(frozen=True, slots=True)
class RoundRobinExperts:
    """Expert parallelism's default ownership: rank ``r`` of ``world`` owns experts
    ``e`` with ``e % world == r`` in every layer."""

    rank: int
    world: int

    def __call__(self, layer: int, expert: int) -> bool:
        return expert % self.world == self.rank


@dataclass(frozen=True, slots=True)
class _RankTag:
    """Claims nothing; records in ``plan.extras["distributed"]`` what the plan was made
    for, so that :func:`load` can check every rank planned its own part of one mode."""

    mode: str
    rank: int
    world: int

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        # A plain dict: plan summaries are JSON-ready.
        return Claim(
            extras={"distributed": {"mode": self.mode, "rank": self.rank, "world": self.world}}
        )


def _slice_count(checkpoint: Checkpoint, pattern: str) -> int | None:
    regex = re.compile(pattern)
    ranks = set()
    for name in checkpoint.tensors:
        m = regex.fullmatch(name)
        if m is not None and m.groupdict().get("rank") is not None:
            ranks.add(int(m.group("rank")))
    return max(ranks) + 1 if ranks else None


def _check_slicing(checkpoint: Checkpoint, mode: Mode, world: int) -> None:
    """A checkpoint sliced per rank is loaded with mode ``"pre-sliced"``, by as many ranks
    as it has slices; one of whole expert tensors, with any other mode."""
    slices = _slice_count(checkpoint, EXL3_EXPERT_PATTERN)
    if mode == "pre-sliced":
        if slices is None:
            raise PlanError(
                "mode 'pre-sliced' needs a checkpoint sliced per rank "
                "('...<proj>.rank<r>.<suffix>'); this one has whole expert tensors"
            )
        if slices != world:
            raise PlanError(
                f"checkpoint is sliced for {slices} ranks, but the process group has {world}"
            )
    elif slices is not None:
        raise PlanError(f"checkpoint is sliced for {slices} ranks; load it with mode='pre-sliced'")


def rank_plan(
    checkpoint: Checkpoint,
    *,
    mode: Mode,
    group: Any = None,
    rank: int | None = None,
    world: int | None = None,
    rows: str = DEFAULT_ROWS,
    owns: Callable[[int, int], bool] | None = None,
    tier_map: Mapping[int, Mapping[int, int]] | str | Path | None = None,
    ignore: Iterable[str] = (),
    unmatched: Literal["error", "ignore"] = "error",
) -> Plan:
    """This rank's plan of ``checkpoint``; rank and size come from ``group`` (default: the
    default process group) unless ``rank=`` and ``world=`` are given.

    ``mode``:

    * ``"replicated"``: the whole checkpoint on every rank (data parallel replicas).
    * ``"pre-sliced"``: a checkpoint whose expert tensors are sliced per rank
      (``...<proj>.rank<r>.<suffix>``) into exactly ``world`` slices: this rank's slices,
      plus every unsliced tensor.
    * ``"rows"``: rows ``[r*n/world, (r+1)*n/world)`` of every tensor matching ``rows``
      (default :data:`DEFAULT_ROWS`; the first dimension must divide by ``world``), the
      rest whole.
    * ``"experts"``: the experts ``owns(layer, expert)`` accepts (default
      :class:`RoundRobinExperts`), the rest whole.
    * ``"rows+experts"``: both.

    The plan records ``{"mode", "rank", "world"}`` in ``plan.extras["distributed"]``.
    """
    if mode not in MODES:
        raise PlanError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    r, w = _group_rank_world(group, rank, world)
    if not 0 <= r < w:
        raise PlanError(f"rank {r} is outside world size {w}")
    declared = load_tier_map(tier_map) if tier_map is not None else None
    _check_slicing(checkpoint, mode, w)
    rules: list[Rule] = [_RankTag(mode, r, w)]
    if mode in ("rows", "rows+experts"):
        rules.append(RowSlice(rows, rank=r, world=w))
    expert_owns = None
    if mode in ("experts", "rows+experts"):
        expert_owns = owns if owns is not None else RoundRobinExperts(r, w)
    elif owns is not None:
        raise PlanError(f"owns= applies to modes 'experts' and 'rows+experts', not {mode!r}")
    rules.append(
        TieredMoE(
            tier_map=declared,
            rank=r if mode == "pre-sliced" else None,
            owns=expert_owns,
        )
    )
    rules.append(Dense())
    return plan(checkpoint, rules, ignore=ignore, unmatched=unmatched)

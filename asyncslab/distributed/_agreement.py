"""What the ranks of a distributed load agree on, and the outcome they agree to.

The pre-flight: every rank opened the same checkpoint (``checkpoint_identity``), with the
same sharing settings, plans made for it by ``rank_plan`` in one mode (``check_hellos``).
The end: every rank's report, gathered into one :class:`DistributedLoad`, or one
:class:`~asyncslab.errors.DistributedLoadError` that names the ranks that failed and reads
the same on every rank (``ranks_failed``; ``lost`` when a collective itself failed). Pure
functions of what the collectives carried: the session (``_session``) runs them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import DistributedLoadError
from ..loading import SlabSet
from ._protocol import CollectiveFailed, describe
from ._sources import version_problems

__all__ = [
    "DistributedLoad",
    "RankReport",
    "check_chunk_bytes",
    "check_hellos",
    "checkpoint_identity",
    "combined",
    "completed",
    "lost",
    "ranks_failed",
]


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's figures for one distributed load.

    ``bytes_needed``: bytes its plan places. ``bytes_read``: bytes it read from storage
    (including gaps read through). ``bytes_received`` / ``bytes_sent``: payload of shared
    chunks it received from / broadcast to the group (``share_reads`` only). ``peak_rss``:
    the process's peak resident set size so far, in bytes.
    """

    rank: int
    fingerprint: str
    bytes_needed: int
    bytes_read: int
    bytes_received: int
    bytes_sent: int
    reads: int
    elapsed_s: float
    peak_rss: int


@dataclass(frozen=True, slots=True)
class DistributedLoad:
    """A load every rank of the group completed.

    ``slabs`` are this rank's (complete). ``fingerprint`` combines every rank's plan
    fingerprint (which includes the slice each sliced route carries), in rank order: equal
    on all ranks, and it changes when any rank's plan does (also when two ranks swap row
    slices). ``ranks`` holds every rank's
    :class:`RankReport`, in rank order; ``RankReport.fingerprint`` is ``plan.fingerprint``.
    """

    slabs: SlabSet
    rank: int
    world: int
    share_reads: bool
    fingerprint: str
    ranks: tuple[RankReport, ...]

    @property
    def report(self) -> RankReport:
        return self.ranks[self.rank]

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage by the whole group."""
        return sum(r.bytes_read for r in self.ranks)

    async def aclose(self) -> None:
        await self.slabs.aclose()

    async def __aenter__(self) -> DistributedLoad:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def checkpoint_identity(checkpoint: Checkpoint) -> tuple[tuple[tuple[str, int, int], ...], str]:
    files = tuple((f.path.name, f.size, f.header_len) for f in checkpoint.files)
    h = hashlib.sha256()
    for info in checkpoint.tensors.values():
        h.update(
            f"{info.name}|{info.file.name}|{info.offset}|{info.nbytes}|{info.st_dtype};".encode()
        )
    return files, h.hexdigest()[:16]


def combined(fingerprints: Sequence[str]) -> str:
    return hashlib.sha256("|".join(fingerprints).encode()).hexdigest()[:16]


def ranks_failed(
    failed: Mapping[int, str],
    context: str | None,
    *,
    rank: int,
    world: int,
    cause: BaseException | None,
) -> DistributedLoadError:
    """The error every rank raises when the ranks of ``failed`` did, with their errors;
    ``context``: when; ``cause``: this rank's own error, if it is one of them."""
    ranks = sorted(failed)
    if len(ranks) == 1:
        r = ranks[0]
        text = f"distributed load failed on rank {r} of {world}: {failed[r]}"
    else:
        listed = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
        text = f"distributed load failed on ranks {', '.join(map(str, ranks))} of {world}: {listed}"
    if context is not None:
        text = f"{text} ({context})"
    err = DistributedLoadError(
        text, ranks=tuple(ranks), errors=dict(failed), rank=rank, world=world
    )
    if rank in failed and cause is not None:
        err.__cause__ = cause
    return err


def lost(failure: CollectiveFailed, *, rank: int, world: int) -> DistributedLoadError:
    """The error a rank raises when a collective failed under it (the group is lost)."""
    err = DistributedLoadError(
        f"rank {rank} of {world}: the {failure.step} collective failed — another rank died, hung "
        "longer than the process group's timeout, or left the group; the process group "
        f"is unusable now ({describe(failure.error)})",
        ranks=(),
        errors={},
        rank=rank,
        world=world,
        step=failure.step,
    )
    err.__cause__ = failure.error
    return err


def check_hellos(hellos: Sequence[dict[str, Any]], world: int) -> dict[int, str]:
    """Problems every rank finds alike in the pre-flight exchange, by rank."""
    problems: dict[int, str] = {}
    first = hellos[0]
    for h in hellos[1:]:
        if h["sharing"] != first["sharing"]:
            problems[h["rank"]] = (
                f"loads with {_sharing(h['sharing'])}, rank 0 with {_sharing(first['sharing'])}"
            )
        if h["files"] != first["files"] or h["headers"] != first["headers"]:
            problems[h["rank"]] = (
                f"opened another checkpoint than rank 0 (files {list(h['files'])[:3]}, "
                f"headers {h['headers']}; rank 0: {list(first['files'])[:3]}, "
                f"headers {first['headers']})"
            )
    for rank, why in version_problems(hellos).items():
        problems.setdefault(rank, why)
    tags = [h["tag"] for h in hellos]
    if any(t is not None for t in tags):
        tagged = next(h["rank"] for h, t in zip(hellos, tags, strict=True) if t is not None)
        for h, t in zip(hellos, tags, strict=True):
            if t is None:
                problems.setdefault(
                    h["rank"], f"its plan was not made by rank_plan, rank {tagged}'s was"
                )
            elif (t["rank"], t["world"]) != (h["rank"], world):
                problems.setdefault(
                    h["rank"],
                    f"its plan was made for rank {t['rank']} of {t['world']}",
                )
        modes = {t["mode"] for t in tags if t is not None}
        reference = tags[0]
        if len(modes) > 1 and reference is not None:
            for h, t in zip(hellos, tags, strict=True):
                if t is not None and t["mode"] != reference["mode"]:
                    problems.setdefault(
                        h["rank"], f"planned mode {t['mode']!r}, rank 0 {reference['mode']!r}"
                    )
        if modes == {"replicated"}:
            for h in hellos:
                if h["slices"] != first["slices"]:
                    problems.setdefault(
                        h["rank"],
                        f"replicated plan {h['fingerprint']} differs from rank 0's "
                        f"{first['fingerprint']}",
                    )
    return problems


def check_chunk_bytes(chunk_bytes: object) -> None:
    # bool is an int, and a float equal to an int passes the pre-flight's comparison, then
    # fails in torch.empty on one rank only (its peers waiting in the first broadcast).
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(
            f"chunk_bytes must be a positive int, got {chunk_bytes!r} "
            f"({type(chunk_bytes).__name__})"
        )


def _sharing(key: tuple[Any, ...]) -> str:
    if not key[0]:
        return "share_reads=False"
    return f"share_reads=True, chunk_bytes={key[1]}, coalesce_gap={key[2]}"


def completed(
    reports: Sequence[dict[str, Any]], *, slabs: SlabSet, rank: int, world: int, share_reads: bool
) -> DistributedLoad:
    """The load every rank agreed on, from the agreement's reports (in rank order)."""
    ranks = tuple(
        RankReport(
            rank=r["rank"],
            fingerprint=r["fingerprint"],
            bytes_needed=r["bytes_needed"],
            bytes_read=r["bytes_read"],
            bytes_received=r["bytes_received"],
            bytes_sent=r["bytes_sent"],
            reads=r["reads"],
            elapsed_s=r["elapsed_s"],
            peak_rss=r["peak_rss"],
        )
        for r in reports
    )
    return DistributedLoad(
        slabs=slabs,
        rank=rank,
        world=world,
        share_reads=share_reads,
        fingerprint=combined([r["slices"] for r in reports]),
        ranks=ranks,
    )

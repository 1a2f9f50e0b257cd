"""Loading one checkpoint on every rank of a ``torch.distributed`` process group.

Public as :mod:`asyncslab.distributed`. Nothing here coordinates on its own: the process
group (started by ``torchrun`` or ``torch.multiprocessing``; NCCL on GPUs, gloo on CPU) is the
only channel between ranks, and every exchange is an ordinary collective.

* :func:`rank_plan` builds this rank's plan from the group's rank and size: the whole
  checkpoint (``replicated``), this rank's slices of a pre-sliced checkpoint
  (``pre-sliced``), this rank's rows of whole projection weights (``rows``), this rank's
  experts (``experts``), or rows and experts together (``rows+experts``).
* :func:`load` loads each rank's plan, then agrees across ranks: either every rank has its
  slabs complete, or every rank raises :class:`DistributedLoadError` naming the rank that
  failed and its error — a failure on one rank never leaves the others waiting.
* ``share_reads=True`` reads every needed byte range from storage exactly once in the whole
  group: a range one rank needs is read by that rank; a range several ranks need is read by
  one of them and broadcast over the group, chunk by chunk through (at most) two staging
  buffers per rank.

Collectives block, so they run on one thread per load (``asyncslab-dist``), never on the
event loop, in the same order on every rank. A rank that dies makes the others' next
collective fail at once (gloo: "Connection closed by peer"); a rank that hangs makes them
fail after the process group's timeout (``init_process_group(timeout=...)``). Either way
:func:`load` raises :class:`DistributedLoadError`, and the process group must not be used
again (destroy it, or exit).

A shared load is a :class:`~asyncslab.loading._load.Load` begun by ``_loader.begin_shared``: the
chunks' bytes land through its sink, and it finishes like a local load, so the slabs fill,
gate and report alike. The chunk list, this rank's chunk reader and the landing index live
in ``_shared``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import re
import resource
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._failures import first_line
from ..errors import (
    AsyncSlabError,
    DistributedLoadError,
    IncompleteLoadError,
    LoadError,
    PlanError,
)
from ..checkpoint._format import Checkpoint, TensorInfo
from ..loading._load import Load, open_checked
from ..loading._slabs import LoadOptions, SlabSet, begin_shared, is_closed, settled, void
from ..planning._moe import EXL3_EXPERT_PATTERN, TieredMoE, load_tier_map
from ..planning._plan import Plan, plan
from ..planning._rules import Dense, RowSlice
from ._chunks import (
    POLL_S,
    Chunk,
    ChunkReader,
    RouteIndex,
    needed_ranges,
    pack_ranges,
    share_chunks,
    unpack_ranges,
)
from ..loading._pinned import pinned_bytes
from ..planning._vocabulary import Claim, Rule

__all__ = [
    "DEFAULT_ROWS",
    "MODES",
    "DistributedLoad",
    "Mode",
    "RankReport",
    "RoundRobinExperts",
    "load",
    "rank_plan",
]

Mode = Literal["replicated", "pre-sliced", "rows", "experts", "rows+experts"]
MODES: tuple[str, ...] = ("replicated", "pre-sliced", "rows", "experts", "rows+experts")

#: Tensors ``rows`` mode slices by rows: the linear projections and the embeddings.
DEFAULT_ROWS = r".*(?:_proj|embed_tokens|lm_head)\.weight"


# --- plans -------------------------------------------------------------------------------


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
    slices = _slice_count(checkpoint, EXL3_EXPERT_PATTERN)
    if mode == "pre-sliced":
        if slices is None:
            raise PlanError(
                "mode 'pre-sliced' needs a checkpoint sliced per rank "
                "('...<proj>.rank<r>.<suffix>'); this one has whole expert tensors"
            )
        if slices != w:
            raise PlanError(
                f"checkpoint is sliced for {slices} ranks, but the process group has {w}"
            )
    elif slices is not None:
        raise PlanError(f"checkpoint is sliced for {slices} ranks; load it with mode='pre-sliced'")
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


# --- results -----------------------------------------------------------------------------


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


# --- the load ----------------------------------------------------------------------------


class _CollectiveFailed(Exception):
    """A collective raised: a rank died, hung past the group's timeout, or left."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.error = error


class _Abandoned(Exception):
    """The awaiting coroutine gave up (timeout); stop touching the event loop."""


_OK, _FAILED, _ABORTED, _CANCELLED = "ok", "failed", "aborted", "cancelled"


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _checkpoint_identity(checkpoint: Checkpoint) -> tuple[tuple[tuple[str, int, int], ...], str]:
    files = tuple((f.path.name, f.size, f.header_len) for f in checkpoint.files)
    h = hashlib.sha256()
    for info in checkpoint.tensors.values():
        h.update(
            f"{info.name}|{info.file.name}|{info.offset}|{info.nbytes}|{info.st_dtype};".encode()
        )
    return files, h.hexdigest()[:16]


def _combined(fingerprints: Sequence[str]) -> str:
    return hashlib.sha256("|".join(fingerprints).encode()).hexdigest()[:16]


class _Session:
    """One rank's side of one distributed load. The protocol (two ``all_gather_object``
    exchanges, and in between, when sharing, a third one and the chunk broadcasts) runs on
    one thread in the same order on every rank; the event loop only prepares, lands and
    finishes."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        plan: Plan,
        into: SlabSet | None,
        *,
        device: str | torch.device,
        group: Any,
        share_reads: bool,
        options: LoadOptions,
        chunk_bytes: int,
    ) -> None:
        self.checkpoint = checkpoint
        self.plan = plan
        # Allocated in prepare() unless given: its failure must travel in the pre-flight.
        self._slabs = into
        self.device = device
        self.group = group
        self.share = share_reads
        self.options = options
        self.chunk_bytes = chunk_bytes
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        # gloo carries CPU tensors (also when slabs live on a GPU); NCCL only CUDA ones.
        self.comm_cuda = "nccl" in backend and "gloo" not in backend
        self.comm_device = torch.device("cpu")
        if self.comm_cuda:  # the slabs' device instead, once they exist (prepare)
            self.comm_device = torch.device("cuda", torch.cuda.current_device())
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.abort_reason: str | None = None  # cancelled or timed out (set by the loop side)
        self.abandoned = False
        self.local_error: BaseException | None = None
        self.local_task: asyncio.Task[Any] | None = None
        # The shared load this rank's slabs run (share_reads), once begun.
        self.load: Load | None = None
        self.stopped_by: int | None = None
        self.fds: dict[int, int] = {}
        self.started = time.perf_counter()
        self.bytes_read = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.reads = 0

    def where(self) -> str:
        return f"rank {self.rank} of {self.world}"

    @property
    def slabs(self) -> SlabSet:
        """This rank's slabs; only past a pre-flight every rank passed (a rank whose
        allocation failed says so in the pre-flight, and every rank stops there)."""
        if self._slabs is None:
            raise LoadError(f"{self.where()}: the slabs were never allocated")
        return self._slabs

    # -- loop side --

    def prepare(self) -> dict[str, Any]:
        """Local checks and set-up, on the loop; their failure travels in the hello."""
        files, headers = _checkpoint_identity(self.checkpoint)
        hello: dict[str, Any] = {
            "rank": self.rank,
            "files": files,
            "headers": headers,
            "fingerprint": self.plan.fingerprint,
            "slices": self.plan.fingerprint,
            "tag": dict(self.plan.extras.get("distributed", {})) or None,
            # What decides the sequence of collectives: it must be the same on every rank.
            "sharing": (self.share, self.chunk_bytes, self.options.coalesce_gap)
            if self.share
            else (False,),
            "ranges": None,
            "error": None,
        }
        try:
            # Checked here, not before the pre-flight: a rank refusing on its own would leave
            # the others waiting in it until the group's timeout; the slabs are allocated
            # here for the same reason.
            _check_chunk_bytes(self.chunk_bytes)
            if self._slabs is None:
                self._slabs = SlabSet(self.plan, self.device)
            if self.comm_cuda and self.slabs.device.type == "cuda":
                self.comm_device = self.slabs.device
            if self.share:
                hello["ranges"] = pack_ranges(needed_ranges(self.plan))
                # Bytes arrive in the group's chunks ("shared"), landed here.
                self.load = begin_shared(self.slabs, self.checkpoint, self.plan, self.options)
                for i, shard in enumerate(self.plan.files):
                    self.fds[i] = open_checked(
                        shard.path,
                        shard.size,
                        shard.inode,
                        shard.mtime_ns,
                        shards=len(self.plan.files),
                    )
        except Exception as err:
            self.local_error = err
            hello["error"] = _describe(err)
        return hello

    def abort(self, reason: str) -> None:
        with self.lock:
            if self.abort_reason is None:
                self.abort_reason = reason
            task = self.local_task
        if task is not None:
            task.cancel()

    def _loop_gone(self) -> None:
        """The event loop can no longer be reached (the awaiting coroutine gave up at its
        deadline, or the loop closed): nothing more lands on this rank. Called on the
        protocol thread, which still finishes the protocol, reporting this rank as
        aborted, because the other ranks wait for it in the remaining collectives."""
        with self.lock:
            if self.abort_reason is None:
                # Only reached when the loop closed under a load nobody cancelled.
                self.abort_reason = "abandoned (its event loop closed)"

    # -- protocol thread --

    def protocol(self, hello: dict[str, Any]) -> tuple[str, Any]:
        """Returns ``("ok", reports)`` or ``("error", DistributedLoadError)``; the same
        verdict on every rank whose collectives succeeded."""
        try:
            if self.comm_cuda:
                # The CUDA device is per thread; NCCL's object collectives use the current one.
                torch.cuda.set_device(self.comm_device)
            hellos = self._gather(hello, "pre-flight")
            problems = _check_hellos(hellos, self.world)
            if problems:
                return "error", self._error(problems, "ranks disagree before loading")
            if any(h["error"] for h in hellos):
                failed = {h["rank"]: h["error"] for h in hellos if h["error"]}
                return "error", self._error(failed, "before loading")
            if self.share:
                failed = self._share(hellos)
                if failed:
                    return "error", self._error(failed, "before the first shared chunk")
            else:
                self._independent()
            reports = self._gather(self._final(), "agreement")
            failed = {
                r["rank"]: r["error"] or r["status"]
                for r in reports
                if r["status"] in (_FAILED, _CANCELLED)
            }
            if not failed:
                aborted = [r["rank"] for r in reports if r["status"] != _OK]
                if aborted:  # cannot happen: an abort always follows someone's failure
                    failed = {r: "stopped without a failing rank" for r in aborted}
            if failed:
                return "error", self._error(failed, None)
            return "ok", reports
        except _CollectiveFailed as err:
            return "error", self._lost(err)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def _gather(self, obj: dict[str, Any], step: str) -> list[dict[str, Any]]:
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as err:
            raise _CollectiveFailed(step, err) from err
        return out

    def _error(self, failed: Mapping[int, str], context: str | None) -> DistributedLoadError:
        ranks = sorted(failed)
        if len(ranks) == 1:
            r = ranks[0]
            text = f"distributed load failed on rank {r} of {self.world}: {failed[r]}"
        else:
            listed = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
            text = (
                f"distributed load failed on ranks {', '.join(map(str, ranks))} of "
                f"{self.world}: {listed}"
            )
        if context is not None:
            text = f"{text} ({context})"
        err = DistributedLoadError(
            text, ranks=tuple(ranks), errors=dict(failed), rank=self.rank, world=self.world
        )
        if self.rank in failed and self.local_error is not None:
            err.__cause__ = self.local_error
        return err

    def _lost(self, failure: _CollectiveFailed) -> DistributedLoadError:
        err = DistributedLoadError(
            f"{self.where()}: the {failure.step} collective failed — another rank died, hung "
            "longer than the process group's timeout, or left the group; the process group "
            f"is unusable now ({_describe(failure.error)})",
            ranks=(),
            errors={},
            rank=self.rank,
            world=self.world,
            step=failure.step,
        )
        err.__cause__ = failure.error
        return err

    def _in_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the event loop (after everything queued before it) and return its
        result."""
        if self.abandoned:
            raise _Abandoned
        cf: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                cf.set_result(fn())
            except BaseException as err:
                cf.set_exception(err)

        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed
            raise _Abandoned from None
        while True:
            try:
                return cf.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                if self.abandoned:
                    raise _Abandoned from None

    def _independent(self) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def start() -> None:
            async def run() -> None:
                await self.slabs.load(self.checkpoint, plan=self.plan, options=self.options)

            def finished(task: asyncio.Task[None]) -> None:
                if task.cancelled():
                    done.cancel()
                elif (exc := task.exception()) is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(None)

            with self.lock:
                if self.abort_reason is not None:
                    done.cancel()
                    return
                task = self.loop.create_task(run(), name="asyncslab-dist-local")
                self.local_task = task
            task.add_done_callback(finished)

        try:
            self._in_loop(start)
        except _Abandoned:
            # The agreement still follows: the others wait in it for this rank's verdict.
            self._loop_gone()
            return
        try:
            done.result()
        except concurrent.futures.CancelledError:
            pass  # abort_reason says why
        except BaseException as err:
            self.local_error = err
        stats = self.slabs.statistics() if not self.abandoned else None
        if stats is not None:
            self.bytes_read, self.reads = stats.bytes_read, stats.reads

    def _final(self) -> dict[str, Any]:
        if self.abort_reason is not None:
            status, error = _CANCELLED, f"load {self.abort_reason}"
        elif self.local_error is not None:
            status, error = _FAILED, _describe(self.local_error)
        elif self.stopped_by is not None:
            status, error = _ABORTED, None
        else:
            status, error = _OK, None
        return {
            "rank": self.rank,
            "status": status,
            "error": error,
            "fingerprint": self.plan.fingerprint,
            "slices": self.plan.fingerprint,
            "bytes_needed": sum(r.nbytes for r in self.plan.routes),
            "bytes_read": self.bytes_read,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "reads": self.reads,
            "elapsed_s": time.perf_counter() - self.started,
            "peak_rss": _peak_rss(),
        }

    # -- read once, share --

    def _failing(self) -> bool:
        return self.local_error is not None or self.abort_reason is not None

    def _share(self, hellos: Sequence[dict[str, Any]]) -> dict[int, str]:
        """The shared pass. Returns the ranks whose set-up failed, with their errors (the
        same on every rank; no chunk was exchanged then), else ``{}``."""
        rank, nbuf = self.rank, 2
        pin = torch.cuda.is_available() and (self.comm_cuda or self.slabs.device.type == "cuda")
        chunks: list[Chunk] = []
        size = 0
        host: list[torch.Tensor] = []
        comm = host
        routes: RouteIndex | None = None
        reader: ChunkReader | None = None
        setup_error: Exception | None = None
        try:
            try:
                # A chunk's broadcast is its payload and a status byte, chunk_bytes in all:
                # a power of two fills the pinned block torch makes of it (a payload of
                # 16 MiB and its byte took 32 MiB pinned, see pinned_bytes).
                chunks = share_chunks(
                    [unpack_ranges(h["ranges"]) for h in hellos],
                    chunk_bytes=max(1, self.chunk_bytes - 1),
                    gap=self.options.coalesce_gap,
                )
                relevant = [c for c in chunks if c.shared or c.owner == rank]
                size = max((c.nbytes for c in relevant), default=0) + 1  # + the status byte
                try:
                    host[:] = [
                        torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(nbuf)
                    ]
                except (RuntimeError, MemoryError) as err:
                    raise LoadError(
                        f"cannot allocate the staging buffers of the shared reads ({nbuf} x "
                        f"{size} bytes{', pinned' if pin else ''}): {first_line(err)}",
                        rank=rank,
                    ) from err
                if self.comm_cuda:
                    comm = [
                        torch.empty(size, dtype=torch.uint8, device=self.comm_device)
                        for _ in range(nbuf)
                    ]
                # What is held: torch pins a power of two (chunk_bytes, unless one chunk
                # is smaller); the device buffers are as asked.
                held = pinned_bytes(size) if pin else size
                assert self.load is not None
                self.load.record_staging(nbuf * (held + (size if self.comm_cuda else 0)))
                routes = RouteIndex(self.plan, self.load.sink)
                reader = ChunkReader(
                    chunks,
                    rank,
                    host,
                    nbuf,
                    self.fds,
                    [str(f.path) for f in self.plan.files],
                    failing=self._failing,
                    aborted=lambda: self.abort_reason is not None,
                )
                reader.start()
            except Exception as err:
                setup_error = self.local_error = err
            # A rank whose set-up failed cannot take part in the chunks (it may lack the
            # buffers to receive them, and it may own none to stop the group at), and its
            # peers would wait for it in the first one until the group's timeout: every
            # rank learns of it here, before any chunk.
            error = None if setup_error is None else _describe(setup_error)
            setups = self._gather({"rank": rank, "error": error}, "set-up")
            failed: dict[int, str] = {s["rank"]: s["error"] for s in setups if s["error"]}
            if failed or routes is None or reader is None:  # only where the set-up failed
                if rank not in failed:
                    self.stopped_by = min(failed)
                return failed
            # Zero-byte routes lie in no chunk: they land now, as the loader lands them
            # without a read (else their units never complete). Queued before any chunk's
            # landing.
            try:
                self.loop.call_soon_threadsafe(self._begin_landing, routes.empty)
            except RuntimeError:  # the loop is closed
                self._loop_gone()
            for k, chunk in enumerate(chunks):
                if chunk.shared or chunk.owner == rank:
                    read = reader.take(k) if chunk.owner == rank else None
                    if self._chunk(k, chunk, read, host[k % nbuf], comm[k % nbuf], routes):
                        break
                reader.advance(k)
            return {}
        finally:
            if reader is not None:
                # Aborted with a read still in flight (it may never return), the reader
                # keeps its files and buffers and this goes on to the agreement.
                if reader.finish():
                    self.fds = {}
                self.bytes_read, self.reads = reader.bytes_read, reader.reads
            try:
                self._in_loop(self._settle_share)
            except _Abandoned:
                self._loop_gone()

    def _chunk(
        self,
        k: int,
        chunk: Chunk,
        read: BaseException | None,
        host: torch.Tensor,
        comm: torch.Tensor,
        routes: RouteIndex,
    ) -> bool:
        """Process chunk ``k`` (``read``: the error of this rank's read of it, if it owns
        it); ``True`` when the whole group stops here."""
        n = chunk.nbytes
        if chunk.owner == self.rank:
            if read is not None and self.local_error is None:
                self.local_error = read
            if not chunk.shared:
                if not self._failing():
                    self._deliver(chunk, host, routes)
                return False
            status = 1 if self.local_error is not None else 2 if self._failing() else 0
            host[n] = status
            if self.comm_cuda:
                comm[: n + 1].copy_(host[: n + 1])
            self._broadcast(comm[: n + 1], chunk.owner, k)
            if status:
                return True
            self.bytes_sent += n
            self._deliver(chunk, comm, routes)
            return False
        self._broadcast(comm[: n + 1], chunk.owner, k)
        if int(comm[n].item()):
            self.stopped_by = chunk.owner
            return True
        self.bytes_received += n
        if not self._failing() and self.rank in chunk.needers:
            self._deliver(chunk, comm, routes)
        return False

    def _broadcast(self, tensor: torch.Tensor, owner: int, k: int) -> None:
        src = owner if self.group is None else dist.get_global_rank(self.group, owner)
        try:
            dist.broadcast(tensor, src=src, group=self.group)
        except Exception as err:
            raise _CollectiveFailed(f"chunk {k} broadcast", err) from err

    def _deliver(self, chunk: Chunk, buffer: torch.Tensor, routes: RouteIndex) -> None:
        """:meth:`_copy_out`, its failure this rank's error: raised out of the protocol, it
        would skip this rank's remaining collectives and leave the others waiting in them."""
        try:
            self._copy_out(chunk, buffer, routes)
        except Exception as err:
            if self.local_error is None:
                self.local_error = err

    def _copy_out(self, chunk: Chunk, buffer: torch.Tensor, routes: RouteIndex) -> None:
        """Copy every overlap of the chunk with this rank's routes into its slot, then land
        those bytes (on the loop, in order)."""
        landed: list[tuple[int, int]] = []
        backing = routes.backing
        for seg in chunk.segments:
            for route, src, base, dst, nbytes in routes.overlaps(seg):
                start = seg.at + (src - seg.offset)
                backing.narrow(0, base + dst, nbytes).copy_(buffer.narrow(0, start, nbytes))
                landed.append((route, nbytes))
        if not landed:
            return
        if routes.cuda:
            torch.cuda.current_stream(routes.cuda_device).synchronize()
        if self.abandoned:
            return
        try:
            self.loop.call_soon_threadsafe(self._land, landed)
        except RuntimeError:  # the loop is closed
            self._loop_gone()

    def _begin_landing(self, empty: Sequence[int]) -> None:
        if self.abandoned or self.local_error is not None:
            return
        try:
            assert self.load is not None
            self.load.begin(None)  # completes units without routes, as the loader
            for route in empty:
                self.load.land(route, 0)
        except AsyncSlabError as err:
            self.local_error = err

    def _land(self, landed: list[tuple[int, int]]) -> None:
        if self.abandoned or self.local_error is not None:
            return
        try:
            assert self.load is not None
            land = self.load.land
            for route, nbytes in landed:
                land(route, nbytes)
        except AsyncSlabError as err:
            self.local_error = err

    def _settle_share(self) -> None:
        load = self.load
        if load is None:
            return
        load.bytes_read = self.bytes_read
        load.reads = self.reads
        if load.state != "loading":
            return
        if self.local_error is None and self.abort_reason is None and self.stopped_by is None:
            if not load.complete:
                self.local_error = IncompleteLoadError(
                    f"shared load finished with incomplete units {load.missing_units()}"
                )
        if self.abort_reason is not None:
            load.finish("cancelled", asyncio.CancelledError(self.abort_reason))
        elif self.local_error is not None:
            load.finish("failed", self.local_error)
        elif self.stopped_by is not None:
            load.finish(
                "failed",
                LoadError(f"stopped: rank {self.stopped_by} failed (see the load's error)"),
            )
        else:
            load.finish("complete")


def _check_hellos(hellos: Sequence[dict[str, Any]], world: int) -> dict[int, str]:
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


def _check_chunk_bytes(chunk_bytes: object) -> None:
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


async def load(
    checkpoint: Checkpoint,
    plan: Plan,
    *,
    group: Any = None,
    share_reads: bool = False,
    device: str | torch.device = "cpu",
    options: LoadOptions | None = None,
    into: SlabSet | None = None,
    chunk_bytes: int = 16 << 20,
    # Not asyncio.timeout: cancelling makes this rank finish the protocol (waiting up to the
    # group's timeout) so that the others hear of it; this deadline abandons it instead.
    timeout: float | None = None,  # noqa: ASYNC109
) -> DistributedLoad:
    """Load this rank's ``plan`` and agree with every rank of ``group`` (default: the
    default process group) that all loads completed. Every rank must call it, with its own
    plan of the same checkpoint (e.g. from :func:`rank_plan`) and the same ``share_reads``
    and ``chunk_bytes``.

    Protocol, in the same order on every rank: a pre-flight ``all_gather_object`` (same
    checkpoint files and headers everywhere; plans from :func:`rank_plan` made for this
    rank, world and one mode; replicated plans identical; each rank's local preparation,
    its slabs' allocation included, succeeded), the load, then an agreement
    ``all_gather_object`` of every rank's outcome and figures. If any rank failed, every rank
    raises :class:`DistributedLoadError` naming it (and, where the slabs were allocated here,
    frees them; ``into`` slabs are reset).

    ``share_reads``: read each needed byte range from storage exactly once in the group;
    ranges several ranks need travel by ``dist.broadcast`` in chunks of at most
    ``chunk_bytes`` (payload and a status byte), through two staging buffers per rank (on
    the GPU too under NCCL). A set-up ``all_gather_object`` after the pre-flight says
    whether every rank allocated them (and set up the rest); if not, every rank fails
    there, before the first chunk.
    Without ``share_reads``, every rank reads its own plan with the ordinary loader and
    ``options``.

    ``timeout``: seconds after which this rank stops waiting and raises; the group is
    unusable afterwards. Its protocol thread goes on in the background: it stops landing
    and reading (with ``share_reads``, it leaves behind a read in flight), takes part in
    the remaining collectives and reports the timeout in the agreement, so the other ranks
    raise "failed on rank r: load timed out after ... s" once they get there — provided
    this process lives that long and no collective it waits in is stuck on a hung rank
    (that one ends at the process group's own timeout). ``None``: the process group's
    timeout bounds every wait — a dead rank fails the others at once, a hung one after
    that timeout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise LoadError("torch.distributed is not initialized; call init_process_group first")
    if dist.get_rank(group) < 0:
        raise LoadError("this process is not a member of the given process group")
    options = options or LoadOptions()
    if into is not None:
        await settled(into)  # one of these slabs may still be releasing
    session = _Session(
        checkpoint,
        plan,
        into,
        device=device,
        group=group,
        share_reads=share_reads,
        options=options,
        chunk_bytes=chunk_bytes,
    )
    try:
        hello = session.prepare()
        verdict = await _drive(session, hello, timeout)
    except BaseException:
        await _release(session, into is None)
        del session, into  # this frame lies in the error's traceback (see _release)
        raise
    kind, value = verdict
    if kind == "error":
        await _release(session, into is None)
        del session, into
        raise value
    reports = tuple(
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
        for r in value
    )
    return DistributedLoad(
        slabs=session.slabs,
        rank=session.rank,
        world=session.world,
        share_reads=share_reads,
        fingerprint=_combined([r["slices"] for r in value]),
        ranks=reports,
    )


async def _drive(
    session: _Session,
    hello: dict[str, Any],
    timeout: float | None,  # noqa: ASYNC109 - see load()
) -> tuple[str, Any]:
    """Run the protocol thread and wait for it; on cancellation, finish the protocol first
    (so the other ranks hear about it instead of waiting), then re-raise."""
    future: concurrent.futures.Future[tuple[str, Any]] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(session.protocol(hello))
        except BaseException as err:  # a bug; handed to the awaiting task
            future.set_exception(err)

    thread = threading.Thread(target=run, name="asyncslab-dist", daemon=True)
    thread.start()
    waiter = asyncio.wrap_future(future)
    try:
        if timeout is None:
            return await asyncio.shield(waiter)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(waiter)
    except TimeoutError:
        if waiter.done():  # finished as the deadline passed
            return waiter.result()
        session.abort(f"timed out after {timeout} s")
        await _local_settled(session)
        session.abandoned = True
        # Nothing more will land: close out the slabs' state so waiters wake.
        if session.load is not None and session.load.state == "loading":
            session.load.finish("failed", LoadError("distributed load timed out"))
        raise DistributedLoadError(
            f"{session.where()}: distributed load did not finish within timeout={timeout} s "
            "(waiting for the other ranks or the shared reads); the process group is "
            "unusable now",
            ranks=(),
            errors={},
            rank=session.rank,
            world=session.world,
            step="timeout",
        ) from None
    except asyncio.CancelledError:
        session.abort("cancelled")
        while not waiter.done():
            try:
                await asyncio.shield(waiter)
            except asyncio.CancelledError:
                continue
        raise


async def _local_settled(session: _Session) -> None:
    task = session.local_task
    if task is not None and not task.done():
        task.cancel()
        # Its outcome is reported elsewhere; wait() does not raise it (but lets our own
        # cancellation through).
        await asyncio.wait([task])


async def _release(session: _Session, owned: bool) -> None:
    """After a failed distributed load: no slab of this rank stays usable."""
    await _local_settled(session)
    slabs = session._slabs
    if session.load is not None and session.load.state == "loading":
        session.load.finish("failed", LoadError("distributed load failed"))
    if not session.abandoned:
        # Only left open when the protocol thread never ran; an abandoned one closes its own.
        for fd in session.fds.values():
            os.close(fd)
        session.fds.clear()
    if slabs is None:
        pass  # its allocation failed: nothing to free
    elif owned:
        await slabs.aclose()
    elif is_closed(slabs):
        pass  # closed by its owner meanwhile: nothing is handed out
    elif slabs.state == "complete":
        slabs.reset()
    elif slabs.state in ("failed", "cancelled"):
        # Failed or cancelled: the tracker keeps the units that completed before the break,
        # and slab() would hand them out on this rank alone. Keep the error (ready() raises
        # with it) but no completed unit.
        void(slabs)
    if not session.abandoned:
        # The protocol's threads are done with the slabs; their frames, in the error's
        # traceback, may keep the session: it lets go of the slabs (and of the load, whose
        # sink holds their memory).
        session._slabs = None
        session.load = None

"""Distributed loads over real gloo process groups of spawned processes.

Each test spawns its ranks (``spawn`` start method: children never inherit pytest's event
loop, and each runs its own ``asyncio.Runner``), rendezvous through a file in ``tmp_path``,
and has every child write what it saw (bytes, digests, mismatches against safetensors
reads, errors, timings) to ``rank<r>.json``; the parent asserts on those. One spawn covers
many loads, since a coordinated failure leaves the process group usable; a killed or hung
rank does not, so those get spawns of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import errno
import hashlib
import importlib
import json
import multiprocessing
import os
import pickle
import random
import threading
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asyncslab
import asyncslab.testing
from asyncslab import Checkpoint, LoadError, LoadOptions, PlanError
from asyncslab.distributed import _agreement as agreement
from asyncslab.distributed import _chunks as shared
from asyncslab.distributed import _session as distributed
from asyncslab.distributed import _sources as sources
from asyncslab.distributed import rank_plan
from asyncslab.errors import DistributedLoadError
from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec
from support.faults import HANG_S, raw_bytes

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

PG_TIMEOUT = 10.0  # seconds; the process group's timeout in the children
HUNG_PG_TIMEOUT = 4.0  # the same, where a rank hangs
EXACT = LoadOptions(coalesce_gap=0)  # no read-through: bytes read == bytes needed
SHARE_CHUNK = 64 << 10  # small chunks: many of them, routes straddling chunk edges
SPECS = {
    2: SyntheticSpec(),
    3: SyntheticSpec(hidden=192, intermediate=96, n_experts=6, vocab=384),
}
SLICED_MODES = ("pre-sliced", "rows", "experts", "rows+experts")


# --- parent side -------------------------------------------------------------------------


def _write_checkpoints(root: Path, world: int) -> Path:
    spec = SPECS[world]
    asyncslab.testing.write_synthetic(root / "whole", spec)
    asyncslab.testing.write_synthetic(root / "sliced", dataclasses.replace(spec, tp_ranks=world))
    return root


@pytest.fixture(scope="module")
def checkpoints2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoints(tmp_path_factory.mktemp("dist2"), 2)


@pytest.fixture(scope="module")
def checkpoints3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoints(tmp_path_factory.mktemp("dist3"), 3)


def _spawn(
    tmp_path: Path,
    world: int,
    scenario: str,
    checkpoints: Path,
    *,
    pg_timeout: float = PG_TIMEOUT,
    wait: float = 60.0,
    wait_for: tuple[int, ...] | None = None,
) -> list[dict[str, Any] | None]:
    """Run ``scenario`` on ``world`` spawned ranks; their JSON results, by rank (``None``
    for a rank that wrote none). Ranks not in ``wait_for`` are killed once those finished."""
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world, str(tmp_path), str(checkpoints), scenario, pg_timeout),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait
    try:
        for rank, p in enumerate(procs):
            if wait_for is None or rank in wait_for:
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    results: list[dict[str, Any] | None] = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    for r in results:
        if r is not None and r.get("crash"):
            pytest.fail(f"rank {r['rank']} crashed:\n{r['crash']}")
    return results


def _union(ranges: list[list[list[Any]]]) -> int:
    """Bytes in the union of every rank's ``(file, start, end)`` ranges."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for spans in ranges:
        for name, s, e in spans:
            by_file.setdefault(name, []).append((s, e))
    total = 0
    for spans in by_file.values():
        end = -1
        for s, e in sorted(spans):
            if s >= end:
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
    return total


# --- child side --------------------------------------------------------------------------


_WORKDIR: Path | None = None  # in a child: where the ranks' results go


async def _until_rank_finished(rank: int) -> None:
    """Wait (in a child) until ``rank`` has written its result: a rank that must stay in
    the group while another fails waits for that, not for a fixed time that a loaded
    machine may overrun. The bound is a hang guard only (``_spawn`` kills the ranks)."""
    assert _WORKDIR is not None
    deadline = time.monotonic() + HANG_S
    while not (_WORKDIR / f"rank{rank}.json").exists() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)


def _scenario(name: str) -> Callable[[int, int, Path, dict[str, Any]], Awaitable[None]]:
    """A scenario of this module, or ``module:function`` in another test module whose ranks
    this module spawns (a spawned child imports only the module of its target)."""
    if ":" not in name:
        return SCENARIOS[name]
    module, _, function = name.partition(":")
    found: Callable[[int, int, Path, dict[str, Any]], Awaitable[None]]
    found = getattr(importlib.import_module(module), function)
    return found


def _child(
    rank: int, world: int, workdir: str, checkpoints: str, scenario: str, pg_timeout: float
) -> None:
    torch.set_num_threads(1)
    # Any warning torch.distributed emits fails the run, as it would under pytest.
    warnings.simplefilter("error")
    result: dict[str, Any] = {"rank": rank, "crash": None}
    global _WORKDIR
    _WORKDIR = Path(workdir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if rank % 2:  # odd ranks under uvloop: a group may mix event loops
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover
            pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_scenario(scenario)(rank, world, Path(checkpoints), result))
    except BaseException:
        result["crash"] = traceback.format_exc()
    path = Path(workdir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)
    if result.get("group_broken"):
        os._exit(0)  # a lost rank or a timeout leaves the group unusable: no teardown
    dist.destroy_process_group()


def _verify(slabs: asyncslab.SlabSet, ckpt: Checkpoint) -> dict[str, Any]:
    """Compare every routed slot with the bytes safetensors reads; digest all slabs."""
    plan = slabs.plan
    mismatched = list(asyncslab.testing.verify_slabs(plan, slabs).mismatches)
    h = hashlib.sha256()
    for name in sorted(plan.slabs):
        h.update(raw_bytes(slabs.slab(name)).numpy().tobytes())
    ranges = sorted(
        [r.file.name, r.src_offset, r.src_offset + r.nbytes] for r in plan.routes if r.nbytes
    )
    return {
        "checked": len(plan.routes),
        "mismatched": mismatched,
        "digest": h.hexdigest(),
        "ranges": ranges,
    }


def _error(err: BaseException, started: float) -> dict[str, Any]:
    return {
        "type": type(err).__name__,
        "message": str(err),
        "ranks": list(getattr(err, "ranks", ())),
        "load_error": isinstance(err, LoadError),
        "cause": type(err.__cause__).__name__ if err.__cause__ is not None else None,
        "elapsed": time.perf_counter() - started,
    }


async def _load_and_verify(
    ckpt: Checkpoint, plan: asyncslab.Plan, *, share: bool, options: LoadOptions = EXACT
) -> dict[str, Any]:
    started = time.perf_counter()
    result = await distributed.load(
        ckpt, plan, share_reads=share, options=options, chunk_bytes=SHARE_CHUNK
    )
    async with result:
        stats = result.slabs.statistics()
        out = _verify(result.slabs, ckpt)
        out.update(
            state=stats.state,
            needed=stats.bytes_needed,
            read=stats.bytes_read,
            landed=stats.bytes_landed,
            staging_budget=stats.staging_budget,
            transfer=stats.transfer,
            fingerprint=plan.fingerprint,
            combined=result.fingerprint,
            reports=[
                [r.rank, r.bytes_needed, r.bytes_read, r.bytes_received, r.bytes_sent]
                for r in result.ranks
            ],
            elapsed=time.perf_counter() - started,
        )
    return out


def _open(root: Path, mode: str) -> Checkpoint:
    return Checkpoint.open(root / ("sliced" if mode == "pre-sliced" else "whole"))


async def _all_modes(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    loads: dict[str, Any] = {}
    for mode in ("replicated", *SLICED_MODES):
        ckpt = _open(root, mode)
        plan = rank_plan(ckpt, mode=mode)
        for share in (False, True):
            loads[f"{mode}/{'share' if share else 'own'}"] = await _load_and_verify(
                ckpt, plan, share=share
            )
    # A shared reload into the same slabs: in place, every pointer kept.
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    first = await distributed.load(ckpt, plan, share_reads=True, chunk_bytes=SHARE_CHUNK)
    async with first:
        pointers = {n: first.slabs.slab(n).data_ptr() for n in plan.slabs}
        again = await distributed.load(
            ckpt, plan, share_reads=True, chunk_bytes=SHARE_CHUNK, into=first.slabs
        )
        assert again.slabs is first.slabs
        result["into"] = {
            "pointers_kept": pointers == {n: again.slabs.slab(n).data_ptr() for n in plan.slabs},
            "digest": _verify(again.slabs, ckpt)["digest"],
            "state": again.slabs.state,
        }
    # A shared load into slabs whose own last load failed: that load's finished task must
    # not be taken for the shared load's (which has none), or the slabs read "cancelled".
    failed = asyncslab.SlabSet(plan)

    def broken(_: asyncslab.LoadStatistics) -> None:
        raise RuntimeError("progress display broke")

    try:
        await failed.load(ckpt, progress=broken)
    except LoadError:
        pass
    states = [failed.state]
    shared = await distributed.load(
        ckpt, plan, share_reads=True, chunk_bytes=SHARE_CHUNK, into=failed
    )
    states.append(shared.slabs.state)
    result["after_failed"] = {"states": states, "digest": _verify(shared.slabs, ckpt)["digest"]}
    await failed.aclose()
    result["loads"] = loads
    result["total"] = {
        "whole": Checkpoint.open(root / "whole").total_bytes,
        "sliced": Checkpoint.open(root / "sliced").total_bytes,
    }


def _patch_preadv(behaviour: Callable[[], None]) -> Callable[[], None]:
    """Make every positional read in this process call ``behaviour`` first."""
    from asyncslab.loading import _read

    real, raw = os.preadv, _read._preadv_raw

    def patched(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        behaviour()
        return real(fd, buffers, offset, *args)

    os.preadv = patched
    # Reads into host slabs go through libc's preadv; its os.preadv twin reaches the patch.
    _read._preadv_raw = _read._preadv_via_os

    def undo() -> None:
        os.preadv = real
        _read._preadv_raw = raw

    return undo


def _eio() -> None:
    raise OSError(errno.EIO, "Input/output error (injected)")


async def _expect_failure(
    ckpt: Checkpoint,
    plan: asyncslab.Plan,
    share: bool,
    options: LoadOptions = EXACT,
    chunk_bytes: int = SHARE_CHUNK,
) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        await distributed.load(
            ckpt, plan, share_reads=share, options=options, chunk_bytes=chunk_bytes
        )
    except BaseException as err:
        return _error(err, started)
    return {"type": None}


async def _faults(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Coordinated failures, one after another in one process group, then a good load."""
    out: dict[str, Any] = {}
    for mode, share in (("experts", False), ("replicated", True), ("pre-sliced", True)):
        ckpt = _open(root, mode)
        plan = rank_plan(ckpt, mode=mode)
        undo = _patch_preadv(_eio) if rank == 1 else (lambda: None)
        try:
            out[f"eio/{mode}/{share}"] = await _expect_failure(ckpt, plan, share)
        finally:
            undo()

    # A plan made for the wrong rank: every rank refuses before reading.
    ckpt = _open(root, "experts")
    wrong = rank_plan(ckpt, mode="experts", rank=0, world=world)
    out["wrong-plan"] = await _expect_failure(ckpt, wrong, True)
    # Ranks that would run different sequences of collectives refuse before any of them.
    plan = rank_plan(ckpt, mode="experts")
    out["mismatch"] = await _expect_failure(ckpt, plan, True, chunk_bytes=SHARE_CHUNK + rank)

    # Cancelling one rank's load fails the others' and leaves the group in step.
    slow = LoadOptions(read_size=16 << 10, coalesce_gap=0)
    for share in (False, True):
        ckpt = _open(root, "replicated")
        plan = rank_plan(ckpt, mode="replicated")
        if rank == 1:
            # Cancelled once its first read is under way, every later read held until then:
            # surely mid-load (after a fixed 0.3 s, a load could be anywhere).
            reading, cancelled = threading.Event(), threading.Event()

            def first_then_held(
                reading: threading.Event = reading, cancelled: threading.Event = cancelled
            ) -> None:
                time.sleep(0.02)
                if reading.is_set():
                    cancelled.wait(HANG_S)
                reading.set()

            undo = _patch_preadv(first_then_held)
            task = asyncio.create_task(
                distributed.load(ckpt, plan, share_reads=share, options=slow, chunk_bytes=16 << 10)
            )
            try:
                deadline = time.monotonic() + HANG_S
                while not reading.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.001)
                task.cancel()
            finally:
                cancelled.set()
            started = time.perf_counter()
            try:
                await task
                out[f"cancel/{share}"] = {"type": None}
            except BaseException as err:
                out[f"cancel/{share}"] = _error(err, started)
            finally:
                undo()
        else:
            out[f"cancel/{share}"] = await _expect_failure(
                ckpt, plan, share, options=slow, chunk_bytes=16 << 10
            )

    # The group is still usable, and a load after the failures succeeds.
    ckpt = _open(root, "replicated")
    out["after"] = await _load_and_verify(ckpt, rank_plan(ckpt, mode="replicated"), share=True)
    result["faults"] = out


def _make_killer(after: int) -> Callable[[], None]:
    count = [0]

    def kill() -> None:
        count[0] += 1
        if count[0] == after:
            os._exit(1)

    return kill


async def _killed(rank: int, world: int, root: Path, result: dict[str, Any], share: bool) -> None:
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    if rank == 1:
        _patch_preadv(_make_killer(3))
    options = LoadOptions(read_size=32 << 10, coalesce_gap=0)
    started = time.perf_counter()
    try:
        await distributed.load(ckpt, plan, share_reads=share, options=options, chunk_bytes=32 << 10)
        result["outcome"] = {"type": None}
    except BaseException as err:
        result["outcome"] = _error(err, started)
    result["group_broken"] = True


async def _killed_own(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    await _killed(rank, world, root, result, share=False)


async def _killed_share(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    await _killed(rank, world, root, result, share=True)


async def _hung(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1 hangs in a read. Rank 0 relies on the group's timeout, rank 2 on timeout=."""
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    if rank == 1:
        _patch_preadv(lambda: time.sleep(3600))
    started = time.perf_counter()
    try:
        await distributed.load(
            ckpt,
            plan,
            options=LoadOptions(read_timeout=None),
            timeout=1.5 if rank == 2 else None,
        )
        result["outcome"] = {"type": None}
    except BaseException as err:
        result["outcome"] = _error(err, started)
    result["group_broken"] = True
    if rank == 2:
        # Stay alive until rank 0 timed out: a rank that exits fails the others at once.
        await _until_rank_finished(0)


SCENARIOS: dict[str, Callable[[int, int, Path, dict[str, Any]], Awaitable[None]]] = {
    "modes": _all_modes,
    "faults": _faults,
    "killed-own": _killed_own,
    "killed-share": _killed_share,
    "hung": _hung,
}


async def _modes_then_faults(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    await _all_modes(rank, world, root, result)
    if world == 2:
        await _faults(rank, world, root, result)


SCENARIOS["modes+faults"] = _modes_then_faults


def _after(n: int, behaviour: Callable[[], None]) -> Callable[[], None]:
    """``behaviour`` from the ``n``-th call on."""
    calls = [0]

    def counted() -> None:
        calls[0] += 1
        if calls[0] >= n:
            behaviour()

    return counted


async def _attempt(load: Awaitable[asyncslab.distributed.DistributedLoad]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = await load
    except BaseException as err:
        return _error(err, started)
    await result.aclose()
    return {"type": None}


async def _edges(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Edge cases, each in its own entry; a case that breaks the group comes last."""
    out: dict[str, Any] = result.setdefault("edges", {})
    # A checkpoint holding a zero-size tensor: its route lands without a byte to share.
    zero = Checkpoint.open(root / "zero")
    plan = rank_plan(zero, mode="replicated")
    for share in (False, True):
        try:
            loaded = await distributed.load(zero, plan, share_reads=share, chunk_bytes=1000)
        except BaseException as err:
            out[f"zero/{share}"] = _error(err, time.perf_counter())
        else:
            async with loaded:
                out[f"zero/{share}"] = {"type": None, "state": loaded.slabs.state}
                out[f"zero/{share}"].update(_verify(loaded.slabs, zero))
    # A failed load into given slabs leaves none of their units complete, whichever rank
    # failed and however far its units got.
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    slow = LoadOptions(read_size=32 << 10, coalesce_gap=0, io_workers=1)
    for share in (False, True):
        into = asyncslab.SlabSet(plan)
        undo = _patch_preadv(_after(40, _eio)) if rank == 1 else (lambda: None)
        try:
            got = await _attempt(
                distributed.load(
                    ckpt, plan, into=into, share_reads=share, options=slow, chunk_bytes=32 << 10
                )
            )
        finally:
            undo()
        handed_out = []
        for name in plan.slabs:
            try:
                into.slab(name)
                handed_out.append(name)
            except asyncslab.IncompleteLoadError:
                pass
        got.update(
            into_state=into.state,
            units_complete=into.statistics().units_complete,
            handed_out=handed_out,
        )
        out[f"into/{share}"] = got
        await into.aclose()
    # Rank 0's plan is the one not made by rank_plan.
    plain = asyncslab.plan(ckpt) if rank == 0 else plan
    out["plain-plan-on-rank-0"] = await _attempt(distributed.load(ckpt, plain))
    # chunk_bytes that is not a positive int, on every rank or on one (the small checkpoint:
    # True was taken for 1, a broadcast per byte).
    plan = rank_plan(zero, mode="replicated")
    out["chunk-bool"] = await _attempt(
        distributed.load(zero, plan, share_reads=True, chunk_bytes=True)
    )
    out["chunk-float-on-rank-1"] = await _attempt(
        distributed.load(
            zero, plan, share_reads=True, chunk_bytes=(1 << 20) if rank == 0 else float(1 << 20)
        )
    )
    if "collective failed" in out["chunk-float-on-rank-1"].get("message", ""):
        result["group_broken"] = True
    # Still in step: a good shared load.
    out["after"] = await _attempt(distributed.load(zero, plan, share_reads=True))


SCENARIOS["edges"] = _edges


async def _copy_fails(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1's copy out of a broadcast chunk raises (as a CUDA copy might)."""
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    if rank == 1:
        real = shared.RouteIndex.overlaps
        calls = [0]

        def overlaps(self: Any, seg: Any) -> Any:
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("copy broke (injected)")
            return real(self, seg)

        shared.RouteIndex.overlaps = overlaps  # type: ignore[method-assign]
    result["outcome"] = await _attempt(
        distributed.load(ckpt, plan, share_reads=True, chunk_bytes=SHARE_CHUNK)
    )
    if "collective failed" in result["outcome"].get("message", ""):
        result["group_broken"] = True


SCENARIOS["copy-fails"] = _copy_fails


async def _into_dropped(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1's shared read fails into ``into=`` slabs on every rank; each rank then drops
    its slabs without closing them, with the garbage collector off."""
    import gc
    import weakref

    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    if rank == 1:

        def refuse(*args: Any, **kwargs: Any) -> int:
            raise OSError(errno.EIO, "injected EIO")

        sources.pread_scatter = refuse  # type: ignore[assignment]
    gc.collect()
    gc.disable()
    slabs = asyncslab.SlabSet(plan)
    backing = weakref.ref(slabs._memory.backing)
    result["outcome"] = await _attempt(
        distributed.load(ckpt, plan, share_reads=True, into=slabs, chunk_bytes=SHARE_CHUNK)
    )
    result["state"] = slabs.state
    del slabs
    await asyncio.sleep(0.05)
    result["freed"] = backing() is None


SCENARIOS["into-dropped"] = _into_dropped


async def _cuda_slabs(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Ranks loading into CUDA slabs over gloo (both on one GPU): the shared reads' chunk
    buffers are pinned and copied to the device; every slot checked against safetensors."""
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    for share in (False, True):
        loaded = await distributed.load(
            ckpt, plan, share_reads=share, device="cuda", chunk_bytes=SHARE_CHUNK
        )
        async with loaded:
            slabs = loaded.slabs
            result[f"share={share}"] = {
                "device": {slabs.slab(n).device.type for n in plan.slabs} == {"cuda"},
                "staging_budget": slabs.statistics().staging_budget,
                **_verify(slabs, ckpt),
            }


SCENARIOS["cuda-slabs"] = _cuda_slabs


#: A process-group timeout the tests below must never wait for (their own is shorter).
NEVER_PG_TIMEOUT = 60.0


def _out_of_memory_then_stuck() -> None:
    """From now on no staging buffer of a shared load can be allocated; then never return."""
    _refuse_pinned_staging()
    time.sleep(3600)


async def _deadline_share(
    rank: int, world: int, root: Path, result: dict[str, Any], stuck: bool, oom: bool = False
) -> None:
    """Rank 1's shared load passes its own ``timeout=``: its reads are slow, or one of them
    never returns (``oom``: and from then on its protocol cannot allocate). The other rank
    must hear of it in step, not at the group's timeout."""
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    deadline = 1.0 if stuck else 0.3
    if rank == 1:
        if stuck:
            _patch_preadv(_after(3, _out_of_memory_then_stuck if oom else lambda: time.sleep(3600)))
        else:
            _patch_preadv(lambda: time.sleep(0.02))
    result["outcome"] = await _attempt(
        distributed.load(
            ckpt,
            plan,
            share_reads=True,
            options=LoadOptions(coalesce_gap=0),
            chunk_bytes=16 << 10,
            timeout=deadline if rank == 1 else None,
        )
    )
    if rank == 1:
        # The protocol thread outlives the deadline; this rank stays (its exit would fail
        # the others at once) until that thread has finished its part of the protocol.
        protocol = [t for t in threading.enumerate() if t.name == "asyncslab-dist"]
        await asyncio.to_thread(lambda: [t.join(20) for t in protocol])
        result["protocol_finished"] = not any(t.is_alive() for t in protocol)
    result["group_broken"] = True


async def _deadline_share_slow(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    await _deadline_share(rank, world, root, result, stuck=False)


async def _deadline_share_stuck(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    await _deadline_share(rank, world, root, result, stuck=True)


async def _deadline_share_stuck_oom(
    rank: int, world: int, root: Path, result: dict[str, Any]
) -> None:
    await _deadline_share(rank, world, root, result, stuck=True, oom=True)


SCENARIOS["deadline-share-slow"] = _deadline_share_slow
SCENARIOS["deadline-share-stuck"] = _deadline_share_stuck
SCENARIOS["deadline-share-stuck-oom"] = _deadline_share_stuck_oom


def _refuse_pinned_staging() -> Callable[[], None]:
    """Make allocating the shared reads' staging buffers fail in this process, as pinned
    host memory running out would: the only allocations that ask for ``pin_memory``."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "pin_memory" in kwargs:
            raise RuntimeError("out of memory (injected)")
        return real(*args, **kwargs)

    torch.empty = empty  # type: ignore[assignment]

    def undo() -> None:
        torch.empty = real

    return undo


def _refuse_slab_allocation() -> Callable[[], None]:
    """Make the slabs ``distributed.load`` allocates fail to allocate, through the real
    ``SlabSet`` (its allocation refused as an exhausted allocator refuses it)."""
    real_slabset, real_empty = distributed.SlabSet, torch.empty

    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")

    def failing(plan: asyncslab.Plan, device: Any = "cpu") -> asyncslab.SlabSet:
        torch.empty = refuse  # type: ignore[assignment]
        try:
            return real_slabset(plan, device)
        finally:
            torch.empty = real_empty

    distributed.SlabSet = failing  # type: ignore[assignment,misc]

    def undo() -> None:
        distributed.SlabSet = real_slabset  # type: ignore[misc]

    return undo


def _refuse_route_index() -> Callable[[], None]:
    """Make the set-up after the pre-flight fail past the staging buffers."""
    real = shared.RouteIndex.__init__

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("route index broke (injected)")

    shared.RouteIndex.__init__ = broken  # type: ignore[method-assign]

    def undo() -> None:
        shared.RouteIndex.__init__ = real  # type: ignore[method-assign]

    return undo


def _refuse_open() -> Callable[[], None]:
    """Make opening a shard for the shared reads fail, as a permission error would."""
    real = sources.open_checked

    def refuse(path: Path, *args: Any, **kwargs: Any) -> int:
        raise asyncslab.errors.ReadError("cannot open it: permission denied (injected)", file=path)

    sources.open_checked = refuse

    def undo() -> None:
        sources.open_checked = real

    return undo


#: What fails on rank 1 between its call and the first shared chunk: (fault, share_reads).
SET_UP_FAILURES: dict[str, tuple[Callable[[], Callable[[], None]], bool]] = {
    "staging": (_refuse_pinned_staging, True),
    "route-index": (_refuse_route_index, True),
    "slabs/share": (_refuse_slab_allocation, True),
    "slabs/own": (_refuse_slab_allocation, False),
    "open": (_refuse_open, True),
}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _set_up_fails(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1 fails to set its load up (staging buffers, slabs, ...), one case after
    another in one process group, then a good load. A case that leaves rank 0 waiting in
    a collective breaks the group and ends the run."""
    out: dict[str, Any] = result.setdefault("set_up", {})
    ckpt = _open(root, "replicated")
    plan = rank_plan(ckpt, mode="replicated")
    fds = _open_fds()
    for case, (fault, share) in SET_UP_FAILURES.items():
        undo = fault() if rank == 1 else (lambda: None)
        try:
            got = await _attempt(
                distributed.load(ckpt, plan, share_reads=share, chunk_bytes=SHARE_CHUNK)
            )
        finally:
            undo()
        out[case] = got
        if rank == 1 and got["type"] != "DistributedLoadError":
            # It left the protocol on its own. A server stays up after a failed load:
            # stay long enough for rank 0 to show what waiting for this rank costs.
            await asyncio.sleep(HUNG_PG_TIMEOUT + 1)
            result["group_broken"] = True
            return
        if "collective failed" in got.get("message", ""):
            result["group_broken"] = True
            return
    out["after"] = await _attempt(
        distributed.load(ckpt, plan, share_reads=True, chunk_bytes=SHARE_CHUNK)
    )
    out["fds_leaked"] = _open_fds() - fds


SCENARIOS["set-up-fails"] = _set_up_fails


# --- tests: modes --------------------------------------------------------------------------


def _check_modes(results: list[dict[str, Any] | None], world: int) -> None:
    assert all(r is not None for r in results)
    ranks = [r for r in results if r is not None]
    for r in ranks:
        for key, got in r["loads"].items():
            assert got["state"] == "complete", (r["rank"], key)
            assert got["checked"] > 0
            assert got["mismatched"] == [], (r["rank"], key, got["mismatched"][:5])
            assert got["landed"] == got["needed"], (r["rank"], key)
            # Every rank agrees on every rank's figures and on the combined fingerprint.
            assert got["reports"] == ranks[0]["loads"][key]["reports"], key
            assert got["combined"] == ranks[0]["loads"][key]["combined"], key
    for r in ranks:
        assert r["into"]["state"] == "complete"
        assert r["into"]["pointers_kept"]
        assert r["into"]["digest"] == r["loads"]["replicated/own"]["digest"]
        assert r["after_failed"]["states"] == ["failed", "complete"]
        assert r["after_failed"]["digest"] == r["loads"]["replicated/own"]["digest"]
    combined = {key: got["combined"] for key, got in ranks[0]["loads"].items()}
    for mode in ("replicated", *SLICED_MODES):
        assert combined[f"{mode}/own"] == combined[f"{mode}/share"]
    assert len({combined[f"{mode}/own"] for mode in ("replicated", *SLICED_MODES)}) == 5
    total = ranks[0]["total"]
    replicated_union = _union([r["loads"]["replicated/own"]["ranges"] for r in ranks])
    for mode in ("replicated", *SLICED_MODES):
        own = [r["loads"][f"{mode}/own"] for r in ranks]
        share = [r["loads"][f"{mode}/share"] for r in ranks]
        union = _union([o["ranges"] for o in own])
        for o, s in zip(own, share, strict=True):
            # Independent loads read exactly what they need (no read-through: EXACT).
            assert o["read"] == o["needed"], mode
            # Shared loads fill the very same bytes.
            assert s["digest"] == o["digest"], mode
            assert s["needed"] == o["needed"], mode
            # chunk_bytes is a broadcast's size, its status byte included: a power of two
            # fills the pinned block torch would make of it (chunk_bytes + 1 took twice).
            assert s["staging_budget"] == 2 * SHARE_CHUNK, mode
            assert (o["transfer"], s["transfer"]) == ("direct", "shared"), mode
        # Read once: the group reads the union of what its ranks need, each byte once.
        assert sum(s["read"] for s in share) == union, mode
        assert sum(o["read"] for o in own) == sum(o["needed"] for o in own), mode
        if mode == "replicated":
            assert len({o["fingerprint"] for o in own}) == 1
            assert union == replicated_union
            assert sum(s["read"] for s in share) * world == sum(o["read"] for o in own)
        else:
            # Each rank's plan differs (in rows mode by the slice each route carries).
            assert len({o["fingerprint"] for o in own}) == world, mode
            # A rank reads only its part, and together the ranks cover the checkpoint.
            whole = total["sliced" if mode == "pre-sliced" else "whole"]
            assert all(o["needed"] < whole for o in own), mode
            if mode != "pre-sliced":
                assert union == replicated_union, mode
        # Shared chunks travel to every other rank; nothing is received that was not sent.
        reports = share[0]["reports"]
        sent = sum(rep[4] for rep in reports)
        received = sum(rep[3] for rep in reports)
        assert received == sent * (world - 1), mode


@pytest.mark.timeout(120)
def test_two_ranks_every_mode_then_coordinated_failures(tmp_path: Path, checkpoints2: Path) -> None:
    results = _spawn(tmp_path, 2, "modes+faults", checkpoints2, wait=100)
    _check_modes(results, 2)
    faults = [r["faults"] for r in results if r is not None]
    assert len(faults) == 2
    for key in ("eio/experts/False", "eio/replicated/True", "eio/pre-sliced/True"):
        for rank, f in enumerate(faults):
            got = f[key]
            assert got["type"] == "DistributedLoadError", (rank, key, got)
            assert got["load_error"]
            assert got["ranks"] == [1], (rank, key, got)
            assert "failed on rank 1 of 2" in got["message"], got["message"]
            assert "ReadError" in got["message"]
            assert "Input/output error" in got["message"]
            # Reported in step by the agreement, not by a collective's timeout.
            assert "Timed out" not in got["message"], (rank, key, got)
        assert faults[1][key]["cause"] == "ReadError"
    for f in faults:
        got = f["wrong-plan"]
        assert got["type"] == "DistributedLoadError", got
        assert got["ranks"] == [1], got
        assert "made for rank 0 of 2" in got["message"]
        got = f["mismatch"]
        assert got["type"] == "DistributedLoadError", got
        assert got["ranks"] == [1], got
        assert f"chunk_bytes={SHARE_CHUNK + 1}" in got["message"]
    for share in (False, True):
        assert faults[1][f"cancel/{share}"]["type"] == "CancelledError"
        got = faults[0][f"cancel/{share}"]
        assert got["type"] == "DistributedLoadError", got
        assert got["ranks"] == [1], got
        assert "cancelled" in got["message"]
    for f in faults:
        assert f["after"]["state"] == "complete"
        assert f["after"]["mismatched"] == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_ranks_every_mode(tmp_path: Path, checkpoints3: Path) -> None:
    _check_modes(_spawn(tmp_path, 3, "modes", checkpoints3, wait=100), 3)


# --- tests: lost ranks ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("share", [False, True], ids=["own-reads", "shared-reads"])
def test_killed_rank_fails_the_others_quickly(
    tmp_path: Path, checkpoints2: Path, share: bool
) -> None:
    results = _spawn(tmp_path, 2, "killed-share" if share else "killed-own", checkpoints2, wait=60)
    assert results[1] is None  # it died mid-load
    assert results[0] is not None
    got = results[0]["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert "rank 0 of 2" in got["message"]
    assert "collective failed" in got["message"]
    assert "another rank died" in got["message"]
    assert got["cause"] == "RuntimeError"  # what gloo raises: "Connection closed by peer"
    assert "Timed out" not in got["message"], got  # the death, not the group's timeout


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hung_rank_fails_the_others_at_the_group_timeout_or_the_deadline(
    tmp_path: Path, checkpoints3: Path
) -> None:
    pg_timeout = HUNG_PG_TIMEOUT
    results = _spawn(
        tmp_path, 3, "hung", checkpoints3, pg_timeout=pg_timeout, wait=60, wait_for=(0, 2)
    )
    by_timeout, by_deadline = results[0], results[2]
    assert by_timeout is not None
    assert by_deadline is not None
    got = by_timeout["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert "agreement collective failed" in got["message"]
    assert "Timed out" in got["message"]
    assert got["elapsed"] > pg_timeout - 0.5  # not before the group's timeout
    got = by_deadline["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert "did not finish within timeout=1.5 s" in got["message"]
    assert "Timed out" not in got["message"], got  # its own deadline, not the group's
    assert got["elapsed"] > 1.4  # not before its deadline


# --- tests without a process group --------------------------------------------------------


def _check_chunks(
    ranges: list[list[tuple[int, int, int]]], chunk_bytes: int, gap: int
) -> list[shared.Chunk]:
    chunks = shared.share_chunks(ranges, chunk_bytes=chunk_bytes, gap=gap)
    assert chunks == shared.share_chunks(ranges, chunk_bytes=chunk_bytes, gap=gap)  # deterministic
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in chunks:
        assert 0 < c.nbytes <= chunk_bytes
        assert c.nbytes == sum(s.nbytes for s in c.segments)
        at = 0
        for s in c.segments:
            assert s.at == at
            at += s.nbytes
            covered.setdefault(s.file, []).append((s.offset, s.offset + s.nbytes))
        if c.shared:
            assert len(c.needers) >= 2
        else:
            assert c.needers == (c.owner,)
    # Segments never overlap (every byte is read once) and cover every needed byte.
    for spans in covered.values():
        spans.sort()
        for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False):
            assert e1 <= s2
    for r, spans in enumerate(ranges):
        for f, s, e in spans:
            inside = sum(max(0, min(e, b) - max(s, a)) for a, b in covered.get(f, []))
            assert inside == e - s, (r, f, s, e)
        # Each needed byte sits in a chunk this rank receives or reads itself.
        for c in chunks:
            if r in c.needers:
                assert c.shared or c.owner == r
    return chunks


def test_share_chunks_read_every_needed_byte_once() -> None:
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 4)
        ranges = []
        for _ in range(world):
            spans = []
            for f in range(rng.randint(1, 3)):
                pos = 0
                for _ in range(rng.randint(0, 6)):
                    pos += rng.randint(0, 50)
                    n = rng.randint(1, 80)
                    spans.append((f, pos, pos + n))
                    pos += n
            ranges.append(spans)
        _check_chunks(ranges, chunk_bytes=rng.randint(1, 120), gap=rng.choice([0, 0, 5, 30]))


def test_share_chunks_private_shared_and_balanced() -> None:
    # Rank 0 and 1 each have a private range; both need [100, 500).
    ranges = [[(0, 0, 500)], [(0, 100, 600)]]
    chunks = _check_chunks(ranges, chunk_bytes=100, gap=0)
    private = [c for c in chunks if not c.shared]
    assert [(c.owner, c.nbytes) for c in private] == [(0, 100), (1, 100)]
    shared = [c for c in chunks if c.shared]
    assert sum(c.nbytes for c in shared) == 400
    assert sorted(c.owner for c in shared) == [0, 0, 1, 1]  # balanced by bytes
    # Replicated: everything shared, owners alternate.
    chunks = _check_chunks([[(0, 0, 400)]] * 2, chunk_bytes=100, gap=0)
    assert [c.owner for c in chunks] == [0, 1, 0, 1]
    # A small gap between two ranges of one rank is read through, not split.
    chunks = _check_chunks([[(0, 0, 10), (0, 14, 20)]], chunk_bytes=100, gap=4)
    assert [(s.offset, s.nbytes) for s in chunks[0].segments] == [(0, 20)]
    # ... but never a gap holding bytes another rank needs.
    chunks = _check_chunks([[(0, 0, 10), (0, 14, 20)], [(0, 11, 12)]], chunk_bytes=100, gap=4)
    assert sum(s.nbytes for c in chunks for s in c.segments) == 17


def test_rank_plan_modes_partition_the_checkpoint(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    full = rank_plan(ckpt, mode="replicated", rank=0, world=1)
    assert full.extras["distributed"] == {"mode": "replicated", "rank": 0, "world": 1}
    experts = [rank_plan(ckpt, mode="experts", rank=r, world=2) for r in range(2)]
    for r, p in enumerate(experts):
        assert {x.expert for x in p.routes if x.expert is not None} == {
            e for e in range(moe_checkpoint.spec.n_experts) if e % 2 == r
        }
    rows = [rank_plan(ckpt, mode="rows", rank=r, world=2) for r in range(2)]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert rows[0].route(name).shape == (128, 256)
    assert rows[1].route(name).src_offset == rows[0].route(name).src_offset + 128 * 256 * 2
    both = rank_plan(ckpt, mode="rows+experts", rank=1, world=2)
    assert both.route(name).shape == (128, 256)
    assert all(x.expert % 2 == 1 for x in both.routes if x.expert is not None)
    # Which rows a plan carries is part of its fingerprint, and swapping which rank holds
    # which rows changes the combined fingerprint.
    slices = [p.fingerprint for p in rows]
    assert slices[0] != slices[1]
    assert agreement.combined(slices) != agreement.combined(slices[::-1])
    mine = rank_plan(ckpt, mode="experts", rank=0, world=2, owns=lambda layer, e: e < 3)
    assert {x.expert for x in mine.routes if x.expert is not None} == {0, 1, 2}


def test_rank_plan_refuses_what_does_not_fit(tmp_path: Path) -> None:
    whole = Checkpoint.open(asyncslab.testing.write_synthetic(tmp_path / "w", SyntheticSpec()).root)
    sliced = Checkpoint.open(
        asyncslab.testing.write_synthetic(tmp_path / "s", SyntheticSpec(tp_ranks=2)).root
    )
    with pytest.raises(PlanError, match="sliced for 2 ranks, but the process group has 4"):
        rank_plan(sliced, mode="pre-sliced", rank=0, world=4)
    with pytest.raises(PlanError, match="load it with mode='pre-sliced'"):
        rank_plan(sliced, mode="experts", rank=0, world=2)
    with pytest.raises(PlanError, match="has whole expert tensors"):
        rank_plan(whole, mode="pre-sliced", rank=0, world=2)
    with pytest.raises(PlanError, match="unknown mode"):
        rank_plan(whole, mode="columns", rank=0, world=2)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="cannot split shape"):
        rank_plan(whole, mode="rows", rank=0, world=3)
    with pytest.raises(PlanError, match="owns= applies"):
        rank_plan(whole, mode="rows", rank=0, world=2, owns=lambda layer, e: True)
    with pytest.raises(PlanError, match="not initialized"):
        rank_plan(whole, mode="replicated")
    p = rank_plan(sliced, mode="pre-sliced", rank=1, world=2)
    assert all(".rank1." in r.tensor for r in p.routes if r.expert is not None)


@pytest.mark.asyncio
async def test_load_needs_a_process_group(moe_checkpoint: SyntheticCheckpoint) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    plan = rank_plan(ckpt, mode="replicated", rank=0, world=1)
    with pytest.raises(LoadError, match="not initialized"):
        await distributed.load(ckpt, plan)


def test_error_names_ranks_and_pickles() -> None:
    err = DistributedLoadError(
        "distributed load failed on rank 1 of 2: ReadError: boom",
        ranks=(1,),
        errors={1: "ReadError: boom"},
        rank=0,
        world=2,
    )
    assert isinstance(err, LoadError)
    assert isinstance(err, RuntimeError)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is DistributedLoadError
    assert clone.ranks == (1,)
    assert clone.errors == {1: "ReadError: boom"}
    assert str(clone) == str(err)


# --- tests: edge cases (one spawn, checked case by case) -----------------------------------


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory, checkpoints2: Path) -> list[dict[str, Any]]:
    from safetensors.torch import save_file

    zero = checkpoints2 / "zero"
    if not zero.exists():
        zero.mkdir()
        tensors = {"a.weight": torch.zeros(0), "c.weight": torch.arange(1000, dtype=torch.float32)}
        save_file(tensors, str(zero / "model.safetensors"))
    results = _spawn(tmp_path_factory.mktemp("edges"), 2, "edges", checkpoints2, wait=100)
    assert all(r is not None for r in results)
    return [r["edges"] for r in results if r is not None]


@pytest.mark.timeout(150)
def test_shared_load_of_a_checkpoint_with_a_zero_size_tensor(edges: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(edges):
        for share in (False, True):
            loaded = got[f"zero/{share}"]
            assert loaded["type"] is None, (rank, share, loaded)
            assert loaded["state"] == "complete"
            assert loaded["checked"] == 2
            assert loaded["mismatched"] == []


@pytest.mark.timeout(150)
def test_a_failed_load_into_given_slabs_leaves_no_unit_complete(
    edges: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(edges):
        for share in (False, True):
            failed = got[f"into/{share}"]
            assert failed["type"] == "DistributedLoadError", (rank, share, failed)
            assert failed["ranks"] == [1], failed
            assert failed["units_complete"] == 0, (rank, share, failed)
            assert failed["handed_out"] == [], (rank, share, failed)
            assert failed["into_state"] in ("empty", "failed"), failed


@pytest.mark.timeout(150)
def test_an_error_names_the_rank_whose_plan_rank_plan_made(edges: list[dict[str, Any]]) -> None:
    for got in edges:
        failed = got["plain-plan-on-rank-0"]
        assert failed["type"] == "DistributedLoadError", failed
        assert failed["ranks"] == [0], failed
        expected = "failed on rank 0 of 2: its plan was not made by rank_plan, rank 1's was"
        assert expected in failed["message"], failed["message"]


@pytest.mark.timeout(150)
def test_chunk_bytes_that_is_not_a_positive_int_fails_every_rank_before_loading(
    edges: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(edges):
        both = got["chunk-bool"]
        assert both["type"] == "DistributedLoadError", (rank, both)
        assert both["ranks"] == [0, 1], both
        assert "chunk_bytes must be a positive int, got True (bool)" in both["message"]
        assert both["cause"] == "ValueError"
        one = got["chunk-float-on-rank-1"]
        assert one["type"] == "DistributedLoadError", (rank, one)
        assert one["ranks"] == [1], one
        assert "chunk_bytes must be a positive int, got 1048576.0 (float)" in one["message"]
        assert "before loading" in one["message"]
        assert one["cause"] == ("ValueError" if rank == 1 else None)
        assert got["after"] == {"type": None}, (rank, got["after"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_copy_failing_on_one_rank_fails_every_rank_in_step(
    tmp_path: Path, checkpoints2: Path
) -> None:
    results = _spawn(tmp_path, 2, "copy-fails", checkpoints2, pg_timeout=HUNG_PG_TIMEOUT, wait=60)
    for rank, r in enumerate(results):
        assert r is not None, rank
        got = r["outcome"]
        assert got["type"] == "DistributedLoadError", (rank, got)
        assert got["ranks"] == [1], (rank, got)
        assert "failed on rank 1 of 2: RuntimeError: copy broke (injected)" in got["message"]
        assert got["cause"] == ("RuntimeError" if rank == 1 else None)


@pytest.mark.slow
@pytest.mark.timeout(45)  # < NEVER_PG_TIMEOUT: no rank may wait for the group's timeout
@pytest.mark.parametrize(
    "scenario",
    ["deadline-share-slow", "deadline-share-stuck", "deadline-share-stuck-oom"],
    ids=["slow-reads", "stuck-read", "stuck-read-then-out-of-memory"],
)
def test_a_shared_load_past_its_timeout_fails_the_others_in_step(
    tmp_path: Path, checkpoints2: Path, scenario: str
) -> None:
    stuck = "stuck" in scenario
    results = _spawn(tmp_path, 2, scenario, checkpoints2, pg_timeout=NEVER_PG_TIMEOUT, wait=40)
    late, other = results[1], results[0]
    assert late is not None
    assert other is not None
    deadline = "1.0" if stuck else "0.3"
    got = late["outcome"]
    assert got["type"] == "DistributedLoadError", got
    expected = f"rank 1 of 2: distributed load did not finish within timeout={deadline} s"
    assert expected in got["message"], got
    # It took part in the rest of the protocol (also past a read that never returns).
    assert late["protocol_finished"]
    got = other["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert got["ranks"] == [1], got
    expected = f"distributed load failed on rank 1 of 2: load timed out after {deadline} s"
    assert expected in got["message"], got
    assert got["cause"] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_shared_and_own_loads_into_cuda_slabs_are_bit_identical(
    tmp_path: Path, checkpoints2: Path
) -> None:
    results = _spawn(tmp_path, 2, "cuda-slabs", checkpoints2, wait=100)
    for r in results:
        assert r is not None
        for share in (False, True):
            got = r[f"share={share}"]
            assert got["device"], (r["rank"], share)
            assert got["mismatched"] == [], (r["rank"], share)
            assert got["checked"] > 0
        # Pinned chunk buffers hold a power of two: chunk_bytes, the status byte included.
        assert r["share=True"]["staging_budget"] == 2 * SHARE_CHUNK
    assert results[0]["share=True"]["digest"] == results[0]["share=False"]["digest"]


@pytest.mark.slow
@pytest.mark.timeout(45)  # < NEVER_PG_TIMEOUT: no rank may wait for the group's timeout
def test_a_rank_failing_to_set_up_its_load_fails_every_rank_in_step(
    tmp_path: Path, checkpoints2: Path
) -> None:
    """Rank 1's staging buffers (or its slabs, or the rest of its set-up) cannot be
    allocated: every rank fails at once naming rank 1, not at the group's timeout."""
    results = _spawn(
        tmp_path, 2, "set-up-fails", checkpoints2, pg_timeout=NEVER_PG_TIMEOUT, wait=40
    )
    assert all(r is not None for r in results)
    outcomes = [r["set_up"] for r in results if r is not None]
    causes = {
        "staging": "LoadError",
        "route-index": "RuntimeError",
        "slabs/share": "LoadError",
        "slabs/own": "LoadError",
        "open": "ReadError",
    }
    why = {
        "staging": "cannot allocate the staging buffers of the shared reads",
        "route-index": "RuntimeError: route index broke (injected)",
        "slabs/share": "slabs on cpu: DefaultCPUAllocator",
        "slabs/own": "slabs on cpu: DefaultCPUAllocator",
        "open": "ReadError: ",
    }
    for case in SET_UP_FAILURES:
        for rank, out in enumerate(outcomes):
            assert case in out, (rank, case, out)
            got = out[case]
            assert got["type"] == "DistributedLoadError", (rank, case, got)
            assert got["load_error"]
            assert got["ranks"] == [1], (rank, case, got)
            assert "distributed load failed on rank 1 of 2: " in got["message"], (case, got)
            assert why[case] in got["message"], (case, got)
            assert "(injected)" in got["message"], (case, got)
            # In step, not at the group's timeout: that is NEVER_PG_TIMEOUT here, past this
            # test's own timeout (a wall-clock bound on the elapsed time failed loaded runs).
            assert "Timed out" not in got["message"], (rank, case, got)
            assert got["cause"] == (causes[case] if rank == 1 else None), (rank, case, got)
    for rank, out in enumerate(outcomes):
        assert out["after"] == {"type": None}, (rank, out["after"])
        assert out["fds_leaked"] == 0, (rank, out)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_into_slabs_of_a_failed_shared_load_are_freed_when_dropped(
    tmp_path: Path, checkpoints2: Path
) -> None:
    """The failed load's error, kept by the slabs for ready(), held the protocol's frames,
    and they the session and so the slabs: dropped without aclose(), they stayed until a
    full garbage collection."""
    results = _spawn(tmp_path, 2, "into-dropped", checkpoints2, pg_timeout=HUNG_PG_TIMEOUT, wait=40)
    for rank, r in enumerate(results):
        assert r is not None, rank
        assert r["outcome"]["type"] == "DistributedLoadError", (rank, r)
        assert r["outcome"]["ranks"] == [1], (rank, r)
        assert r["state"] == "failed", (rank, r)
        assert r["freed"], (rank, r)


# --- tests: ranks that disagree before loading, and odd chunk sizes -------------------------


async def _disagree(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1 differs from rank 0 in one way per case; then good loads with odd chunks."""
    out: dict[str, Any] = {}
    whole = _open(root, "whole")
    sliced = _open(root, "pre-sliced")
    # Another mode on rank 1: each rank would load a part of a different split.
    mode = "experts" if rank == 0 else "rows"
    out["mode"] = await _attempt(distributed.load(whole, rank_plan(whole, mode=mode)))
    # A replicated plan that leaves a tensor out on rank 1 only.
    skip = ("model.layers.0.self_attn.q_proj.weight",) if rank == 1 else ()
    replicated = rank_plan(whole, mode="replicated", ignore=skip)
    out["replicated"] = await _attempt(distributed.load(whole, replicated))
    # Another checkpoint on rank 1.
    if rank == 0:
        other = rank_plan(whole, mode="experts")
        out["checkpoint"] = await _attempt(distributed.load(whole, other))
    else:
        other = rank_plan(sliced, mode="pre-sliced")
        out["checkpoint"] = await _attempt(distributed.load(sliced, other))
    # Good shared loads whose chunks hold several routes and cut them at odd offsets, and
    # an expert split that is not round robin.
    for mode, chunk in (("rows+experts", 4097), ("experts", 3001), ("pre-sliced", 777)):
        ckpt = _open(root, mode)
        owns = (lambda layer, e: (e < 3) == (rank == 0)) if mode == "experts" else None
        plan = rank_plan(ckpt, mode=mode, owns=owns)
        loaded = await distributed.load(ckpt, plan, share_reads=True, chunk_bytes=chunk)
        async with loaded:
            got = _verify(loaded.slabs, ckpt)
            got["state"] = loaded.slabs.state
            got["experts"] = sorted({r.expert for r in plan.routes if r.expert is not None})
            got["staging_budget"] = loaded.slabs.statistics().staging_budget
            out[f"share/{mode}/{chunk}"] = got
    # share_reads on rank 0 only: the ranks would run different collectives (last: a
    # mutant that lets them start may break the group).
    out["sharing"] = await _attempt(
        distributed.load(whole, replicated, share_reads=rank == 0, chunk_bytes=SHARE_CHUNK)
    )
    if "collective failed" in out["sharing"].get("message", ""):
        result["group_broken"] = True
    result["disagree"] = out


SCENARIOS["disagree"] = _disagree


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ranks_that_disagree_before_loading_all_fail_naming_the_odd_rank(
    tmp_path: Path, checkpoints2: Path
) -> None:
    """A rank with another mode, another replicated plan, another checkpoint or another
    share_reads than rank 0 fails every rank, naming it, before any read: else the ranks
    "complete" loads of parts that do not fit together (or run different collectives and
    hang). And shared loads with chunk sizes that are not powers of two, cutting routes at
    odd offsets, fill every rank's slots with exactly the bytes safetensors reads."""
    results = _spawn(tmp_path, 2, "disagree", checkpoints2, pg_timeout=HUNG_PG_TIMEOUT, wait=40)
    assert all(r is not None for r in results)
    outcomes = [r["disagree"] for r in results if r is not None]
    why = {
        "mode": "failed on rank 1 of 2: planned mode 'rows', rank 0 'experts'",
        "replicated": "failed on rank 1 of 2: replicated plan ",
        "checkpoint": "failed on rank 1 of 2: opened another checkpoint than rank 0",
        "sharing": "failed on rank 1 of 2: loads with share_reads=False, rank 0 with "
        f"share_reads=True, chunk_bytes={SHARE_CHUNK}",
    }
    for rank, out in enumerate(outcomes):
        for case, text in why.items():
            got = out[case]
            assert got["type"] == "DistributedLoadError", (rank, case, got)
            assert got["ranks"] == [1], (rank, case, got)
            assert text in got["message"], (rank, case, got["message"])
            assert "before loading" in got["message"], (rank, case, got["message"])
        assert "differs from rank 0's" in out["replicated"]["message"]
        for key, got in out.items():
            if key.startswith("share/"):
                assert got["state"] == "complete", (rank, key)
                assert got["checked"] > 0, (rank, key)
                assert got["mismatched"] == [], (rank, key, got["mismatched"][:5])
                chunk = int(key.rsplit("/", 1)[1])
                assert got["staging_budget"] == 2 * chunk, (rank, key, got["staging_budget"])
        assert out["share/experts/3001"]["experts"] == ([0, 1, 2] if rank == 0 else [3, 4, 5, 6, 7])

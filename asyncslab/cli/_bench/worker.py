"""One benchmark contender, run in a process of its own (``python -m asyncslab.cli._bench.worker``).

:mod:`asyncslab.cli._bench` starts this module once per contender and run, so that resident
memory, the allocator's free lists and the first touch of fresh pages belong to that
contender alone. The task comes as one JSON argument; the result is one JSON line on stdout
after :data:`RESULT_MARK`. Everything before the timed region (imports, opening the
checkpoint, planning, allocation of pre-touched memory) is untimed; the timed region is
the load a server start would pay for that contender, less asyncslab's opening and planning
of the checkpoint (``plan_s`` in each record; the parent reports the sum too) — the others
parse their headers inside their clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ..._os import loop_name, peak_rss, proc_status, reset_peak_rss, run

T = TypeVar("T")

RESULT_MARK = "@@asyncslab-bench-result@@ "
IDLE_LAG_S = 0.3  # ticker control before the load: the machine's own scheduling lag

# Peers benchmarked when importable (the ``peers`` extra installs them), each in the
# configurations tried, with the module each needs; "-N" = N reader threads, as in bound-N.
# Both peers read local disks with O_DIRECT by default, past a warm page cache; the second
# configuration of each reads through the cache.
PEERS = {
    # SafetensorsStreamer.stream_files over every shard at once (as vLLM calls it): its
    # defaults (io_uring, O_DIRECT), then RUNAI_STREAMER_FS_STRATEGY=sync_buffered with
    # RUNAI_STREAMER_CONCURRENCY=N reader threads.
    "runai-model-streamer": "runai_model_streamer",
    "runai-model-streamer-buffered-N": "runai_model_streamer",
    # fastsafe_open's defaults (O_DIRECT), then SafeTensorsFileLoader with buffered reads
    # (FASTSAFETENSORS_ODIRECT=0) and max_threads=N.
    "fastsafetensors": "fastsafetensors",
    "fastsafetensors-buffered-N": "fastsafetensors",
}


# --------------------------------------------------------------------------- memory


def steal_ms() -> float | None:
    """CPU time the hypervisor has taken from this VM since boot, all CPUs together, in ms
    (the ``steal`` column of ``/proc/stat``, counted in clock ticks); ``None`` where the
    kernel does not report it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- helpers


def build_plan(checkpoint: Any, rules: str) -> Any:
    import asyncslab

    if rules == "default":
        return asyncslab.plan(checkpoint)
    if rules == "dense":
        return asyncslab.plan(checkpoint, [asyncslab.Dense()])
    if rules.startswith("stack:"):
        return asyncslab.plan(checkpoint, [asyncslab.Stack(rules[len("stack:") :])])
    raise ValueError(f"unknown rules {rules!r}")


def routes_by_file(plan: Any) -> list[tuple[str, list[Any]]]:
    """Routes grouped by shard file, in payload order (plan.routes is sorted that way)."""
    groups: dict[str, list[Any]] = {}
    for route in plan.routes:
        groups.setdefault(str(route.file), []).append(route)
    return list(groups.items())


def is_file_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a file mapping (a zero-copy view of the file)."""
    ptr = t.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= ptr < hi:
                    return len(fields) >= 6 and fields[5].startswith("/")
    except OSError:
        pass
    return False


def touch(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0)


def pretouched_passes(task: dict[str, Any]) -> int:
    """Timed passes per process: several in warm-pretouched mode, where the destination is
    touched beforehand and every pass writes into the same memory (the machine drifts over
    seconds, and with one pass per process that drift would go whole into each paired
    ratio); one otherwise, since fresh memory is fresh only once."""
    return max(1, int(task.get("repeats", 1))) if task["mode"] == "warm-pretouched" else 1


def verify(plan: Any, get_slot: Callable[[Any], torch.Tensor], k: int) -> int:
    """Compare ``k`` sampled slots (every slot for ``k`` < 0) with what safetensors reads;
    returns how many matched (a mismatch raises)."""
    from asyncslab.testing._verify import sample_routes, verify_slabs

    result = verify_slabs(plan, get_slot, routes=sample_routes(plan, k))
    if not result.ok:
        raise AssertionError(f"bytes differ from safetensors: {result.describe()}")
    return result.tensors


def slot_of(slabs: dict[str, torch.Tensor], route: Any) -> torch.Tensor:
    return slabs[route.slab][route.slot]


# --------------------------------------------------------------------------- contenders


class Timed:
    """Marks the timed region and snapshots memory at its edges."""

    def __init__(self) -> None:
        self.before = proc_status()
        self.peak_reset = reset_peak_rss()
        if self.peak_reset:
            self.before = proc_status()
        self.t0 = 0.0
        self.t1 = 0.0
        self.at_peak: dict[str, int] = {}
        self.pass_seconds: list[float] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def mark_peak(self) -> None:
        """Memory where the contender holds the most (before it drops temporaries)."""
        self.at_peak = proc_status()

    def stop(self) -> None:
        self.t1 = time.perf_counter()
        self.after = proc_status()

    def passes(self, count: int, one_pass: Callable[[], float]) -> None:
        """Time ``count`` passes of ``one_pass`` (which returns its own seconds) between
        :meth:`start` and :meth:`stop`; the record reports their median."""
        self.start()
        self.pass_seconds = [one_pass() for _ in range(count)]
        self.stop()

    def record(self) -> dict[str, Any]:
        hwm = self.after["VmHWM"]
        if not self.peak_reset:  # VmHWM is the process's peak then: ru_maxrss may say more
            hwm = max(hwm, peak_rss() or 0)
        out: dict[str, Any] = {
            "seconds": (
                statistics.median(self.pass_seconds) if self.pass_seconds else self.t1 - self.t0
            ),
            "rss_before": self.before["VmRSS"],
            "rss_after": self.after["VmRSS"],
            "peak_rss": hwm,
            "peak_growth": hwm - self.before["VmRSS"],
            "peak_reset": self.peak_reset,
            "anon_growth": self.after["RssAnon"] - self.before["RssAnon"],
            "file_growth": self.after["RssFile"] - self.before["RssFile"],
        }
        if self.pass_seconds:
            out["pass_seconds"] = self.pass_seconds
        if self.at_peak:
            out["anon_growth_at_peak"] = self.at_peak["RssAnon"] - self.before["RssAnon"]
            out["file_growth_at_peak"] = self.at_peak["RssFile"] - self.before["RssFile"]
        return out


def run_old_path(task: dict[str, Any], checkpoint: Any, plan: Any, *, mmap: bool) -> dict[str, Any]:
    """Per-expert tensors first (each in memory of its own, or safetensors' mmap views),
    all kept, then ``torch.stack`` per slab in slot order, then drop the per-expert ones."""
    from safetensors import safe_open

    by_slab: dict[str, list[Any]] = defaultdict(list)
    for route in plan.routes:
        by_slab[route.slab].append(route)
    for routes in by_slab.values():
        routes.sort(key=lambda r: r.dst_offset)
    groups = routes_by_file(plan)
    note: dict[str, Any] = {}

    timed = Timed()
    timed.start()
    per: dict[str, torch.Tensor] = {}
    for path, routes in groups:
        with safe_open(path, framework="pt") as f:
            for route in routes:
                t = f.get_tensor(route.tensor)
                per[route.tensor] = t if mmap else t.clone()
    slabs: dict[str, torch.Tensor] = {}
    for name, spec in plan.slabs.items():
        routes = by_slab[name]
        if not spec.slot_dims:
            slabs[name] = per[routes[0].tensor]
        else:
            slabs[name] = torch.stack([per[r.tensor] for r in routes]).view(spec.shape)
    timed.mark_peak()
    if mmap and per:
        # safetensors >= 0.4 maps the file privately and get_tensor views it; an older or
        # newer one might copy, which would make this contender a copying one.
        note["get_tensor_zero_copy"] = is_file_mapped(next(iter(per.values())))
    per.clear()
    timed.stop()
    rec = timed.record()
    rec["verified"] = verify(plan, lambda r: slot_of(slabs, r), task["verify"])
    rec.update(note)
    return rec


def run_direct_copy(task: dict[str, Any], checkpoint: Any, plan: Any) -> dict[str, Any]:
    """Preallocated slabs; ``safe_open().get_tensor(name)`` then ``slab[slot].copy_(t)``."""
    from safetensors import safe_open

    groups = routes_by_file(plan)
    pretouched = task["mode"] == "warm-pretouched"
    slabs: dict[str, torch.Tensor] = {}
    if pretouched:
        slabs = {n: torch.empty(s.shape, dtype=s.dtype) for n, s in plan.slabs.items()}
        touch(list(slabs.values()))

    def one_pass() -> float:
        nonlocal slabs
        t0 = time.perf_counter()
        if not pretouched:
            slabs = {n: torch.empty(s.shape, dtype=s.dtype) for n, s in plan.slabs.items()}
        for path, routes in groups:
            with safe_open(path, framework="pt") as f:
                for route in routes:
                    slabs[route.slab][route.slot].copy_(f.get_tensor(route.tensor))
        return time.perf_counter() - t0

    timed = Timed()
    timed.passes(pretouched_passes(task), one_pass)
    rec = timed.record()
    rec["verified"] = verify(plan, lambda r: slot_of(slabs, r), task["verify"])
    return rec


class Ticker:
    """A task that sleeps 1 ms at a time and records how late each wake-up came (``lags``,
    in seconds): the lag a server's requests would meet. It runs for an ``async with``
    block, and is running before the block starts."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _tick(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)


def run_asyncslab(task: dict[str, Any], checkpoint: Any, plan: Any) -> dict[str, Any]:
    """``asyncslab.load`` with default options (or the passed-through ones), with a ticker
    task measuring how late the event loop wakes it (the lag a server would see)."""
    import asyncslab

    options = asyncslab.LoadOptions(**task.get("options", {}))
    pretouched = task["mode"] == "warm-pretouched"
    lags: list[float] = []
    out: dict[str, Any] = {}

    async def main() -> None:
        slabs = None
        if pretouched:
            slabs = asyncslab.SlabSet(plan)
            backing = slabs.loads.current.sink.backing  # the one allocation behind the slabs
            if isinstance(backing, torch.Tensor):
                touch([backing])
            else:  # slabs without one: a load writes every byte as well
                await slabs.load(checkpoint, options=options)
                slabs.reset()
        # Control: the same ticker with nothing else running, so that lag caused by the
        # machine (other processes on the cores) is not blamed on the load.
        async with Ticker() as idle:
            await asyncio.sleep(IDLE_LAG_S)
        async with Ticker() as ticker:
            timed = Timed()
            timed.start()
            stolen = steal_ms()
            if slabs is None:
                slabs = await asyncslab.load(checkpoint, plan, options=options)
            else:
                # Pre-touched: reset keeps the memory, so each pass reloads into the same slabs.
                for i in range(pretouched_passes(task)):
                    if i:
                        slabs.reset()
                    t0 = time.perf_counter()
                    await slabs.load(checkpoint, options=options)
                    timed.pass_seconds.append(time.perf_counter() - t0)
            timed.stop()
            if stolen is not None and (now := steal_ms()) is not None:
                # A long tick in a load the hypervisor took time from is not the loader's alone.
                out["steal_ms"] = now - stolen
        lags.extend(ticker.lags)
        out.update(timed.record())
        out["idle_lag_ms"] = lag_summary(idle.lags)
        out["idle_lag_samples_ms"] = [round(x * 1e3, 4) for x in idle.lags]
        stats = slabs.statistics()
        out["reads"] = stats.reads
        out["bytes_read"] = stats.bytes_read
        out["staging_budget"] = stats.staging_budget
        out["load_elapsed_s"] = stats.elapsed_s
        out["verified"] = verify(plan, lambda r: slabs.view(r.tensor), task["verify"])
        await slabs.aclose()

    run(main())
    out["loop"] = loop_name()
    out["lag_ms"] = lag_summary(lags)
    out["lag_samples_ms"] = [round(x * 1e3, 4) for x in lags]
    out["options"] = {k: getattr(options, k) for k in ("io_workers", "read_size", "coalesce_gap")}
    return out


def lag_summary(lags: Sequence[float], period: float = 0.001) -> dict[str, float]:
    """Percentiles of ticker lags (seconds in, ms out). ``p99`` is per tick; ``p99_time``
    weighs each tick by the time it took (``period`` + its lag): a 35 ms stall is one tick
    but 35 ms of the load, and a request arriving at a random moment meets it in proportion
    to its length. ``late_share``: share of the time spent in ticks late by over 5 ms."""
    if not lags:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "p99_time": 0.0, "late_share": 0.0}
    ordered = sorted(lags)
    weights = [period + max(0.0, lag) for lag in ordered]
    total = sum(weights)
    covered, p99_time = 0.0, ordered[-1]
    for lag, weight in zip(ordered, weights, strict=True):
        covered += weight
        if covered >= 0.99 * total:
            p99_time = lag
            break
    late = sum(w for lag, w in zip(ordered, weights, strict=True) if lag > 0.005)
    return {
        "n": len(ordered),
        "p50": ordered[len(ordered) // 2] * 1e3,
        "p99": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1e3,
        "max": ordered[-1] * 1e3,
        "p99_time": p99_time * 1e3,
        "late_share": late / total,
    }


def run_in_threads(jobs: Sequence[T], threads: int, work: Callable[[int, T], object]) -> float:
    """Seconds for ``threads`` threads to run ``work(thread, job)`` over ``jobs``, each job
    taken once, in order; the first error in any thread is raised once all have stopped."""
    cursor = iter(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drive(thread: int) -> None:
        try:
            while not errors:
                with lock:
                    try:
                        job = next(cursor)
                    except StopIteration:
                        return
                work(thread, job)
        except BaseException as err:  # noqa: BLE001 - raised by the caller
            errors.append(err)

    pool = [threading.Thread(target=drive, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def run_bound(task: dict[str, Any], checkpoint: Any, plan: Any, *, threads: int) -> dict[str, Any]:
    """The bytes asyncslab reads, coalesced by its own scheduler, read with the same
    ``preadv`` calls into one preallocated buffer (slab by slab at asyncslab's offsets) by
    ``threads`` threads: what storage, page cache and memory can do, without asyncio or
    bookkeeping."""
    from ...loading import direct_scatters, pread_scatter, schedule, slab_layout

    options = task.get("options", {})
    read_size = options.get("read_size", 16 << 20)
    gap = options.get("coalesce_gap", 64 << 10)
    sched = schedule(plan, max_read=read_size, gap=gap)
    base, total, _ = slab_layout(plan, torch.device("cpu"))
    buffer = torch.empty(max(1, total), dtype=torch.uint8)
    if task["mode"] == "warm-pretouched":
        buffer.fill_(1)
    fds = [os.open(str(f.path), os.O_RDONLY) for f in plan.files]
    scratch = torch.empty(max(1, gap), dtype=torch.uint8)
    # Destinations are worked out before the clock starts: the bound pays for syscalls only.
    start = buffer.data_ptr()
    addresses = [start + base[r.slab] for r in plan.routes]
    scatters = direct_scatters(sched.ops, addresses, scratch.data_ptr())
    jobs = [(fds[op.file], op.offset, sc) for op, sc in zip(sched.ops, scatters, strict=True)]

    def one_pass() -> float:
        return run_in_threads(
            jobs, threads, lambda _, job: pread_scatter(job[0], job[2], job[1], path="bound")
        )

    timed = Timed()
    try:
        timed.passes(pretouched_passes(task), one_pass)
    finally:
        for fd in fds:
            os.close(fd)
    rec = timed.record()
    rec["reads"] = len(sched.ops)
    rec["bytes_read"] = sched.bytes_read
    rec["threads"] = threads

    def get_slot(route: Any) -> torch.Tensor:
        start = base[route.slab] + route.dst_offset
        return buffer[start : start + route.nbytes]

    rec["verified"] = verify(plan, get_slot, task["verify"])
    return rec


def run_first_touch(task: dict[str, Any], plan: Any, *, threads: int) -> dict[str, Any]:
    """Allocate ``plan.nbytes`` fresh and write it once: the page-fault floor."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timed = Timed()
        timed.start()
        buffer = torch.empty(max(1, plan.nbytes), dtype=torch.uint8)
        buffer.fill_(1)
        timed.stop()
    finally:
        torch.set_num_threads(previous)
    rec = timed.record()
    rec["threads"] = threads
    rec["verified"] = 0
    return rec


def run_peer(task: dict[str, Any], checkpoint: Any, plan: Any, peer: str) -> dict[str, Any]:
    """A peer loader reads the tensors; each lands in a preallocated slab slot, so every
    contender ends with the same slabs (an engine using a peer copies into its parameters
    the same way). Only the peer's own API is used; configuration it reads from the
    environment is set for the run (before its first use)."""
    n = task.get("threads", 4)
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}")
    settings = {
        "runai-model-streamer-buffered-N": {
            "RUNAI_STREAMER_FS_STRATEGY": "sync_buffered",
            "RUNAI_STREAMER_CONCURRENCY": str(n),
        },
        "fastsafetensors-buffered-N": {"FASTSAFETENSORS_ODIRECT": "0"},
    }.get(peer, {})
    with environ(settings):
        return _run_peer(task, plan, peer, n)


@contextlib.contextmanager
def environ(settings: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block only (``--in-process`` runs share one)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_peer(task: dict[str, Any], plan: Any, peer: str, n: int) -> dict[str, Any]:
    paths = [p for p, _ in routes_by_file(plan)]
    wanted = {r.tensor: r for r in plan.routes}
    landed = 0

    def land(name: str, tensor: torch.Tensor) -> None:
        nonlocal landed
        route = wanted.get(name)
        if route is not None:  # tensors the plan does not route are read but dropped
            slabs[route.slab][route.slot].copy_(tensor)
            landed += 1

    # Imported before the clock, as asyncslab is: an import is no part of a load.
    if peer.startswith("runai-model-streamer"):
        from runai_model_streamer import SafetensorsStreamer
    elif peer == "fastsafetensors":
        from fastsafetensors import fastsafe_open
    else:
        from fastsafetensors import SafeTensorsFileLoader
    timed = Timed()
    timed.start()
    slabs = {name: torch.empty(s.shape, dtype=s.dtype) for name, s in plan.slabs.items()}
    if peer.startswith("runai-model-streamer"):
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths)
            for name, tensor in streamer.get_tensors():
                land(name, tensor)
    elif peer == "fastsafetensors":
        # nogds: GPUDirect Storage needs a CUDA device; this is the host path.
        with fastsafe_open(filenames=paths, nogds=True, device="cpu") as f:
            for name in wanted:
                land(name, f.get_tensor(name))
    else:
        loader = SafeTensorsFileLoader(None, "cpu", nogds=True, max_threads=n)
        try:
            loader.add_filenames({0: paths})
            buffers = loader.copy_files_to_device()
            try:
                for name in wanted:
                    land(name, buffers.get_tensor(name))
            finally:
                buffers.close()
        finally:
            loader.close()
    timed.stop()
    if landed != len(wanted):
        raise RuntimeError(f"{peer} returned {landed} of the {len(wanted)} routed tensors")
    rec = timed.record()
    rec["verified"] = verify(plan, lambda r: slot_of(slabs, r), task["verify"])
    return rec


# --------------------------------------------------------------------------- entry


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    import asyncslab

    contender: str = task["contender"]
    t = time.perf_counter()
    checkpoint = asyncslab.Checkpoint.open(task["checkpoint"])
    plan = build_plan(checkpoint, task.get("rules", "default"))
    plan_s = time.perf_counter() - t
    n = task.get("threads", 4)
    if contender == "old-path":
        rec = run_old_path(task, checkpoint, plan, mmap=False)
    elif contender == "old-path-mmap":
        rec = run_old_path(task, checkpoint, plan, mmap=True)
    elif contender == "direct-copy":
        rec = run_direct_copy(task, checkpoint, plan)
    elif contender == "asyncslab":
        rec = run_asyncslab(task, checkpoint, plan)
    elif contender == "bound-1":
        rec = run_bound(task, checkpoint, plan, threads=1)
    elif contender == "bound-N":
        rec = run_bound(task, checkpoint, plan, threads=n)
    elif contender == "first-touch-1":
        rec = run_first_touch(task, plan, threads=1)
    elif contender == "first-touch-N":
        rec = run_first_touch(task, plan, threads=n)
    elif contender in PEERS:
        if importlib.util.find_spec(PEERS[contender]) is None:
            return {"skipped": "not installed"}
        rec = run_peer(task, checkpoint, plan, contender)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    rec["plan_s"] = plan_s
    rec["torch_threads"] = torch.get_num_threads()
    rec["bytes"] = plan.nbytes
    rec["tensors"] = len(plan.routes)
    rec["slabs"] = len(plan.slabs)
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m asyncslab.cli._bench.worker TASK_JSON", file=sys.stderr)
        return 2
    task = json.loads(args[0])
    try:
        result = run_task(task)
    except Exception as err:  # reported to the parent, which prints it in the table
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
    result["pid"] = os.getpid()
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

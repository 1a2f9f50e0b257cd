#!/usr/bin/env python3
"""asyncslab on one CUDA device: load bandwidth against measured pinned H2D bandwidth.

Self-contained: ``python -m benchmarks.gpu_bench`` from the repository root (asyncslab need
not be installed). Without a CUDA device it prints ``no CUDA device: skipped`` and exits 0
(it is safe to import anywhere).

What it does, in order (about 2-4 minutes on a 16-core H200 box at the default 20 GiB):

1. generate a synthetic EXL3-like checkpoint of ``--size`` (pattern fill) under ``--dir``
   (reused when a previous run left the same one), then read it once so it sits in the page
   cache: the loads below measure page cache -> pinned staging -> device, not the disk;
2. measure pinned host-to-device bandwidth with a plain copy (a pinned 1 GiB tensor
   ``.to('cuda', non_blocking=True)``, CUDA events, median of ``--reps``);
3. read the same bytes with plain threads into pinned buffers, no device copy (the host
   bound: what page cache and host memory give a staged load), with ``--host-threads``;
   then the pipeline bound, ``--pipeline``: plain threads doing per read what a staged load
   does (read into a pinned buffer of their own, copy it to the device, wait for the copy)
   with no event loop or bookkeeping, one buffer per thread as asyncslab has, and two, so
   that a thread reads into one while the other's copy is in flight;
4. load with asyncslab (``device='cuda'``, default options) ``--runs`` times; with the old
   path (every per-expert tensor moved to the device on its own and kept, then
   ``torch.stack`` per slab on the device) ``--old-runs`` times; then ``--mapped-runs``
   times with ``transfer='mapped'`` (each read's pages registered with CUDA and copied from
   in place: no staging copy) — after the rows known to work, in case registering breaks
   something. Then the optional rows, each skipped once the run is past ``--time-budget``
   seconds: once per ``--streams`` value and per ``--staging`` buffer count, once per
   ``--blocking`` buffer count with copy waits that sleep instead of spinning a core, once
   per ``--mapped-sweep`` threads x window size, then once more with the defaults (drift
   over the run). Before each load, torch's cache of pinned blocks is emptied, so that every
   staged load pins its own buffers, as a server's first load does (the
   ``pinned_cache_emptied`` field says whether this torch could). A row that fails is
   reported (``errors``) and the run goes on;
5. last (a failed registration may leave an error in the CUDA runtime), unless
   ``--no-mapped`` or past the time budget: the mapped DMA bound — every shard mapped
   read-only and registered with CUDA (its page cache pages pinned in place), tensors
   copied straight from the mappings, no host copy at all; it says whether a design without
   staging could pass the host bound, registration included;
6. check a sample of tensors byte for byte against ``safetensors`` ``get_tensor``;
7. print one table, and write the report as JSON to ``--json FILE`` when given.

Targets printed (never asserted), for the defaults and for mapped loads: asyncslab >= 90 %
of the measured pinned H2D bandwidth; peak device memory <= slab bytes + 1 %. Each load's
share of the fastest host bound is printed beside its share of H2D: where the page cache
cannot feed the GPU at 90 % of H2D, no staged load can, and that column says how close
asyncslab comes to what the host allows (a mapped load makes no host copy: it may pass it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncslab._os import loop_name, run
from asyncslab._units import parse_size
from asyncslab.cli._bench.cache import read_all

MiB = 1 << 20
GiB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=20 * GiB, help="checkpoint size (20GiB)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/asyncslab-gpu"), help="where to write")
    p.add_argument("--cleanup", action="store_true", help="delete the checkpoint at the end")
    p.add_argument("--runs", type=int, default=3, help="asyncslab loads with default options")
    p.add_argument("--old-runs", type=int, default=1, help="old-path loads (0: skip)")
    p.add_argument(
        "--mapped-runs",
        type=int,
        default=3,
        help="asyncslab loads with transfer='mapped' (pages registered with CUDA; 0: skip)",
    )
    p.add_argument(
        "--mapped-sweep",
        default="8x128,16x32",
        help="one mapped load per THREADSxWINDOW_MiB, comma-separated ('' to skip)",
    )
    p.add_argument("--streams", default="1,2,4,8", help="streams sweep (comma-separated)")
    p.add_argument(
        "--staging",
        default="16,32",
        help="staging sweep: buffers of 32 MiB (the default ring has 8), comma-separated",
    )
    p.add_argument(
        "--blocking",
        default="8,32",
        help="loads whose copy waits sleep instead of spinning, per buffer count ('' to skip)",
    )
    p.add_argument(
        "--host-threads",
        default="8,16",
        help="host bound: threads reading the staged reads into pinned buffers, no copy",
    )
    p.add_argument(
        "--pipeline",
        default="8x1,8x2,16x1",
        help="pipeline bound: THREADSxBUFFERS per thread, comma-separated ('' to skip)",
    )
    p.add_argument(
        "--no-mapped",
        action="store_true",
        help="skip the mapped DMA bound (shards registered with CUDA, no host copy; run last)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=240.0,
        help="seconds from the start after which the optional rows (sweeps, the last "
        "default load, the mapped DMA bound) are skipped, so that a slow new path cannot "
        "push the run past its time limit (default 240)",
    )
    p.add_argument("--reps", type=int, default=7, help="H2D copy repetitions")
    p.add_argument("--verify", type=int, default=64, help="tensors compared per contender")
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    p.add_argument(
        "--gen-workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="processes writing shards in parallel (default: half the CPUs, at most 8)",
    )
    return p


# --------------------------------------------------------------------------- helpers


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def generate(root: Path, size: int, workers: int) -> tuple[Path, dict[str, Any]]:
    """The bench's own generator (reused when already there), after the bench's own
    disk-space check."""
    from asyncslab.cli._bench.fixtures import check_space as _check_space
    from asyncslab.cli._bench.fixtures import generate as _generate

    problem = _check_space(root, int(size * 1.05))
    if problem:
        raise SystemExit(f"gpu_bench: {problem}")
    return _generate(root, size, workers)


def h2d_bandwidth(torch: Any, device: str, reps: int) -> dict[str, Any]:
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    times = []
    for i in range(reps + 1):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst = src.to(device, non_blocking=True)
        end.record()
        end.synchronize()
        if i:  # the first copy pays for allocation and warm-up
            times.append(start.elapsed_time(end) / 1e3)
        del dst
    del src
    torch.cuda.empty_cache()
    median = statistics.median(times)
    return {"seconds": times, "median_s": median, "gbps": GiB / median / 1e9}


def host_bound(torch: Any, plan: Any, threads: int, read_bytes: int) -> dict[str, Any]:
    """The staged path without the device: asyncslab's staged reads (its schedule at the
    ring's buffer size, read by its own ``read_staged``) by ``threads`` threads, each into a
    pinned buffer of its own. What page cache and host memory give a staged load, whatever
    the GPU can take."""
    from asyncslab.cli._bench.worker import run_in_threads
    from asyncslab.loading._copy import read_staged
    from asyncslab.loading._schedule import schedule

    ops = schedule(plan, max_read=read_bytes, gap=64 << 10).ops
    buffers = [torch.empty(read_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
    for b in buffers:
        b.fill_(1)
    fds = [os.open(str(f.path), os.O_RDONLY) for f in plan.files]
    try:
        seconds = run_in_threads(
            ops, threads, lambda i, op: read_staged(fds[op.file], op, buffers[i], "bound")
        )
    finally:
        for fd in fds:
            os.close(fd)
    nbytes = sum(op.nbytes for op in ops)
    return {"threads": threads, "seconds": seconds, "bytes": nbytes, "reads": len(ops)}


class _DeviceSlabs:
    """One device allocation laid out as asyncslab lays out its slabs, for the bounds that
    copy into the device without asyncslab: ``route_base[route]`` is where a route's slab
    starts in ``backing``."""

    def __init__(self, torch: Any, plan: Any, device: str) -> None:
        from asyncslab.loading import slab_layout

        self.base, total, _ = slab_layout(plan, torch.device(device))
        self.backing = torch.empty(max(1, total), dtype=torch.uint8, device=device)
        self.route_base = [self.base[r.slab] for r in plan.routes]
        self.route_bytes = [self.backing] * len(plan.routes)

    def slot_bytes(self, route: Any) -> Any:
        start = self.base[route.slab] + route.dst_offset
        return self.backing[start : start + route.nbytes]


def pipeline_bound(
    torch: Any, plan: Any, device: str, threads: int, depth: int, read_bytes: int, k: int
) -> dict[str, Any]:
    """What a staged load does per read, by plain threads: asyncslab's staged reads (its
    schedule, ``read_staged``, one list copy per read, its default 4 streams shared by the
    threads) into one device allocation laid out as its slabs, each thread with ``depth``
    pinned buffers of its own. At depth 1 a thread waits for its copy before its next read,
    as asyncslab's threads do; at depth 2 it reads into its other buffer meanwhile and waits
    for a copy only before reusing that buffer. Timed until the last copy completed."""
    from asyncslab.cli._bench.worker import run_in_threads
    from asyncslab.loading._copy import _copy_pieces, read_staged
    from asyncslab.loading._schedule import schedule

    ops = schedule(plan, max_read=read_bytes, gap=64 << 10).ops
    slabs = _DeviceSlabs(torch, plan, device)
    streams = [torch.cuda.Stream(device=device) for _ in range(4)]
    buffers = [
        [torch.empty(read_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        for _ in range(threads)
    ]
    pending: list[list[Any]] = [[None] * depth for _ in range(threads)]
    turn = [0] * threads
    fds = [os.open(str(f.path), os.O_RDONLY) for f in plan.files]

    def one_read(i: int, op: Any) -> None:
        slot = turn[i]
        turn[i] = (slot + 1) % depth
        if pending[i][slot] is not None:
            pending[i][slot].synchronize()  # this buffer's last copy, before overwriting it
        buffer = buffers[i][slot]
        read_staged(fds[op.file], op, buffer, "pipeline")
        stream = streams[i % len(streams)]
        with torch.cuda.device(device), torch.cuda.stream(stream):
            _copy_pieces(op, buffer, slabs.route_bytes, slabs.route_base, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        pending[i][slot] = event

    torch.cuda.synchronize(device)
    try:
        t = time.perf_counter()
        run_in_threads(ops, threads, one_read)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
    finally:
        for fd in fds:
            os.close(fd)

    return {
        "threads": threads,
        "depth": depth,
        "seconds": seconds,
        "gbps": plan.nbytes / seconds / 1e9,
        "verified": verify(plan, slabs.slot_bytes, k),
    }


#: cudaHostRegisterReadOnly: the device only reads the registered pages (CUDA 11.1+, where
#: the device attribute HostRegisterReadOnlySupported is 1).
_REGISTER_READ_ONLY = 8


def mapped_dma_bound(torch: Any, plan: Any, device: str, k: int) -> dict[str, Any]:
    """No host copy at all: each shard mapped read-only (``mmap``, shared) and registered
    with CUDA read-only, which pins the page cache's own pages; then every tensor is copied
    from the mapping straight into a device allocation laid out as asyncslab's slabs (its
    schedule at 32 MiB, one list copy per read, 4 streams, enqueued by one thread). The
    staged design copies each byte into a pinned buffer first, which the host bound shows
    capping it below the GPU's bandwidth; this measures whether skipping that copy could
    pass it, registration included. Returns ``{"error": ...}`` where registration fails
    (read-only registration unsupported: the staged design is all there is)."""
    import ctypes
    import mmap

    from asyncslab._os import MAP_FAILED, libc_mmap
    from asyncslab.loading._copy import _copy_pieces
    from asyncslab.loading._schedule import schedule

    libc = libc_mmap()
    cudart = torch.cuda.cudart()
    ops = schedule(plan, max_read=32 << 20, gap=64 << 10).ops
    slabs = _DeviceSlabs(torch, plan, device)
    streams = [torch.cuda.Stream(device=device) for _ in range(4)]
    maps: list[tuple[int, int]] = []
    registered: list[int] = []
    out: dict[str, Any] = {}
    try:
        for f in plan.files:
            fd = os.open(str(f.path), os.O_RDONLY)
            try:
                address = libc.mmap(None, f.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)  # the mapping keeps the file
            if address is None or address == MAP_FAILED:
                return {"error": f"mmap failed: {os.strerror(ctypes.get_errno())}"}
            maps.append((address, f.size))
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for address, size in maps:
            code = int(cudart.cudaHostRegister(address, size, _REGISTER_READ_ONLY))
            if code != 0:
                return {"error": f"cudaHostRegister(read-only) returned CUDA error {code}"}
            registered.append(address)
        out["register_s"] = time.perf_counter() - t
        sources = [
            torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8)
            for address, size in maps
        ]
        t_copy = time.perf_counter()
        with torch.cuda.device(device):
            for i, op in enumerate(ops):
                with torch.cuda.stream(streams[i % len(streams)]):
                    view = sources[op.file][op.offset : op.offset + op.nbytes]
                    _copy_pieces(op, view, slabs.route_bytes, slabs.route_base, non_blocking=True)
        torch.cuda.synchronize(device)
        end = time.perf_counter()
        out.update(copy_s=end - t_copy, seconds=end - t, gbps=plan.nbytes / (end - t) / 1e9)
        out["verified"] = verify(plan, slabs.slot_bytes, k)
        t = time.perf_counter()
        for address in registered:
            cudart.cudaHostUnregister(address)
        out["unregister_s"] = time.perf_counter() - t
        registered.clear()
        return out
    finally:
        for address in registered:
            cudart.cudaHostUnregister(address)
        for address, size in maps:
            libc.munmap(address, size)


def sample_routes(plan: Any, k: int) -> list[Any]:
    routes = plan.routes
    step = max(1, len(routes) // max(1, k))
    return list(routes[::step])[:k]


def verify(plan: Any, get: Any, k: int) -> int:
    """``k`` sampled routes' bytes (``get(route)``) against what safetensors reads."""
    from asyncslab.testing import verify_slabs

    result = verify_slabs(plan, get, routes=sample_routes(plan, k))
    if not result.ok:
        raise AssertionError(f"device bytes differ from safetensors: {result.describe()}")
    return result.tensors


def empty_pinned_cache(torch: Any) -> bool:
    """Unpin the blocks torch's pinned-memory allocator keeps for reuse; False where this
    torch has no way to. The bounds pin their buffers before asyncslab loads: without this,
    each staged load would reuse their pinned blocks and never pay for pinning its own, as
    a server's first load does."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            try:
                empty()
            except Exception:  # noqa: BLE001 - a torch without an accelerator, say: the load
                continue  # still runs, and its row says its cache was not emptied
            return True
    return False


@contextlib.contextmanager
def blocking_events(torch: Any, on: bool) -> Iterator[None]:
    """With ``on``, the CUDA events asyncslab's copier waits on sleep until the copy ends
    (``cudaEventBlockingSync``) instead of spinning a core: the I/O threads then leave the
    CPU to the others' reads."""
    if not on:
        yield
        return
    real = torch.cuda.Event
    torch.cuda.Event = functools.partial(real, blocking=True)
    try:
        yield
    finally:
        torch.cuda.Event = real


def device_memory(torch: Any, device: str) -> dict[str, int]:
    return {
        "peak": torch.cuda.max_memory_allocated(device),
        "final": torch.cuda.memory_allocated(device),
        "reserved_peak": torch.cuda.max_memory_reserved(device),
    }


# --------------------------------------------------------------------------- contenders


def load_asyncslab(
    torch: Any,
    ckpt: Any,
    plan: Any,
    device: str,
    streams: int | None,
    k: int,
    buffers: int | None = None,
    transfer: str = "auto",
    buffer_bytes: int | None = None,
    blocking: bool = False,
) -> dict[str, Any]:
    import asyncslab

    options = asyncslab.LoadOptions(transfer=transfer)
    if streams is not None:
        options = dataclasses.replace(options, streams=streams)
    if buffers is not None or buffer_bytes is not None:
        # ``buffers`` threads with a buffer (a mapped read's window) of ``buffer_bytes``
        # each; the defaults for whichever is not given.
        size = buffer_bytes or options.staging_bytes // options.staging_buffers
        count = buffers or options.staging_buffers
        options = dataclasses.replace(options, staging_buffers=count, staging_bytes=count * size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"pinned_cache_emptied": empty_pinned_cache(torch)}
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)

    async def main() -> None:
        t = time.perf_counter()
        with blocking_events(torch, blocking):
            slabs = await asyncslab.load(ckpt, plan, device=device, options=options)
        torch.cuda.synchronize(device)
        out["seconds"] = time.perf_counter() - t
        mem = device_memory(torch, device)
        out["peak_bytes"] = mem["peak"] - base
        out["final_bytes"] = mem["final"] - base
        stats = slabs.statistics()
        out["staging_budget"] = stats.staging_budget
        out["staging_peak"] = stats.staging_peak
        out["reads"] = stats.reads
        out["verified"] = verify(plan, lambda r: slabs.view(r.tensor), k)
        await slabs.aclose()

    run(main())
    out["loop"] = loop_name()
    out["streams"] = options.streams
    out["buffers"] = options.staging_buffers  # = its I/O threads
    out["transfer"] = transfer
    out["blocking_events"] = blocking
    torch.cuda.empty_cache()
    return out


def load_old_path(torch: Any, ckpt: Any, plan: Any, device: str, k: int) -> dict[str, Any]:
    """Every per-expert tensor moved to the device on its own and kept, then stacked per
    slab (in slot order) on the device, then the per-expert tensors dropped."""
    from collections import defaultdict

    from safetensors import safe_open

    by_slab: dict[str, list[Any]] = defaultdict(list)
    by_file: dict[str, list[Any]] = defaultdict(list)
    for r in plan.routes:
        by_slab[r.slab].append(r)
        by_file[str(r.file)].append(r)
    for routes in by_slab.values():
        routes.sort(key=lambda r: r.dst_offset)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t = time.perf_counter()
    per: dict[str, Any] = {}
    for path, routes in by_file.items():
        with safe_open(path, framework="pt") as f:
            for r in routes:
                per[r.tensor] = f.get_tensor(r.tensor).to(device)
    slabs: dict[str, Any] = {}
    for name, spec in plan.slabs.items():
        routes = by_slab[name]
        if not spec.slot_dims:
            slabs[name] = per[routes[0].tensor]
        else:
            slabs[name] = torch.stack([per[r.tensor] for r in routes]).view(spec.shape)
    per.clear()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t
    mem = device_memory(torch, device)
    out = {
        "seconds": seconds,
        "peak_bytes": mem["peak"] - base,
        "final_bytes": mem["final"] - base,
        "verified": verify(plan, lambda r: slabs[r.slab][r.slot], k),
    }
    slabs.clear()
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("no CUDA device: skipped (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0

    import asyncslab

    device = args.device
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "size": args.size,
    }
    t_all = time.perf_counter()
    args.dir.mkdir(parents=True, exist_ok=True)
    _log(f"generating {args.size / GiB:.1f} GiB under {args.dir} ...")
    root, gen = generate(args.dir, args.size, args.gen_workers)
    report["generation"] = gen
    _log(f"generation: {gen}")
    ckpt = asyncslab.Checkpoint.open(root)
    t = time.perf_counter()
    plan = asyncslab.plan(ckpt)
    report["plan_s"] = time.perf_counter() - t
    slab_bytes = plan.nbytes
    report["slab_bytes"] = slab_bytes
    report["tensors"] = len(plan.routes)
    n, s = read_all([Path(f.path) for f in ckpt.files])
    report["page_cache_read"] = {"bytes": n, "seconds": s, "gbps": n / s / 1e9}
    _log(f"page cache warm: {n / s / 1e9:.2f} GB/s")

    h2d = h2d_bandwidth(torch, device, args.reps)
    report["h2d"] = h2d
    _log(f"pinned H2D: {h2d['gbps']:.2f} GB/s")

    errors: list[dict[str, str]] = []
    skipped: list[str] = []
    rows: list[dict[str, Any]] = []

    def save_partial() -> None:
        if args.json is not None:
            # Rewritten after every row: a run that dies later (a CUDA context broken by a
            # new path, the command's time limit) keeps what it measured.
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = {**report, "rows": rows, "partial": True}
            args.json.write_text(json.dumps(partial, indent=1, default=str))

    def attempt(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``fn()``, or None once it failed: the error is reported and the run goes on, so
        that one failing row (a path never run on this machine) leaves the others."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - reported, the rest of the report stands
            errors.append({"name": name, "error": f"{type(err).__name__}: {err}"})
            report["errors"] = errors
            _log(f"{name} failed: {errors[-1]['error']}")
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
            save_partial()
            return None

    def in_time(name: str) -> bool:
        """Whether an optional row still fits the time budget; the ones that do not are
        listed in the report."""
        if time.perf_counter() - t_all <= args.time_budget:
            return True
        skipped.append(name)
        report["skipped_for_time"] = skipped
        _log(f"{name} skipped: past --time-budget {args.time_budget:.0f} s")
        return False

    read_bytes = asyncslab.LoadOptions().staging_bytes // asyncslab.LoadOptions().staging_buffers
    bounds = []
    for n in [int(x) for x in args.host_threads.split(",") if x.strip()]:
        b = attempt(f"host bound {n}", lambda n=n: host_bound(torch, plan, n, read_bytes))
        if b is None:
            continue
        b["gbps"] = b["bytes"] / b["seconds"] / 1e9
        bounds.append(b)
        _log(
            f"host bound, {n} threads into pinned buffers: {b['seconds']:.3f} s, "
            f"{b['gbps']:.2f} GB/s"
        )
    report["host_bound"] = bounds
    # The fastest host bound is the ceiling of any staged load here, whatever H2D allows.
    best_bound = max((b["gbps"] for b in bounds), default=None)
    pipelines = []
    for spec in [x for x in args.pipeline.split(",") if x.strip()]:
        threads, depth = (int(v) for v in spec.lower().split("x"))
        pb = attempt(
            f"pipeline bound {spec}",
            lambda t=threads, d=depth: pipeline_bound(
                torch, plan, device, t, d, read_bytes, args.verify
            ),
        )
        torch.cuda.empty_cache()  # its device allocation, before the loads measure theirs
        if pb is None:
            continue
        pipelines.append(pb)
        _log(
            f"pipeline bound, {threads} threads x {depth} buffers: {pb['seconds']:.3f} s, "
            f"{pb['gbps']:.2f} GB/s"
        )
    report["pipeline_bound"] = pipelines

    def record(name: str, rec: dict[str, Any]) -> None:
        rec["name"] = name
        rec["gbps"] = slab_bytes / rec["seconds"] / 1e9
        rec["of_h2d"] = rec["gbps"] / h2d["gbps"]
        rec["of_bound"] = rec["gbps"] / best_bound if best_bound else None
        # Against plain threads doing the same per-read work with as many threads: what
        # asyncslab's event loop, feed and landing cost.
        pipe = next(
            (
                pb["gbps"]
                for pb in pipelines
                if pb["depth"] == 1
                and pb["threads"] == rec.get("buffers")
                and rec.get("transfer") != "mapped"  # no staging: not what the pipeline does
            ),
            None,
        )
        rec["of_pipeline"] = rec["gbps"] / pipe if pipe else None
        rows.append(rec)
        _log(
            f"{name}: {rec['seconds']:.3f} s, {rec['gbps']:.2f} GB/s "
            f"({rec['of_h2d'] * 100:.0f} % of H2D), peak +{rec['peak_bytes'] / GiB:.2f} GiB"
        )
        save_partial()

    def row(name: str, streams: int | None = None, **kw: Any) -> bool:
        """One asyncslab load, recorded as ``name``; False if it failed (reported)."""
        rec = attempt(
            name, lambda: load_asyncslab(torch, ckpt, plan, device, streams, args.verify, **kw)
        )
        if rec is not None:
            record(name, rec)
        return rec is not None

    # The rows that answer the goal come first; the sweeps after them are skipped once the
    # run is past its time budget. The mapped loads, never run on a GPU yet, come after the
    # defaults and the old path, which are known to work: if registering pages breaks
    # something, what is known is measured already.
    for i in range(args.runs):
        row(f"asyncslab (default) #{i + 1}")
    for i in range(args.old_runs):
        free, _ = torch.cuda.mem_get_info(device)
        if free < 2.2 * slab_bytes:
            _log(f"old path skipped: needs ~{2 * slab_bytes / GiB:.1f} GiB of device memory")
            break
        name = f"old-path #{i + 1}"
        rec = attempt(name, lambda: load_old_path(torch, ckpt, plan, device, args.verify))
        if rec is not None:
            record(name, rec)
    # Mapped: each read's pages registered with CUDA and copied from in place, no host copy.
    # After a failed one (read-only registration unsupported, say) the others would fail
    # alike: they are not tried.
    ok = all(row(f"asyncslab mapped #{i + 1}", transfer="mapped") for i in range(args.mapped_runs))
    for streams in [int(x) for x in args.streams.split(",") if x.strip()]:
        if in_time(name := f"asyncslab streams={streams}"):
            row(name, streams=streams)
    for n in [int(x) for x in args.staging.split(",") if x.strip()]:
        if in_time(name := f"asyncslab {n} buffers"):
            row(name, buffers=n)
    # Waiting for each copy with a sleeping event rather than a spinning one: with more
    # I/O threads than free cores, spinning takes CPU from the reads.
    for n in [int(x) for x in args.blocking.split(",") if x.strip()]:
        if in_time(name := f"asyncslab {n} buffers, blocking events"):
            row(name, buffers=n, blocking=True)
    # Window size and threads: registering costs per call and per page, so the window sets
    # how often the fixed part is paid, the threads how many registrations overlap copies.
    for spec in [x for x in args.mapped_sweep.split(",") if x.strip()]:
        if not ok or args.mapped_runs == 0:
            break
        threads, mib = (int(v) for v in spec.lower().split("x"))
        if in_time(name := f"asyncslab mapped {threads}x{mib} MiB"):
            ok = row(name, transfer="mapped", buffers=threads, buffer_bytes=mib * MiB)
    # The defaults once more: drift over the run, told apart from what the sweeps changed.
    if in_time(name := "asyncslab default, at the end"):
        row(name)

    report["rows"] = rows
    # Last: a failed registration may leave an error behind in the CUDA runtime.
    dma: dict[str, Any] | None = None
    if not args.no_mapped and in_time("mapped DMA bound"):
        try:
            dma = mapped_dma_bound(torch, plan, device, args.verify)
        except Exception as err:  # noqa: BLE001 - reported, the rest of the report stands
            dma = {"error": f"{type(err).__name__}: {err}"}
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        _log(f"mapped DMA bound: {dma}")
        report["mapped_dma"] = dma
    default = [r for r in rows if r["name"].startswith("asyncslab (default)")]
    med_s = statistics.median(r["seconds"] for r in default) if default else None
    targets = []
    for label, prefix in (("default", "asyncslab (default)"), ("mapped", "asyncslab mapped #")):
        group = [r for r in rows if r["name"].startswith(prefix)]
        if not group:
            continue
        gbps = slab_bytes / statistics.median(r["seconds"] for r in group) / 1e9
        worst_peak = max(r["peak_bytes"] for r in group)
        targets.append(
            {
                "target": f"asyncslab ({label}, median) >= 90 % of pinned H2D",
                "measured": gbps / h2d["gbps"],
                "ok": gbps >= 0.9 * h2d["gbps"],
            }
        )
        targets.append(
            {
                "target": f"asyncslab ({label}) peak device memory <= slab bytes + 1 %",
                "measured": worst_peak / slab_bytes,
                "ok": worst_peak <= slab_bytes * 1.01,
            }
        )
    report["targets"] = targets
    if med_s and best_bound:
        report["default_of_host_bound"] = slab_bytes / med_s / 1e9 / best_bound
    # asyncslab's threads do per read what the depth-1 pipeline does with its default
    # thread count: the ratio is the cost of everything else (event loop, feed, landing).
    default_threads = asyncslab.LoadOptions().staging_buffers
    same = [pb for pb in pipelines if pb["threads"] == default_threads]
    if med_s and same:
        report["default_of_pipeline"] = {
            f"{pb['threads']}x{pb['depth']}": slab_bytes / med_s / 1e9 / pb["gbps"] for pb in same
        }
    report["total_s"] = time.perf_counter() - t_all

    lines = [
        f"gpu_bench: {report['device']}, torch {report['torch']}, {report['cpus']} CPUs; "
        f"checkpoint {args.size / GiB:.1f} GiB ({len(ckpt.files)} files), slabs "
        f"{slab_bytes / GiB:.2f} GiB, {len(plan.routes)} tensors; generation "
        + ("reused" if gen["reused"] else f"{gen['seconds']:.1f} s ({gen['gbps']:.2f} GB/s)"),
        f"pinned H2D (1 GiB, median of {args.reps}): {h2d['gbps']:.2f} GB/s; page cache read "
        f"{report['page_cache_read']['gbps']:.2f} GB/s; host bound (reads into pinned "
        f"buffers, no copy): "
        + ", ".join(f"{b['threads']} threads {b['gbps']:.2f} GB/s" for b in bounds),
        "pipeline bound (plain threads: read, copy, wait; threads x buffers each): "
        + (
            ", ".join(
                f"{pb['threads']}x{pb['depth']} {pb['seconds']:.3f} s {pb['gbps']:.2f} GB/s "
                f"({pb['gbps'] / h2d['gbps'] * 100:.0f} % of H2D, {pb['verified']} verified)"
                for pb in pipelines
            )
            or "skipped"
        ),
        "mapped DMA bound (shards registered read-only with CUDA, copied with no host copy): "
        + (
            "skipped"
            if dma is None
            else dma["error"]
            if "error" in dma
            else f"{dma['seconds']:.3f} s {dma['gbps']:.2f} GB/s "
            f"({dma['gbps'] / h2d['gbps'] * 100:.0f} % of H2D; registering "
            f"{dma['register_s']:.3f} s, copies {dma['copy_s']:.3f} s, "
            f"{dma['verified']} verified)"
        ),
        "",
        f"{'contender':<38}{'s':>8}{'GB/s':>8}{'of H2D':>8}{'of bound':>10}{'of pipe':>9}"
        f"{'peak GiB':>10}{'final GiB':>11}{'peak/slabs':>12}{'verified':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r['name']:<38}{r['seconds']:>8.3f}{r['gbps']:>8.2f}{r['of_h2d'] * 100:>7.0f}%"
            + (f"{r['of_bound'] * 100:>9.0f}%" if r["of_bound"] else f"{'-':>10}")
            + (f"{r['of_pipeline'] * 100:>8.0f}%" if r["of_pipeline"] else f"{'-':>9}")
            + f"{r['peak_bytes'] / GiB:>10.2f}{r['final_bytes'] / GiB:>11.2f}"
            f"{r['peak_bytes'] / slab_bytes:>12.3f}{r['verified']:>10}"
        )
    lines.append("")
    for err in errors:
        lines.append(f"FAILED  {err['name']}: {err['error']}")
    if skipped:
        lines.append(f"skipped (past --time-budget {args.time_budget:.0f} s): {', '.join(skipped)}")
    for tgt in targets:
        lines.append(f"{'PASS' if tgt['ok'] else 'MISS'}  {tgt['target']}: {tgt['measured']:.3f}")
    if "default_of_host_bound" in report:
        lines.append(
            f"info  asyncslab (default, median) / fastest host bound: "
            f"{report['default_of_host_bound']:.3f} (no staged load here can pass that bound)"
        )
    for name, ratio in report.get("default_of_pipeline", {}).items():
        lines.append(
            f"info  asyncslab (default, median) / pipeline bound {name}: {ratio:.3f}"
            + (
                " (what asyncslab's machinery costs)"
                if name.endswith("x1")
                else " (what reading during the copy could give)"
            )
        )
    lines.append(f"total {report['total_s']:.0f} s")
    print("\n".join(lines), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if args.cleanup:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

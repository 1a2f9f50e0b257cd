"""Leak soak: many load/cancel cycles, then threads, fds, RSS and torch allocations compared.

Each cycle starts a load of a small synthetic checkpoint (~300 KB, three shards, small reads
paced at 0.2 ms so a load takes ~10 ms and has ~60 reads), cancels it at a seeded random
point — before its task ran, during thread start-up, after the k-th tensor landed, after a
random delay, twice (the second cancel landing during the drain), through ``aclose()``, or
through ``asyncio.timeout`` — then checks that no read is still in a thread, and runs a full
load that must be bit-exact. The cancel modes are those of ``support/faults.py``.

Measured before (after a warm-up of ``--warmup`` cycles, so one-time costs such as malloc
arenas of the first I/O threads are paid) and after: live threads (all, and
``asyncslab-io*``), open fds (``/proc/self/fd``), ``VmRSS``, and torch CPU allocations (live
``torch.Tensor`` objects found by the garbage collector, and the bytes of their distinct
storages; torch has no CPU allocator counter). Pinned (page-locked) memory is not used by a
CPU load: N/A here; the CUDA staging buffers are the only user of pinned memory.

    python -m benchmarks.leak_soak                     # 1,000 cycles on asyncio and uvloop
    python -m benchmarks.leak_soak --cycles 200 --loop asyncio
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import asyncslab
import asyncslab.testing
from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab._os import proc_status
from asyncslab.loading import _read as read_module
from asyncslab.testing import SyntheticSpec

OPTIONS = LoadOptions(read_size=4 << 10, coalesce_gap=128, io_workers=3, read_timeout=10.0)


class PacedOs:
    """``os`` as ``asyncslab.loading._read`` sees it, with each ``preadv`` paced and counted."""

    def __init__(self, pace: float) -> None:
        self.pace = pace
        self.lock = threading.Lock()
        self.in_flight = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with self.lock:
            self.in_flight += 1
            self.calls += 1
        try:
            time.sleep(self.pace)
            return os.preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.in_flight -= 1


def rss_kib() -> int:
    return proc_status()["VmRSS"] // 1024


def torch_cpu_allocations() -> tuple[int, int]:
    """(live tensors, bytes of their distinct storages), CPU only."""
    gc.collect()
    tensors = 0
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch module attributes
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.device.type == "cpu":
            tensors += 1
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return tensors, sum(storages.values())


def snapshot() -> dict[str, int]:
    gc.collect()
    tensors, nbytes = torch_cpu_allocations()
    return {
        "threads": threading.active_count(),
        "asyncslab-io threads": sum(
            t.name.startswith("asyncslab-io") for t in threading.enumerate()
        ),
        "open fds": len(os.listdir("/proc/self/fd")),
        "VmRSS KiB": rss_kib(),
        "torch CPU tensors": tensors,
        "torch CPU storage bytes": nbytes,
    }


async def settle_threads(limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and any(  # noqa: ASYNC110 - polling threads
        t.name.startswith("asyncslab-io") for t in threading.enumerate()
    ):
        await asyncio.sleep(0.002)


async def soak(
    root: Path, cycles: int, warmup: int, seed: int, pace: float, path: str = "direct"
) -> dict[str, Any]:
    from support import faults

    ckpt = Checkpoint.open(root)
    p = plan(ckpt)
    expected = faults.expected_bytes(ckpt)
    fake = PacedOs(pace)
    saved = read_module.os, read_module._preadv_raw
    read_module.os = fake  # type: ignore[assignment]
    # Loads read through libc's preadv; its os.preadv twin goes through the pacing.
    read_module._preadv_raw = read_module._preadv_via_os
    rng = random.Random(seed)
    slabs = SlabSet(p)
    states: dict[str, int] = {}
    trend: list[tuple[int, int]] = []
    problems: list[str] = []
    before: dict[str, int] = {}
    started = time.perf_counter()
    try:
        for cycle in range(warmup + cycles):
            if cycle == warmup:
                await settle_threads()
                before = snapshot()
                trend.append((0, before["VmRSS KiB"]))
                started = time.perf_counter()
            mode = faults.CANCEL_MODES[cycle % len(faults.CANCEL_MODES)]
            await faults.cancel_somewhere(slabs, ckpt, rng, mode, faults.PATHS[path])
            if fake.in_flight:
                problems.append(f"cycle {cycle} ({mode}): {fake.in_flight} reads still in flight")
            if mode == "aclose":
                slabs = SlabSet(p)
                state = "closed"
            else:
                state = slabs.statistics().state
                if cycle >= warmup and 0 < slabs.statistics().tensors_landed < len(p.routes):
                    states["(mid-load)"] = states.get("(mid-load)", 0) + 1
            if cycle >= warmup:
                states[state] = states.get(state, 0) + 1
            if state not in ("cancelled", "complete", "closed"):
                problems.append(f"cycle {cycle} ({mode}): state {state}")
                break
            await slabs.load(ckpt, options=OPTIONS)
            for r in p.routes:
                got = slabs.view(r.tensor).contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(got, expected[r.tensor]):
                    problems.append(f"cycle {cycle}: {r.tensor} differs after reload")
                    break
            done = cycle - warmup + 1
            if done > 0 and done % max(1, cycles // 10) == 0:
                gc.collect()
                trend.append((done, rss_kib()))
        elapsed = time.perf_counter() - started
        await settle_threads()
        after = snapshot()  # like `before`: one loaded SlabSet alive
        await slabs.aclose()
    finally:
        read_module.os, read_module._preadv_raw = saved  # type: ignore[assignment]
    return {
        "before": before,
        "after": after,
        "states": states,
        "trend": trend,
        "problems": problems,
        "elapsed": elapsed,
        "reads": fake.calls,
    }


def run(loop_name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    if loop_name == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(soak(root, args.cycles, args.warmup, args.seed, args.pace, args.path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--pace", type=float, default=0.0002, help="seconds per preadv")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    parser.add_argument(
        "--path",
        choices=["direct", "staged"],
        default="direct",
        help="reads straight into the slabs, or through staging buffers (the CUDA path, on CPU)",
    )
    parser.add_argument("--rss-noise-mib", type=float, default=16.0)
    args = parser.parse_args()
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    spec = SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32, vocab=128)
    failed = False
    with tempfile.TemporaryDirectory() as d:
        written = asyncslab.testing.write_synthetic(d, spec)
        print(
            f"asyncslab leak soak: {args.cycles} cancel+reload cycles per loop after "
            f"{args.warmup} warm-up cycles; checkpoint {written.total_bytes} B in "
            f"{len(written.files)} files, {written.n_tensors} tensors; read_size 4 KiB, "
            f"preadv paced {args.pace * 1e3:.1f} ms; torch {torch.__version__}, "
            f"Python {sys.version.split()[0]}"
        )
        for loop_name in loops:
            result = run(loop_name, Path(written.root), args)
            before, after = result["before"], result["after"]
            print(
                f"\n[{loop_name}] {args.cycles} cycles in {result['elapsed']:.1f} s, "
                f"{result['reads']} reads; outcomes of the cancelled loads: "
                + ", ".join(f"{k} {v}" for k, v in sorted(result["states"].items()) if k[0] != "(")
                + f" (cancelled with some tensors landed: {result['states'].get('(mid-load)', 0)})"
            )
            print("| measure | before | after | change |")
            print("| --- | ---: | ---: | ---: |")
            for key in before:
                print(f"| {key} | {before[key]} | {after[key]} | {after[key] - before[key]:+d} |")
            print("| pinned memory | N/A (CPU load) | N/A | - |")
            trend = ", ".join(f"{n}: {kib / 1024:.1f}" for n, kib in result["trend"])
            print(f"VmRSS MiB by cycle: {trend}")
            growth = (after["VmRSS KiB"] - before["VmRSS KiB"]) / 1024
            exact = (
                "threads",
                "asyncslab-io threads",
                "open fds",
                "torch CPU tensors",
                "torch CPU storage bytes",
            )
            leaks = [k for k in exact if after[k] > before[k]]
            if growth > args.rss_noise_mib:
                leaks.append(f"VmRSS +{growth:.1f} MiB > {args.rss_noise_mib} MiB noise")
            for problem in result["problems"][:10]:
                print("PROBLEM:", problem)
            verdict = "FAIL: " + "; ".join(leaks) if leaks or result["problems"] else "ok"
            print(f"verdict: {verdict}")
            failed |= verdict != "ok"
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

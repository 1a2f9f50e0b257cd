"""What each stage costs per tensor, from about a thousand to about 300,000 tensors.

    python -m benchmarks.scale_bench [--counts 1128,2256,...,288780] [--rounds 3]
        [--stages library] [--dir DIR] [--json FILE] [--plot FILE.png]

For each tensor count it writes (once, under --dir) an EXL3-like synthetic checkpoint of
tiny tensors (``write_synthetic``: 256 experts per MoE layer, three dense layers first,
hidden 16, so the payload stays a few MB while the headers hold every name), then times
each stage --rounds times and keeps the median:

- ``bare_parse``: each file opened, its 8-byte length and header read, ``json.loads``d;
  the floor any reader of the headers pays (the collector as Python leaves it, and, as
  ``bare_parse_nogc``, paused);
- ``open``: ``Checkpoint.open``; ``plan``: ``asyncslab.plan`` with the checkpoint's tier map;
- ``schedule``: the reads of a load (``LoadOptions`` defaults); ``tracker``: a load's
  completeness tracker made and every route landed in it; ``load``: a whole
  ``SlabSet.load`` on the CPU (reads, copies, tracker); ``binding``: every slab's tensor
  handed out, as an engine binds them to its parameters.

It prints microseconds per tensor for each stage and count, each stage's fitted cost
(least squares: seconds = fixed + slope x tensors), the ratio of time per tensor between
each count and its half (linear cost: at most 1.05, i.e. 2x tensors in at most 2.1x time),
and the library's targets: open + plan within 1.3x of the bare parse, open + plan +
schedule at most 3.5 us per tensor, and at most 256 bytes of memory per tensor for open +
plan (RSS growth and Python's retained allocations, each count in a fresh process).

The same in vLLM against ``auto`` (recording vLLM's loaders, planning, reads; 747 to 37,035
tensors of Mixtral-likes, which vLLM can load where it cannot load EXL3) is
``benchmarks/vllm_scale.py``.

More stages plug in as one function each (see ``STAGES``): it takes a :class:`Case` (the
count, the checkpoint's directory and tier map) and returns ``{stage: seconds}``; run them
with ``--stages library,<name>``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab.loading._schedule import schedule
from asyncslab.loading._tracker import Tracker
from asyncslab.testing import SyntheticSpec, write_synthetic

#: 288,780 tensors (78 layers, 256 experts, 32 shards), then halves of it.
DEFAULT_COUNTS = [288_780 >> k for k in range(8, -1, -1)]
TARGET_US = 3.5
TARGET_BARE = 1.3
TARGET_BYTES = 256
TARGET_LINEAR = 1.05  # time per tensor at 2x tensors over that at 1x: 2.1x time at most


@dataclass(frozen=True)
class Case:
    """One checkpoint of the series."""

    tensors: int
    root: Path
    tier_map: Path
    spec: SyntheticSpec


StageFn = Callable[[Case], dict[str, float]]


def spec_for_count(count: int) -> SyntheticSpec:
    """An EXL3-like spec of about ``count`` tensors: three dense layers, then as few MoE
    layers of at most 256 experts as hold them (the 288,780-tensor one is 78 layers of 256
    experts, 32 shards)."""
    first_dense = 3
    # 3 + 6 per layer + 3 per dense layer; a MoE layer adds its gate, shared experts and
    # 15 tensors per expert (3 projections x trellis, suh, svh, mcg, mul1).
    fixed, per_layer, per_expert = 30, 10, 15
    n_moe = max(1, -(-(count - fixed) // (per_layer + per_expert * 256)))
    n_experts = min(256, max(4, round(((count - fixed) / n_moe - per_layer) / per_expert)))
    return SyntheticSpec(
        n_layers=first_dense + n_moe,
        first_dense=first_dense,
        n_experts=n_experts,
        hidden=16,
        intermediate=16,
        vocab=16,
        n_shards=max(1, min(32, round(32 * count / 288_780))),
        fill="pattern",
    )


def prepare(count: int, directory: Path) -> Case:
    spec = spec_for_count(count)
    root = directory / f"exl3-{count}"
    marker = root / "written.json"
    if not marker.exists():
        written = write_synthetic(root, spec)
        marker.write_text(json.dumps({"tensors": written.n_tensors}))
    tensors = json.loads(marker.read_text())["tensors"]
    return Case(tensors, root, root / "tier_map.json", spec)


def _bare_parse(root: Path) -> int:
    count = 0
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            count += len(json.loads(f.read(n)))
    return count


#: The clock stages are timed with: wall time, or with ``--clock cpu`` this process's CPU
#: time (every thread's), which other work on a shared machine disturbs less.
clock: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = clock()
    result = fn()
    return clock() - started, result


def _nbytes(routes: Any) -> list[int]:
    # A tree from before the route tables (to time the same stages at an older commit).
    try:
        from asyncslab.planning._routes import route_column
    except ImportError:
        return [route.nbytes for route in routes]
    return route_column(routes, "nbytes")


def library_stages(case: Case) -> dict[str, float]:
    """The library's stages on ``case``, each timed once."""
    out: dict[str, float] = {}
    out["bare_parse"], _ = _timed(lambda: _bare_parse(case.root))
    gc.disable()
    try:
        out["bare_parse_nogc"], _ = _timed(lambda: _bare_parse(case.root))
    finally:
        gc.enable()
    gc.collect()
    started = clock()
    ckpt = Checkpoint.open(case.root)
    out["open"] = clock() - started
    started = clock()
    p = plan(ckpt, tier_map=case.tier_map)
    out["plan"] = clock() - started
    options = LoadOptions()
    out["schedule"], _ = _timed(
        lambda: schedule(p, max_read=options.read_size, gap=options.coalesce_gap)
    )

    def track() -> None:
        tracker = Tracker(p)
        tracker.begin(None)
        for route, nbytes in enumerate(_nbytes(p.routes)):
            tracker.land(route, nbytes)

    out["tracker"], _ = _timed(track)

    async def load() -> tuple[float, float]:
        async with SlabSet(p, "cpu") as slabs:
            started = clock()
            await slabs.load(ckpt)
            loaded = clock() - started
            started = clock()
            for name in p.slabs:
                slabs.slab(name)
            return loaded, clock() - started

    out["load"], out["binding"] = asyncio.run(load())
    return out


#: Stage functions by name; another one (vLLM's recording against ``auto``, say) is one
#: more entry.
STAGES: dict[str, StageFn] = {"library": library_stages}

_MEMORY_PROBE = r"""
import gc, json, sys, tracemalloc
from asyncslab import Checkpoint, plan
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
root, tier_map, trace = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
gc.collect()
if trace:
    tracemalloc.start()
before = rss()
ckpt = Checkpoint.open(root)
opened = rss()
p = plan(ckpt, tier_map=tier_map)
gc.collect()
after = rss()
retained, peak = tracemalloc.get_traced_memory() if trace else (0, 0)
print(json.dumps(
    {"open": opened - before, "open_plan": after - before, "retained": retained, "peak": peak}
))
"""


def memory(case: Case, trace: bool) -> dict[str, int]:
    """RSS growth of open and of open + plan, in a fresh process; with ``trace``, also the
    bytes Python still holds after them (tracemalloc, in a second process: it slows)."""
    result: dict[str, int] = {}
    for traced in (False, True) if trace else (False,):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEMORY_PROBE,
                str(case.root),
                str(case.tier_map),
                str(int(traced)),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=case.root,  # not the repository: the asyncslab on the path (PYTHONPATH first)
        )
        found = json.loads(done.stdout)
        if traced:
            result.update(retained=found["retained"], peak=found["peak"])
        else:
            result.update(open=found["open"], open_plan=found["open_plan"])
    return result


def fit(counts: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + slope * count``: (fixed s, slope us per tensor)."""
    mean_n, mean_t = statistics.fmean(counts), statistics.fmean(seconds)
    var = sum((n - mean_n) ** 2 for n in counts)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(counts, seconds, strict=True)) / var
    return mean_t - slope * mean_n, slope * 1e6


def _verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def report(results: dict[str, Any]) -> str:
    rows = results["cases"]
    stages = list(rows[0]["seconds"])
    counts = [r["tensors"] for r in rows]
    lines = [f"microseconds per tensor ({results['clock']} clock, median of rounds):", ""]
    header = f"{'tensors':>9} " + " ".join(f"{s:>15}" for s in stages)
    lines += [header, "-" * len(header)]
    for r in rows:
        cells = " ".join(f"{r['seconds'][s] / r['tensors'] * 1e6:>15.2f}" for s in stages)
        lines.append(f"{r['tensors']:>9,} {cells}")
    lines += ["", "fitted (seconds = fixed + slope x tensors), and time per tensor at each"]
    lines += ["count over that at its half (linear: at most 1.05):", ""]
    for s in stages if len(rows) > 1 else ():
        times = [r["seconds"][s] for r in rows]
        fixed, slope = fit(counts, times)
        ratios = [
            (times[i] / counts[i]) / (times[i - 1] / counts[i - 1]) for i in range(1, len(rows))
        ]
        shown = " ".join(f"{x:.2f}" for x in ratios)
        lines.append(
            f"  {s:<16} slope {slope:7.2f} us/tensor  fixed {fixed * 1e3:8.1f} ms  {shown}"
        )
    big = rows[-1]
    sec = big["seconds"]
    n = big["tensors"]
    open_plan = sec["open"] + sec["plan"]
    overhead = (open_plan + sec["schedule"]) / n * 1e6
    lines += ["", f"targets at {n:,} tensors:"]
    lines.append(
        f"  open + plan within {TARGET_BARE}x of a bare parse: {open_plan:.3f} s vs "
        f"{sec['bare_parse']:.3f} s = {open_plan / sec['bare_parse']:.2f}x "
        f"({_verdict(open_plan <= TARGET_BARE * sec['bare_parse'])}); against the bare parse "
        f"with the collector paused ({sec['bare_parse_nogc']:.3f} s): "
        f"{open_plan / sec['bare_parse_nogc']:.2f}x "
        f"({_verdict(open_plan <= TARGET_BARE * sec['bare_parse_nogc'])})"
    )
    lines.append(
        f"  open + plan + schedule <= {TARGET_US} us/tensor: {overhead:.2f} us "
        f"({_verdict(overhead <= TARGET_US)})"
    )
    linear = [
        ((rows[i]["seconds"]["open"] + rows[i]["seconds"]["plan"]) / counts[i])
        / ((rows[i - 1]["seconds"]["open"] + rows[i - 1]["seconds"]["plan"]) / counts[i - 1])
        for i in range(1, len(rows))
        if counts[i - 1] >= 10_000
    ]
    if linear:
        worst = max(linear)
        lines.append(
            f"  open + plan linear from 10k tensors (2x tensors <= 2.1x time): worst ratio "
            f"{worst:.2f} per tensor, {2 * worst:.2f}x time ({_verdict(worst <= TARGET_LINEAR)})"
        )
    mem = big.get("memory")
    if mem:
        per = mem["open_plan"] / n
        lines.append(
            f"  memory <= {TARGET_BYTES} B/tensor: RSS growth of open {mem['open'] / n:.0f}, of "
            f"open + plan {per:.0f} B/tensor ({_verdict(per <= TARGET_BYTES)})"
            + (
                f"; Python's allocations: retained {mem['retained'] / n:.0f}, peak "
                f"{mem['peak'] / n:.0f} B/tensor"
                if "retained" in mem
                else ""
            )
        )
    lines.append(
        f"\n{results['machine']}; load average before {results['load_before']}, "
        f"after {results['load_after']}"
    )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["cases"]
    counts = [r["tensors"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for stage in rows[0]["seconds"]:
        us = [r["seconds"][stage] / r["tensors"] * 1e6 for r in rows]
        ax.plot(counts, us, marker="o", label=stage)
    overhead = [
        (r["seconds"]["open"] + r["seconds"]["plan"] + r["seconds"]["schedule"])
        / r["tensors"]
        * 1e6
        for r in rows
    ]
    ax.plot(counts, overhead, marker="s", color="black", linewidth=2, label="open+plan+schedule")
    ax.axhline(
        TARGET_US, color="black", linestyle="--", linewidth=1, label=f"target {TARGET_US} us"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors in the checkpoint")
    ax.set_ylabel("microseconds per tensor")
    ax.set_title("asyncslab: cost per tensor by stage (EXL3-like, 256 experts a layer)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", default="library", help=f"of {sorted(STAGES)}")
    ap.add_argument("--dir", type=Path, default=None, help="keep the checkpoints here")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    ap.add_argument("--trace", action="store_true", help="also Python's retained bytes")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    directory = args.dir or Path(tempfile.mkdtemp(prefix="asyncslab-scale-"))
    directory.mkdir(parents=True, exist_ok=True)
    stage_fns = [STAGES[name] for name in args.stages.split(",")]
    counts = [int(c) for c in args.counts.split(",")]
    results: dict[str, Any] = {
        "clock": args.clock,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}",
        "load_before": f"{os.getloadavg()[0]:.2f}",
        "cases": [],
    }
    for count in counts:
        case = prepare(count, directory)
        runs: list[dict[str, float]] = []
        for _ in range(args.rounds):
            merged: dict[str, float] = {}
            for fn in stage_fns:
                merged.update(fn(case))
                gc.collect()  # the last stage's checkpoint and plan, not the next one's cost
            runs.append(merged)
        seconds = {s: statistics.median(r[s] for r in runs) for s in runs[0]}
        row: dict[str, Any] = {"tensors": case.tensors, "seconds": seconds}
        if not args.no_memory:
            row["memory"] = memory(case, args.trace)
        results["cases"].append(row)
        shown = ", ".join(f"{s} {t / case.tensors * 1e6:.2f}" for s, t in seconds.items())
        print(f"{case.tensors:>9,} tensors: {shown} us/tensor", flush=True)
    results["load_after"] = f"{os.getloadavg()[0]:.2f}"
    print()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

"""Two source trees of asyncslab side by side: ``Checkpoint.open`` and ``plan`` in lockstep.

    python -m benchmarks.tree_ab --base OLD_TREE --new NEW_TREE --checkpoint DIR [--pairs 10]

Answers "did this change make opening or planning slower?" where a VM's drift is as large as
the difference: comparing runs of one tree after the other measures the drift. Each tree
gets one long-lived worker process (``PYTHONPATH=TREE``, so it imports that tree's
``asyncslab``) which opens the checkpoint once, then times what the driver asks for, one
request at a time: both workers take turns, the order flipped every pair, so both sides see
the same machine. A tree is a checkout, e.g. ``git worktree add /tmp/base <commit>``.

Prints, per step, each tree's median wall-clock and CPU seconds, the ratio of the medians
(new / base) and the median of the paired ratios. A checkpoint at the field's scale:
``python -m benchmarks.scale_bench --counts 288780 --dir DIR`` writes one (290k tensors, 32
shards) as ``DIR/exl3-288780`` and keeps it; a checkpoint with a ``tier_map.json`` is planned
with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("open", "plan")


def worker(checkpoint: str) -> None:
    """One tree's side: read a step per line on stdin, answer ``wall cpu`` seconds."""
    import asyncslab

    tiers = Path(checkpoint, "tier_map.json")
    tier_map = str(tiers) if tiers.exists() else None
    opened = asyncslab.Checkpoint.open(checkpoint)
    print(f"ready {asyncslab.__file__}", flush=True)
    for line in sys.stdin:
        step = line.strip()
        wall, cpu = time.perf_counter(), time.process_time()
        if step == "open":
            made: object = asyncslab.Checkpoint.open(checkpoint)
        else:
            made = asyncslab.plan(opened, tier_map=tier_map)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        del made  # freed before the answer, so neither side pays for the other's garbage
        print(f"{wall:.6f} {cpu:.6f}", flush=True)


class _Side:
    def __init__(self, tree: Path, checkpoint: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree))
        # Run by path from a neutral directory: the tree on PYTHONPATH is the asyncslab found.
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(checkpoint)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(checkpoint).parent,
        )
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        ready = self.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.close()
            raise SystemExit(f"the worker for {tree} did not start (exit {self.process.wait()})")
        self.imported = ready[1]

    def time(self, step: str) -> tuple[float, float]:
        self.stdin.write(step + "\n")
        self.stdin.flush()
        wall, cpu = self.stdout.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self.stdin.close()  # the worker's loop ends at end of input
        self.process.wait()
        self.stdout.close()


Times = dict[str, dict[str, list[tuple[float, float]]]]


def compare(base: Path, new: Path, checkpoint: Path, pairs: int) -> tuple[dict[str, str], Times]:
    """Where each side imported asyncslab from, and each side's (wall, cpu) seconds per step,
    ``pairs`` of each, taken in alternating order."""
    sides = {"base": _Side(base, checkpoint)}
    try:
        sides["new"] = _Side(new, checkpoint)
        times: Times = {n: {s: [] for s in STEPS} for n in sides}
        for i in range(pairs):
            order = ("base", "new") if i % 2 == 0 else ("new", "base")
            for step in STEPS:
                for name in order:
                    times[name][step].append(sides[name].time(step))
        return {name: side.imported for name, side in sides.items()}, times
    finally:
        for side in sides.values():
            side.close()


def report(times: Times) -> list[str]:
    lines = []
    for step in STEPS:
        for index, clock in enumerate(("wall", "cpu")):
            base = [t[index] for t in times["base"][step]]
            new = [t[index] for t in times["new"][step]]
            b, n = statistics.median(base), statistics.median(new)
            paired = statistics.median(y / x for x, y in zip(base, new, strict=True))
            lines.append(
                f"{step} {clock}: base {b:.3f} s, new {n:.3f} s, new/base {n / b:.3f}x "
                f"(median of paired ratios {paired:.3f}x)"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help="the tree before the change")
    parser.add_argument("--new", type=Path, help="the tree after it")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint directory")
    parser.add_argument("--pairs", type=int, default=10)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if not (args.base and args.new and args.checkpoint):
        parser.error("--base, --new and --checkpoint are required")
    imported, times = compare(
        args.base.resolve(), args.new.resolve(), args.checkpoint.resolve(), args.pairs
    )
    for name, path in imported.items():
        print(f"{name}: {path}")
    for line in report(times):
        print(line)


if __name__ == "__main__":
    main()

"""How ``asyncslab bench`` runs its contenders: one worker process per contender and run,
in an order that alternates between runs, each record checked for what it verified; and
the machine they ran on."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cache import drop_cache
from .contenders import (
    CONTENDERS,
    MANY_SMALL_VERIFY,
    MEMORY_FACTOR,
    VERIFY_ALL,
    MiB,
    human,
)
from .results import ok
from .worker import PEERS, RESULT_MARK

__all__ = [
    "Runner",
    "checked",
    "installed",
    "log",
    "machine",
    "meminfo",
    "one_run",
    "run_order",
    "selected",
    "worker_env",
]


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mem_total": meminfo().get("MemTotal", 0),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for name in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
            info[f"thp_{name}"] = text
        except OSError:
            pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return info


class Runner:
    """Starts one worker process per contender run and collects its record."""

    def __init__(self, args: argparse.Namespace, checkpoint: Path, env_extra: dict[str, str]):
        self.args = args
        self.checkpoint = checkpoint
        self.env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the folder that holds asyncslab/
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, self.env.get("PYTHONPATH", "")) if p
        )
        self.env.update(env_extra)
        self.verify: int = args.verify
        if self.verify is None:
            self.verify = MANY_SMALL_VERIFY if args.many_small else VERIFY_ALL
        self.options = {
            "io_workers": args.io_workers,
            "read_size": args.read_mb * MiB,
        }

    def run(self, contender: str, mode: str, rules: str, nbytes: int) -> dict[str, Any]:
        if self.args.settle and not self.args.in_process:
            # A contender that just exited freed GBs; on a VM the kernel then hands those
            # pages back to the hypervisor in batches, and page allocation stalls meanwhile:
            # without the pause, the next contender would pay for the previous one's memory
            # (figures in docs/performance.md, under --settle).
            time.sleep(self.args.settle)
        need = nbytes * MEMORY_FACTOR.get(contender, 1.0)
        available = meminfo().get("MemAvailable")
        if available is not None and need > 0.9 * available:
            return {"skipped": f"needs ~{human(need)}, {human(available)} available"}
        task = {
            "contender": contender,
            "mode": mode,
            "checkpoint": str(self.checkpoint),
            "rules": rules,
            "options": self.options,
            "threads": self.args.io_workers,
            "verify": self.verify,
            "repeats": self.args.repeats,
        }
        if self.args.in_process:
            from .worker import run_task

            try:
                return checked(contender, run_task(task), self.verify)
            except Exception as err:
                return {"error": f"{type(err).__name__}: {err}"}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "asyncslab.cli._bench.worker", json.dumps(task)],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=3600,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": "worker timed out after 3600 s"}
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT_MARK):
                result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
                if "error" in result and proc.stderr:
                    result["stderr"] = proc.stderr[-4000:]
                return checked(contender, result, self.verify)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker exited {proc.returncode}: {tail[0]}"}


def checked(contender: str, rec: dict[str, Any], verify: int) -> dict[str, Any]:
    """A timed record whose contender compared fewer tensors than asked is an error, not a
    time: it may have skipped work (first-touch lands no tensors: not asked)."""
    if not ok(rec) or contender.startswith("first-touch"):
        return rec
    routes = rec.get("tensors", 0)
    want = routes if verify == VERIFY_ALL else min(verify, routes)
    if rec.get("verified") != want:
        bad = dict(rec)
        bad["seconds_unverified"] = bad.pop("seconds")
        bad["error"] = f"verified {rec.get('verified')} of the {want} tensors asked"
        return bad
    return rec


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def selected(args: argparse.Namespace, universe: Sequence[str]) -> list[str]:
    if not args.contenders:
        return list(universe)
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    return [c for c in universe if c in wanted]


def run_order(active: Sequence[str], run: int) -> list[str]:
    """The order of run ``run`` (from 0): bound-N right after asyncslab, the pair the
    headline ratio compares, and every other run reversed, so that the machine's drift over a run
    (large on a shared VM: the audit linked from benchmarks/README.md) favours neither side of
    a ratio."""
    order = [c for c in active if c != "bound-N"]
    if "bound-N" in active:
        at = order.index("asyncslab") + 1 if "asyncslab" in order else len(order)
        order.insert(at, "bound-N")
    return order[::-1] if run % 2 else order


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in args.worker_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--worker-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def installed(contender: str) -> bool:
    module = PEERS.get(contender)
    return module is None or importlib.util.find_spec(module) is not None


def one_run(
    runner: Runner,
    active: Sequence[str],
    i: int,
    records: list[dict[str, Any]],
    *,
    mode: str,
    rules: str,
    files: Sequence[Path],
    nbytes: int,
    tag: dict[str, str],
    shown: Callable[[dict[str, Any]], str],
) -> dict[str, dict[str, Any]]:
    """Run ``i`` (from 0) of ``mode``: each active contender once, in the run's order (cold:
    ``files`` dropped from the page cache before each), its record appended to ``records``
    under ``tag`` and logged (``shown``: a timed record, in words). Returns the run's records
    by contender."""
    by_contender: dict[str, dict[str, Any]] = {}
    for c in run_order(active, i):
        if not installed(c):
            by_contender[c] = {"skipped": "not installed"}
            continue
        cached = drop_cache(files) if mode == "cold" else None
        rec = runner.run(c, mode, rules, nbytes)
        if mode == "cold":
            rec["cached_after_drop"] = cached
        by_contender[c] = rec
        records.append({**tag, "run": i + 1, "contender": c, **rec})
        said = shown(rec) if ok(rec) else rec.get("skipped") or rec.get("error")
        log(f"[{' '.join(tag.values())} run {i + 1}/{runner.args.runs}] {c}: {said}")
    return by_contender

"""The benchmark of a sized checkpoint (generated, or ``--checkpoint``): every mode asked,
the contenders interleaved per run, then the tables, the lag, the notes, where the time goes
and the figures."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .cache import check_cold, read_all
from .contenders import APPLICABLE, CONTENDERS, MODES, MiB, human
from .explain import explanation, notes
from .results import figure_lines, figures_of, lag_lines, mode_table, summarise
from .runs import Runner, one_run, selected, worker_env

__all__ = ["bench_sized"]

_Runs = list[dict[str, dict[str, Any]]]


def bench_sized(
    args: argparse.Namespace, checkpoint: Path, report: dict[str, Any]
) -> tuple[list[str], int]:
    files, nbytes = _open_and_plan(checkpoint, report)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    contenders = selected(args, CONTENDERS)
    runs_by_mode, records, warmups = _measure(args, checkpoint, files, nbytes, modes, report)
    summaries = {m: summarise(runs_by_mode[m], contenders) for m in modes}
    asyncslab_records = [r for r in records if r["contender"] == "asyncslab"]
    figures = figures_of(summaries, runs_by_mode, asyncslab_records, nbytes)
    report.update(records=records, warmups=warmups, summary=summaries, figures=figures)

    lines = _header_lines(args, report, warmups)
    for mode in modes:
        lines.append("")
        lines.extend(mode_table(f"mode {mode}", summaries[mode], contenders, APPLICABLE[mode]))
    lines.extend(lag_lines(asyncslab_records))
    lines.append("")
    lines.extend(notes(summaries, runs_by_mode))
    explain = explanation(summaries, report.get("cold_check"), runs_by_mode, args.io_workers)
    if explain:
        lines.append("")
        lines.extend(explain)
    lines.append("")
    lines.extend(figure_lines(figures))
    return lines, 0


def _open_and_plan(checkpoint: Path, report: dict[str, Any]) -> tuple[list[Path], int]:
    """The checkpoint's shard files and the bytes its plan routes; what it holds goes into
    ``report["checkpoint"]``."""
    from ...checkpoint import Checkpoint
    from ...planning import plan as make_plan

    t = time.perf_counter()
    ckpt = Checkpoint.open(checkpoint)
    plan = make_plan(ckpt)
    plan_s = time.perf_counter() - t
    nbytes = plan.nbytes
    files = [Path(f.path) for f in ckpt.files]
    report["checkpoint"] = {
        "path": str(checkpoint),
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
        "slab_bytes": nbytes,
        "tensors_routed": len(plan.routes),
        "slabs": len(plan.slabs),
        "plan_s": plan_s,
    }
    return files, nbytes


def _measure(
    args: argparse.Namespace,
    checkpoint: Path,
    files: list[Path],
    nbytes: int,
    modes: list[str],
    report: dict[str, Any],
) -> tuple[dict[str, _Runs], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every run of every mode: the runs by mode, every record, and the page-cache warm-ups
    before the warm runs (a cold mode's check of its drop goes into ``report``)."""
    contenders = selected(args, CONTENDERS)
    runner = Runner(args, checkpoint, worker_env(args))
    records: list[dict[str, Any]] = []
    runs_by_mode: dict[str, _Runs] = {}

    def shown(rec: dict[str, Any]) -> str:
        return (
            f"{rec['seconds']:.3f} s, {nbytes / rec['seconds'] / 1e9:.2f} GB/s, "
            f"peak +{rec['peak_growth'] / MiB:.0f} MiB"
        )

    warmups: list[dict[str, Any]] = []
    for mode in modes:
        active = [c for c in contenders if c in APPLICABLE[mode]]
        if mode == "cold":
            report["cold_check"] = check_cold(files)
        runs: _Runs = []
        for i in range(args.runs):
            if mode != "cold":
                n, s = read_all(files)
                warmups.append({"mode": mode, "run": i + 1, "bytes": n, "seconds": s})
            runs.append(
                one_run(
                    runner,
                    active,
                    i,
                    records,
                    mode=mode,
                    rules="default",
                    files=files,
                    nbytes=nbytes,
                    tag={"mode": mode},
                    shown=shown,
                )
            )
        runs_by_mode[mode] = runs
    return runs_by_mode, records, warmups


def _header_lines(
    args: argparse.Namespace, report: dict[str, Any], warmups: list[dict[str, Any]]
) -> list[str]:
    """What was loaded, how it was generated, the options, and the warm-up reads."""
    ckpt = report["checkpoint"]
    nbytes = ckpt["slab_bytes"]
    lines = [
        f"checkpoint: {ckpt['path']} ({ckpt['files']} files, "
        f"{human(ckpt['file_bytes'])}); routed {ckpt['tensors_routed']} tensors "
        f"into {ckpt['slabs']} slabs = "
        f"{human(nbytes)} ({nbytes / 1e9:.3f} GB); plan {ckpt['plan_s']:.2f} s"
    ]
    gen = report.get("generation")
    if gen:
        lines.append(
            "generation: reused (--keep)"
            if gen["reused"]
            else f"generation: {gen['seconds']:.2f} s ({gen['gbps']:.2f} GB/s, pattern fill)"
        )
    lines.append(
        f"options: io_workers={args.io_workers} (bound-N threads), read_size={args.read_mb} MiB, "
        f"runs={args.runs}, contenders interleaved per run (order reversed every other "
        f"run), {args.repeats} passes per process when pre-touched, "
        f"{'IN THIS PROCESS (smoke test)' if args.in_process else 'each in a fresh process'}; "
        f"ratios are medians of per-run paired ratios"
    )
    if warmups:
        best = max(w["bytes"] / w["seconds"] / 1e9 for w in warmups if w["seconds"] > 0)
        lines.append(f"page-cache warm-up reads before each warm run: up to {best:.2f} GB/s")
    return lines

"""``asyncslab bench --many-small``: a checkpoint of many 4 KiB tensors, loaded with a dense
plan (a slab per tensor) and with one that stacks them into few slabs; reports tensors/s."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .cache import read_all
from .contenders import MANY_SMALL_CONTENDERS, human
from .fixtures import ManySmall, write_many_small
from .results import figure, figure_lines, fmt, median, mode_table, summarise, with_planning
from .runs import Runner, one_run, selected, worker_env

__all__ = ["bench_many_small"]


def bench_many_small(
    args: argparse.Namespace, root: Path, report: dict[str, Any]
) -> tuple[list[str], int]:
    count = args.many_small_count
    t = time.perf_counter()
    fixture = write_many_small(root / f"many-small-{count}", count)
    build_s = time.perf_counter() - t
    report["many_small"] = {
        "path": str(fixture.path),
        "count": count,
        "tensor_bytes": fixture.tensor_bytes,
        "bytes": fixture.nbytes,
        "build_s": build_s,
    }
    plans = {"dense": "dense", "stack": "stack:" + fixture.stack_pattern}
    contenders = selected(args, MANY_SMALL_CONTENDERS)
    runner = Runner(args, fixture.path, worker_env(args))
    records: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {p: [] for p in plans}

    def shown(rec: dict[str, Any]) -> str:
        return (
            f"{rec['seconds']:.3f} s, {count / rec['seconds']:,.0f} tensors/s "
            f"(plan {rec.get('plan_s', 0):.2f} s untimed)"
        )

    for i in range(args.runs):
        read_all([fixture.path])
        for label, rules in plans.items():
            runs[label].append(
                one_run(
                    runner,
                    contenders,
                    i,
                    records,
                    mode="warm-fresh",
                    rules=rules,
                    files=[fixture.path],
                    nbytes=fixture.nbytes,
                    tag={"mode": "many-small", "plan": label},
                    shown=shown,
                )
            )
    summaries = {label: summarise(runs[label], contenders) for label in plans}
    figures = []
    for label in plans:
        row = summaries[label].get("asyncslab", {})
        rate = row["tensors"] / row["seconds"] if "seconds" in row else None
        name = f"many-small ({label} plan): asyncslab tensors/s"
        figures.append(figure(f"many_small_{label}_tensors_per_s", name, rate))
    report.update(records=records, summary=summaries, figures=figures)
    lines = _lines(fixture, build_s, runs, summaries, contenders)
    lines.extend(figure_lines(figures))
    return lines, 0


def _lines(
    fixture: ManySmall,
    build_s: float,
    runs: dict[str, list[dict[str, dict[str, Any]]]],
    summaries: dict[str, dict[str, dict[str, Any]]],
    contenders: list[str],
) -> list[str]:
    """The checkpoint, the table of each plan, and asyncslab's rate with its planning."""
    count = fixture.count
    lines = [
        f"many-small: {count:,} tensors of {fixture.tensor_bytes} B in one file "
        f"({human(fixture.nbytes)}), built in {build_s:.2f} s; warm page cache, fresh memory",
    ]
    for label in runs:
        n_slabs = next((r.get("slabs") for r in runs[label][0].values() if r.get("slabs")), "?")
        plan_s = summaries[label].get("asyncslab", {}).get("plan_s")
        lines.append("")
        lines.extend(
            mode_table(
                f"plan {label} ({n_slabs} slabs; planning {fmt(plan_s, '.2f')} s, untimed)",
                summaries[label],
                contenders,
                set(contenders),
                many_small=True,
            )
        )
    lines.append("")
    for label in runs:
        row = summaries[label].get("asyncslab", {})
        started = median([s for r in runs[label] if (s := with_planning(r)) is not None])
        if "tensors" in row and started:
            lines.append(
                f"with opening and planning (a server start pays them; untimed above), "
                f"{label} plan: asyncslab {started:.3f} s = "
                f"{row['tensors'] / started:,.0f} tensors/s"
            )
    return lines

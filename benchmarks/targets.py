#!/usr/bin/env python3
"""PASS or MISS: the figures of an ``asyncslab bench --json`` report against this project's
targets.

    asyncslab bench --json run.json
    python -m benchmarks.targets run.json [more.json ...]

The bench measures and reports (its table ends with the figures a run is summed up by, each
under a key of its own in the report's ``figures``); what counts as good enough is the
project's call, and lives here. A figure that was not measured, or a cold run whose drop
left the shards in the page cache, is ``n/a``. Prints one line per figure; never asserts:
the exit status is 0 whatever the verdicts (2 for a report without figures).
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RSS_SLACK_MIB = 64


@dataclass(frozen=True, slots=True)
class Goal:
    """``measured <op> bound``, written as ``text``."""

    op: Callable[[float, float], bool]
    bound: float
    text: str


def _goal(sign: str, bound: float) -> Goal:
    ops = {"<=": operator.le, ">=": operator.ge, ">": operator.gt}
    shown = f"{bound:,.0f}" if bound >= 1000 else f"{bound:g}"
    return Goal(ops[sign], bound, f"{sign} {shown}")


# By figure key; a key ending in _x_asyncslab is another loader's time over asyncslab's.
GOALS = {
    "pretouched_x_bound": _goal("<=", 1.15),
    "fresh_x_bound": _goal("<=", 1.10),
    "cold_x_best_bound": _goal("<=", 1.15),
    "lag_p99_ms": _goal("<=", 5.0),
    "lag_max_ms": _goal("<=", 20.0),
}
FASTER_THAN_ASYNCSLAB = Goal(operator.gt, 1, "> 1 (asyncslab faster)")
MANY_SMALL_RATE = _goal(">=", 200_000)  # tensors/s


def goal_of(figure: dict[str, Any]) -> Goal | None:
    """The goal of one figure of a report (``None``: the project sets none for it)."""
    key = figure["figure"]
    if key in GOALS:
        return GOALS[key]
    if key.endswith("_x_asyncslab"):
        return FASTER_THAN_ASYNCSLAB
    if key.startswith("many_small_") and key.endswith("_tensors_per_s"):
        return MANY_SMALL_RATE
    if key == "peak_rss_growth_mib":  # the slabs, the staging, and a slack
        limit = figure["slabs_and_staging_mib"] + RSS_SLACK_MIB
        return Goal(operator.le, limit, f"<= {limit:.0f} (slabs + staging + {RSS_SLACK_MIB} MiB)")
    return None


def judge(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One verdict per figure with a goal: ``target`` (the figure's label), ``measured``,
    ``goal`` (as text) and ``ok`` (``None``: not judged)."""
    out = []
    for figure in report.get("figures", []):
        goal = goal_of(figure)
        if goal is None:
            continue
        value = figure["measured"]
        target = figure["label"]
        if figure.get("not_cold"):
            target += ": not judged, not a cold run"
        ok = None if value is None or figure.get("not_cold") else goal.op(value, goal.bound)
        out.append({"target": target, "measured": value, "goal": goal.text, "ok": ok})
    return out


def lines(verdicts: Sequence[dict[str, Any]]) -> list[str]:
    out = ["targets (measured vs goal; never asserted):"]
    for t in verdicts:
        v = t["measured"]
        # Three decimals: at two, "1.15 (goal <= 1.15)" could be a MISS.
        shown = "-" if v is None else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}")
        verdict = "n/a " if t["ok"] is None else ("PASS" if t["ok"] else "MISS")
        out.append(f"  {verdict}  {t['target']}: {shown} (goal {t['goal']})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="asyncslab bench --json reports")
    args = parser.parse_args(argv)
    code = 0
    for path in args.reports:
        report = json.loads(path.read_text())
        if len(args.reports) > 1:
            print(f"{path}:")
        if not report.get("figures"):
            print(f"{path}: no figures (not an asyncslab bench --json report?)", file=sys.stderr)
            code = 2
            continue
        print("\n".join(lines(judge(report))))
    return code


if __name__ == "__main__":
    sys.exit(main())

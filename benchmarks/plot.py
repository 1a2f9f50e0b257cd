#!/usr/bin/env python3
"""Plot ``asyncslab bench --json`` reports: one panel per mode, GB/s of every contender.

    python -m benchmarks.plot RUN.json [--many-small MANY.json] -o docs/img/bench.png

Bars are the medians the bench's table prints (a contender skipped or not applicable in a
mode has no bar); the label on each bar is its paired ratio to asyncslab from the same
report, so the picture says what the table says. With ``--many-small``, one more panel per
plan shows tensors/s for the many-small-tensors case. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODE_TITLES = {
    "warm-fresh": "warm cache, fresh memory",
    "warm-pretouched": "warm cache, pre-touched memory",
    "cold": "cold cache",
}
# Colour by kind, so that a reader finds asyncslab, the bounds and the others at a glance.
KINDS = {
    "asyncslab": "#1f77b4",
    "bound": "#7f7f7f",
    "old": "#d62728",
    "peer": "#2ca02c",
    "other": "#bcbd22",
}


@dataclass(frozen=True)
class Bar:
    contender: str
    value: float  # GB/s, or tensors/s in a many-small panel
    label: str  # printed at the end of the bar
    kind: str  # a key of KINDS


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    bars: tuple[Bar, ...]


def kind_of(contender: str) -> str:
    if contender == "asyncslab":
        return "asyncslab"
    if contender.startswith(("bound-", "first-touch-")):
        return "bound"
    if contender.startswith(("old-path", "direct-copy")):
        return "old"
    if contender.startswith(("runai-model-streamer", "fastsafetensors")):
        return "peer"
    return "other"


def _ratio_label(name: str, row: dict[str, Any]) -> str:
    ratio = row.get("x_asyncslab")
    return "" if ratio is None or name == "asyncslab" else f"{ratio:.2f}x asyncslab's time"


def _bars(summary: dict[str, Any], value: Callable[[dict[str, Any]], float]) -> tuple[Bar, ...]:
    """A bar per contender measured in ``summary``, in its order."""
    return tuple(
        Bar(name, value(row), _ratio_label(name, row), kind_of(name))
        for name, row in summary.items()
        if "seconds" in row
    )


def panels(report: dict[str, Any], many_small: dict[str, Any] | None = None) -> list[Panel]:
    """What to draw: pure data, so it is tested without matplotlib."""
    out: list[Panel] = []
    for mode, summary in report.get("summary", {}).items():
        if bars := _bars(summary, lambda row: row["gbps"]):
            out.append(Panel(MODE_TITLES.get(mode, mode), "GB/s", bars))
    if many_small is not None:
        count = many_small["many_small"]["count"]
        for plan, summary in many_small.get("summary", {}).items():
            if bars := _bars(summary, lambda row: row["tensors"] / row["seconds"]):
                out.append(Panel(f"{count:,} tensors of 4 KiB, {plan} plan", "tensors/s", bars))
    return out


def draw(figure_panels: Sequence[Panel], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    thousands = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 100 else f"{v:g}")

    heights = [len(p.bars) + 1.5 for p in figure_panels]  # the same bar height in every panel
    fig, axes = plt.subplots(
        len(figure_panels),
        1,
        figsize=(9, 0.8 + 0.3 * sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    for ax, panel in zip(axes[:, 0], figure_panels, strict=True):
        bars = panel.bars[::-1]  # barh draws bottom-up; keep the table's order top-down
        ax.barh(
            [b.contender for b in bars],
            [b.value for b in bars],
            color=[KINDS[b.kind] for b in bars],
            height=0.7,
        )
        for y, bar in enumerate(bars):
            shown = f"{bar.value:,.0f}" if panel.unit == "tensors/s" else f"{bar.value:.2f}"
            text = f" {shown} {panel.unit}" + (f"  ({bar.label})" if bar.label else "")
            ax.text(bar.value, y, text, va="center", fontsize=8)
        ax.set_xlim(0, max(b.value for b in bars) * 1.8)  # room for the labels
        ax.xaxis.set_major_formatter(thousands)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.tick_params(labelsize=8)
        ax.set_xlabel(f"{panel.unit} (higher is better)", fontsize=8)
    fig.suptitle(title, fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="asyncslab bench --json output")
    parser.add_argument("--many-small", type=Path, help="asyncslab bench --many-small --json")
    parser.add_argument("-o", "--out", type=Path, required=True, help="image to write (.png)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    many = json.loads(args.many_small.read_text()) if args.many_small else None
    figure_panels = panels(report, many)
    if not figure_panels:
        print(f"{args.report}: no measured contender to plot", file=sys.stderr)
        return 1
    ckpt = report.get("checkpoint", {})
    title = args.title or (
        f"asyncslab bench: {ckpt.get('slab_bytes', 0) / (1 << 30):.2f} GiB of slabs, "
        f"{ckpt.get('tensors_routed', '?')} tensors; bars: medians, labels: paired ratios"
    )
    draw(figure_panels, title, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

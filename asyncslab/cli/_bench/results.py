"""What ``asyncslab bench`` makes of its records: medians, paired ratios (each contender's
time over asyncslab's, or the bound's, in the same run), the table of each mode, the figures
a run is summed up by, and the event loop's lag."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .contenders import COLD_CACHED_MAX, MiB
from .worker import PEERS, lag_summary

__all__ = [
    "figure",
    "figure_lines",
    "figures_of",
    "fmt",
    "lag_lines",
    "longest_tick",
    "median",
    "mode_table",
    "ok",
    "paired_over",
    "seconds_of",
    "summarise",
    "with_planning",
]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ok(rec: dict[str, Any] | None) -> bool:
    return rec is not None and "seconds" in rec


def seconds_of(*names: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    """A run's seconds of the fastest of ``names`` that ran in it (``None``: none did)."""

    def get(by_contender: dict[str, dict[str, Any]]) -> float | None:
        times = [by_contender[c]["seconds"] for c in names if ok(by_contender.get(c))]
        return min(times) if times else None

    return get


def with_planning(by_contender: dict[str, dict[str, Any]]) -> float | None:
    """A run's asyncslab seconds with its opening and planning of the checkpoint, which its
    clock leaves out (every worker plans before its clock) and a server start pays."""
    rec = by_contender.get("asyncslab")
    return rec["seconds"] + rec.get("plan_s", 0.0) if rec is not None and ok(rec) else None


def paired_over(
    runs: Sequence[dict[str, dict[str, Any]]],
    numerator: Callable[[dict[str, dict[str, Any]]], float | None],
    denominator: Callable[[dict[str, dict[str, Any]]], float | None],
) -> float | None:
    """Median over runs of numerator / denominator, both taken from the same run."""
    ratios = []
    for by_contender in runs:
        top, bottom = numerator(by_contender), denominator(by_contender)
        if top and bottom:
            ratios.append(top / bottom)
    return median(ratios)


def summarise(
    runs: Sequence[dict[str, dict[str, Any]]], contenders: Sequence[str]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        recs = [r[c] for r in runs if c in r]
        good = [r for r in recs if ok(r)]
        row: dict[str, Any] = {"runs": len(good)}
        if not good:
            why = next((r.get("skipped") or r.get("error") for r in recs if r), None)
            row["status"] = why or "-"
            out[c] = row
            continue
        secs = [r["seconds"] for r in good]
        nbytes = good[0]["bytes"]
        row.update(
            seconds=median(secs),
            seconds_all=secs,
            bytes=nbytes,
            tensors=good[0]["tensors"],
            gbps=nbytes / median(secs) / 1e9 if median(secs) else 0.0,
            peak_growth=median([r["peak_growth"] for r in good]),
            peak_growth_max=max(r["peak_growth"] for r in good),
            x_bound=paired_over(runs, seconds_of(c), seconds_of("bound-N")),
            x_best_bound=paired_over(runs, seconds_of(c), seconds_of("bound-1", "bound-N")),
            x_asyncslab=paired_over(runs, seconds_of(c), seconds_of("asyncslab")),
            plan_s=median([r.get("plan_s", 0.0) for r in good]),
        )
        out[c] = row
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mode_table(
    title: str,
    summary: dict[str, dict[str, Any]],
    contenders: Sequence[str],
    applicable: set[str],
    *,
    many_small: bool = False,
) -> list[str]:
    head = ["contender", "median s", "GB/s", "peak RSS +MiB", "x bound-N", "x asyncslab"]
    if many_small:
        head.insert(2, "tensors/s")
    rows: list[list[str]] = []
    for c in contenders:
        row = summary.get(c)
        if c not in applicable or row is None:
            rows.append([c, *["-"] * (len(head) - 1)])
            continue
        if "seconds" not in row:
            rows.append([c, f"skipped: {row['status']}" if row["status"] != "-" else "-"])
            continue
        cells = [
            c,
            fmt(row["seconds"], ".3f"),
            fmt(row["gbps"], ".2f"),
            fmt(row["peak_growth"] / MiB, ".0f"),
            fmt(row["x_bound"], ".2f"),
            fmt(row["x_asyncslab"], ".2f"),
        ]
        if many_small:
            cells.insert(2, f"{row['tensors'] / row['seconds']:,.0f}")
        rows.append(cells)
    widths = [
        # A list: with every contender failed, no row has a cell past the first.
        max([len(head[i]), *(len(r[i]) for r in rows if len(r) == len(head) or i == 0)])
        for i in range(len(head))
    ]
    lines = [title]
    lines.append(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(head, widths, strict=True))
        )
    )
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        if len(r) != len(head):  # a one-line "skipped: ..." row
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
        else:
            lines.append(
                "  ".join(
                    v.ljust(w) if i == 0 else v.rjust(w)
                    for i, (v, w) in enumerate(zip(r, widths, strict=True))
                )
            )
    return lines


# The few figures a run is summed up by, each under a key of its own. The bench measures
# and reports them; judging them against goals is the project's business, not the
# library's: benchmarks/targets.py in the repository reads them from the --json report.


def figure(key: str, label: str, value: float | None, **facts: Any) -> dict[str, Any]:
    return {"figure": key, "label": label, "measured": value, **facts}


def figures_of(
    summaries: dict[str, dict[str, dict[str, Any]]],
    runs_by_mode: dict[str, list[dict[str, dict[str, Any]]]],
    asyncslab_records: Sequence[dict[str, Any]],
    slab_bytes: int,
) -> list[dict[str, Any]]:
    pre = summaries.get("warm-pretouched", {}).get("asyncslab", {})
    fresh = summaries.get("warm-fresh", {})
    out = [
        figure("pretouched_x_bound", "warm pre-touched: asyncslab / bound-N", pre.get("x_bound")),
        figure(
            "fresh_x_bound",
            "warm fresh: asyncslab / bound-N (fresh)",
            fresh.get("asyncslab", {}).get("x_bound"),
        ),
    ]
    for other in ("old-path", "old-path-mmap", "direct-copy", *PEERS):
        v = fresh.get(other, {}).get("x_asyncslab")
        if v is not None:
            out.append(figure(f"fresh_{other}_x_asyncslab", f"warm fresh: {other} / asyncslab", v))
    fresh_runs = runs_by_mode.get("warm-fresh", [])
    v = paired_over(fresh_runs, seconds_of(*PEERS), seconds_of("asyncslab"))
    if v is not None:
        label = "warm fresh: best peer configuration / asyncslab"
        out.append(figure("fresh_best_peer_x_asyncslab", label, v))
    cold_runs = [r for by in runs_by_mode.get("cold", []) for r in by.values() if ok(r)]
    not_cold = any((r.get("cached_after_drop") or 0.0) > COLD_CACHED_MAX for r in cold_runs)
    label = "cold: asyncslab / best bound"
    if not_cold:
        label += " (a drop left the shards cached)"
    v = summaries.get("cold", {}).get("asyncslab", {}).get("x_best_bound")
    out.append(figure("cold_x_best_bound", label, v, not_cold=not_cold))
    growths = [r["peak_growth"] for r in asyncslab_records if ok(r)]
    staging = max((r.get("staging_budget", 0) for r in asyncslab_records if ok(r)), default=0)
    out.append(
        figure(
            "peak_rss_growth_mib",
            "asyncslab peak RSS growth (worst run, MiB)",
            max(growths) / MiB if growths else None,
            slabs_and_staging_mib=(slab_bytes + staging) / MiB,
        )
    )
    samples = [s / 1e3 for r in asyncslab_records if ok(r) for s in r.get("lag_samples_ms", [])]
    lag = lag_summary(samples)
    for stat in ("p99", "max"):
        value = lag[stat] if samples else None
        out.append(figure(f"lag_{stat}_ms", f"event-loop lag {stat} (ms)", value))
    return out


def figure_lines(figures: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["figures (benchmarks/targets.py judges them, from the --json report):"]
    for f in figures:
        v = f["measured"]
        # Three decimals: at two, a ratio of 1.1549 would read as 1.15.
        shown = "-" if v is None else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}")
        lines.append(f"  {f['label']}: {shown}")
    return lines


def lag_lines(asyncslab_records: Sequence[dict[str, Any]]) -> list[str]:
    """The event loop's lag during asyncslab's loads, and the control before them."""
    samples = [s / 1e3 for r in asyncslab_records if ok(r) for s in r.get("lag_samples_ms", [])]
    if not samples:
        return []
    lag = lag_summary(samples)
    loop = next((r.get("loop") for r in asyncslab_records if r.get("loop")), "?")
    lines = [
        "",
        f"event-loop lag during asyncslab loads ({loop}, 1 ms ticker, {lag['n']:.0f} "
        f"samples): p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max "
        f"{lag['max']:.2f} ms",
        f"  weighted by time (what a request arriving at a random moment meets): p99 "
        f"{lag['p99_time']:.2f} ms; {lag['late_share']:.1%} of the time in ticks late by "
        f"over 5 ms (the figures below are per tick)",
    ]
    idle = [s / 1e3 for r in asyncslab_records if ok(r) for s in r.get("idle_lag_samples_ms", [])]
    if idle:
        il = lag_summary(idle)
        lines.append(
            f"  control, same ticker in the same processes for 0.3 s before each load: p50 "
            f"{il['p50']:.2f} ms, p99 {il['p99']:.2f} ms, max {il['max']:.2f} ms (this "
            f"machine's own scheduling noise)"
        )
    lines.extend(longest_tick(asyncslab_records))
    return lines


def longest_tick(records: Sequence[dict[str, Any]]) -> list[str]:
    """Where the longest tick was, and the hypervisor's steal time during that load: on a
    VM a tick can be long because the VM was not running at all."""
    timed = [r for r in records if ok(r) and r.get("lag_ms", {}).get("n")]
    if not timed:
        return []
    worst = max(timed, key=lambda r: r["lag_ms"]["max"])
    line = (
        f"  longest tick {worst['lag_ms']['max']:.2f} ms, in asyncslab's {worst['mode']} process"
        f" of run {worst['run']}"
    )
    steal = worst.get("steal_ms")
    if steal is None:
        return [line]
    total = sum(r.get("steal_ms") or 0.0 for r in timed)
    return [
        f"{line}; the hypervisor took {steal:.0f} ms of CPU from this VM while it loaded"
        f" (/proc/stat steal; during all asyncslab loads: {total:.0f} ms)"
    ]

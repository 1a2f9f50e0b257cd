"""The words under ``asyncslab bench``'s tables: where the time goes, from this run's
numbers (one section each: the bound and fresh memory, the planning asyncslab's clock leaves
out, the old paths, the cold check), and what each contender does."""

from __future__ import annotations

from typing import Any

from .contenders import MiB
from .results import median, paired_over, seconds_of, with_planning
from .worker import PEERS

__all__ = ["explanation", "notes"]

_Summary = dict[str, dict[str, Any]]
_Runs = list[dict[str, dict[str, Any]]]


def explanation(
    summaries: dict[str, _Summary],
    cold_check: dict[str, Any] | None,
    runs_by_mode: dict[str, _Runs],
    threads: int,
) -> list[str]:
    """Footer: where the time goes, from this run's numbers."""
    fresh = summaries.get("warm-fresh", {})
    pre = summaries.get("warm-pretouched", {})
    nbytes = next((r["bytes"] for m in summaries.values() for r in m.values() if "bytes" in r), 0)
    lines = [
        "where the time goes:",
        *_bound_lines(fresh, pre, nbytes, threads),
        *_planning_lines(fresh, runs_by_mode.get("warm-fresh", [])),
        *_old_path_lines(fresh, runs_by_mode.get("warm-fresh", []), nbytes),
        *_cold_lines(cold_check),
    ]
    return lines if len(lines) > 1 else []


def _seconds(mode: _Summary, c: str) -> float | None:
    return mode.get(c, {}).get("seconds")


def _bound_lines(fresh: _Summary, pre: _Summary, nbytes: int, threads: int) -> list[str]:
    """The copy out of the page cache (the bound), fresh memory alone (first-touch), and
    asyncslab against the bound."""
    lines = []
    bn_pre, bn_fresh = _seconds(pre, "bound-N"), _seconds(fresh, "bound-N")
    ft1, ftn = _seconds(fresh, "first-touch-1"), _seconds(fresh, "first-touch-N")
    a_pre, a_fresh = _seconds(pre, "asyncslab"), _seconds(fresh, "asyncslab")
    if bn_pre:
        lines.append(
            f"  copy out of the page cache into touched memory (bound-N, pre-touched): "
            f"{bn_pre:.3f} s = {nbytes / bn_pre / 1e9:.2f} GB/s"
        )
    if ft1 and ftn:
        lines.append(
            f"  fresh memory alone (first-touch, fill_ of torch.empty): 1 thread "
            f"{ft1:.3f} s = {nbytes / ft1 / 1e9:.2f} GB/s, {threads} threads {ftn:.3f} s = "
            f"{nbytes / ftn / 1e9:.2f} GB/s: every 4 KiB page faults once and is zeroed"
        )
    if bn_pre and bn_fresh:
        lines.append(
            f"  bound-N fresh {bn_fresh:.3f} s - pre-touched {bn_pre:.3f} s = "
            f"{bn_fresh - bn_pre:.3f} s spent faulting fresh pages inside preadv "
            f"({(bn_fresh - bn_pre) / bn_fresh * 100:.0f} % of a fresh load)"
        )
    if a_pre and bn_pre:
        lines.append(
            f"  asyncslab pre-touched {a_pre:.3f} s vs bound-N {bn_pre:.3f} s: "
            f"{a_pre - bn_pre:+.3f} s of scheduling, event loop and bookkeeping"
        )
    if a_fresh and bn_fresh:
        lines.append(
            f"  asyncslab fresh {a_fresh:.3f} s vs bound-N fresh {bn_fresh:.3f} s: "
            f"{a_fresh - bn_fresh:+.3f} s"
        )
    return lines


def _planning_lines(fresh: _Summary, fresh_runs: _Runs) -> list[str]:
    """What asyncslab's clock leaves out (opening and planning), and the ratios with it."""
    plan_s = fresh.get("asyncslab", {}).get("plan_s")
    started = median([s for r in fresh_runs if (s := with_planning(r)) is not None])
    if plan_s is None or started is None:
        return []
    rivals = [
        f"{label} / that {v:.2f}"
        for label, of in (
            ("old-path", seconds_of("old-path")),
            ("old-path-mmap", seconds_of("old-path-mmap")),
            ("best peer", seconds_of(*PEERS)),
        )
        if (v := paired_over(fresh_runs, of, with_planning)) is not None
    ]
    return [
        f"  asyncslab's times above leave out opening the checkpoint and planning (done "
        f"before every contender's clock; the others parse their headers inside theirs): "
        f"{plan_s:.3f} s; a server start pays it: asyncslab fresh with it {started:.3f} s"
        + (f" ({', '.join(rivals)})" if rivals else "")
    ]


def _old_path_lines(fresh: _Summary, fresh_runs: _Runs, nbytes: int) -> list[str]:
    """Where the old paths spend their time and memory."""
    lines = []
    old = fresh.get("old-path", {})
    if "seconds" in old and _seconds(fresh, "asyncslab"):
        lines.append(
            f"  old-path {old['seconds']:.3f} s: one clone per tensor (fresh memory, one torch "
            f"call each), then torch.stack writes every byte again into fresh slabs; peak RSS "
            f"+{old['peak_growth'] / MiB:.0f} MiB = {old['peak_growth'] / max(1, nbytes):.2f}x "
            f"slab bytes"
        )
    mm = fresh.get("old-path-mmap", {})
    if "seconds" in mm:
        recs = [r.get("old-path-mmap", {}) for r in fresh_runs]
        anon = median([r["anon_growth_at_peak"] for r in recs if "anon_growth_at_peak" in r])
        file = median([r["file_growth_at_peak"] for r in recs if "file_growth_at_peak" in r])
        zc = next(
            (r.get("get_tensor_zero_copy") for r in recs if "get_tensor_zero_copy" in r), None
        )
        if anon is not None and file is not None:
            lines.append(
                f"  old-path-mmap: safetensors get_tensor views kept (zero-copy mmap: {zc}); "
                f"at its peak +{anon / MiB:.0f} MiB anonymous (the stacked slabs) and "
                f"+{file / MiB:.0f} MiB of mapped page cache counted in its RSS; its slabs "
                f"of one tensor (not stacked) stay mapped views, not read inside its clock "
                f"(a time that flatters it)"
            )
    return lines


def _cold_lines(cold_check: dict[str, Any] | None) -> list[str]:
    """Whether dropping the files from the page cache made reads cold."""
    if cold_check is None:
        return []
    verdict = (
        "fadvise(DONTNEED) made reads cold"
        if cold_check["effective"]
        else "fadvise(DONTNEED) had no visible effect (or storage is as fast as the "
        "page cache): cold numbers are warm numbers"
    )
    cached = cold_check.get("cached_after_drop")
    return [
        f"  cold check: read after DONTNEED {cold_check['cold_gbps']:.2f} GB/s, again "
        f"{cold_check['warm_gbps']:.2f} GB/s"
        + ("" if cached is None else f", {cached:.1%} of its pages cached after the drop")
        + f": {verdict}"
    ]


def notes(
    summaries: dict[str, dict[str, dict[str, Any]]],
    runs_by_mode: dict[str, list[dict[str, dict[str, Any]]]],
) -> list[str]:
    return [
        "notes: old-path = safe_open().get_tensor(name).clone() per tensor, all kept, then "
        "torch.stack per slab in slot order (plan.where), then the per-tensor copies dropped;",
        "  old-path-mmap = the same with safetensors' get_tensor views kept (safetensors maps "
        "the file MAP_PRIVATE and get_tensor is a zero-copy view of it), then torch.stack;",
        "  direct-copy = torch.empty slabs, slab[slot].copy_(get_tensor(name));",
        "  bound-1/-N = asyncslab's own coalesced reads (schedule()) into one buffer of the "
        "slab bytes by 1 / N threads, the same preadv calls (iovec arrays built before the "
        "clock starts);",
        "  first-touch = torch.empty(slab bytes).fill_(1) (1 / N torch threads); "
        "peak RSS +MiB = VmHWM (reset at start) minus VmRSS before the timed region;",
        "  peers: each returned tensor copied into its slab slot; by default both read a local "
        "disk with O_DIRECT, past a warm page cache; runai-model-streamer = "
        "SafetensorsStreamer.stream_files(all shards) with its defaults (io_uring, O_DIRECT) / "
        "RUNAI_STREAMER_FS_STRATEGY=sync_buffered, RUNAI_STREAMER_CONCURRENCY=N; "
        "fastsafetensors = fastsafe_open(nogds=True) with its defaults / buffered reads "
        "(FASTSAFETENSORS_ODIRECT=0) with max_threads=N;",
        "  old-path, old-path-mmap and direct-copy make torch calls per tensor; each may open "
        "an intra-op (OpenMP) parallel region, which stalls when other processes hold the "
        "cores: --worker-env OMP_NUM_THREADS=1 separates that effect.",
    ]

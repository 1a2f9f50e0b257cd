"""``asyncslab bench``: asyncslab against the old paths, the I/O bound and the memory floor.

Every contender loads the same bytes (all routed bytes of ``asyncslab.plan(checkpoint)``)
in a fresh process of its own (:mod:`asyncslab.cli._bench.worker`), so resident memory and the
first touch of fresh pages are per contender. Contenders are interleaved per run (run 1:
A B C ..., run 2: C B A ..., bound-N next to asyncslab) so that noise and drift on a shared
machine hit all of them alike, and ratios are *paired*: each contender's time over
asyncslab's (or the bound's) time in the same run, then the median of those ratios. With a
pre-touched destination a process times several passes into the same memory and reports
their median.

Modes: ``warm-fresh`` (files in the page cache, destination memory fresh: what a real
start pays), ``warm-pretouched`` (destination memory written before the clock starts: what
the copy alone costs) and ``cold`` (the shard files dropped from the page cache with
``posix_fadvise(DONTNEED)`` before every contender). ``--many-small`` benchmarks a
checkpoint of many 4 KiB tensors instead (tensors per second).

Run as ``asyncslab bench`` or ``python -m asyncslab.cli._bench``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import importlib.util
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._args import size_arg
from .worker import PEERS, RESULT_MARK, lag_summary

__all__ = [
    "ManySmall",
    "add_arguments",
    "main",
    "run",
    "write_many_small",
]

MiB = 1 << 20
GiB = 1 << 30

MODES = ("warm-fresh", "warm-pretouched", "cold")
CONTENDERS = (
    "old-path",
    "old-path-mmap",
    "direct-copy",
    "asyncslab",
    "bound-1",
    "bound-N",
    *PEERS,
    "first-touch-1",
    "first-touch-N",
)
# Which contenders make sense in which mode; the others print "-".
APPLICABLE = {
    "warm-fresh": set(CONTENDERS),
    "warm-pretouched": {"direct-copy", "asyncslab", "bound-1", "bound-N"},
    "cold": set(CONTENDERS) - {"first-touch-1", "first-touch-N"},
}
MANY_SMALL_CONTENDERS = ("old-path", "direct-copy", "asyncslab", "bound-N", *PEERS)
# How much anonymous memory a contender holds at its peak, in multiples of the slab bytes.
# fastsafetensors reads whole files into a buffer of its own, then the slabs are filled.
MEMORY_FACTOR = {"old-path": 2.0, "fastsafetensors": 2.0, "fastsafetensors-buffered-N": 2.0}

# A cold run whose drop left more of the shards cached than this is not a cold run.
COLD_CACHED_MAX = 0.02
VERIFY_ALL = -1
MANY_SMALL_VERIFY = 2000


def _verify_count(text: str) -> int:
    if text == "all":
        return VERIFY_ALL
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not 'all' or an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'all' or >= 0: {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _human(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (of ``asyncslab bench`` and ``python -m asyncslab.cli._bench``)."""
    from ...loading import LoadOptions

    defaults = LoadOptions()
    parser.add_argument(
        "--size",
        type=size_arg,
        default=GiB,
        metavar="SIZE",
        help="size of the generated checkpoint, e.g. 3GiB (default 1GiB)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="PATH",
        help="benchmark this checkpoint instead of generating one",
    )
    parser.add_argument(
        "--runs", type=_positive, default=3, metavar="N", help="runs per contender (default 3)"
    )
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=5,
        metavar="N",
        help="timed passes per process in warm-pretouched mode, reported as their median "
        "(the destination is already touched, so passes reuse it; default 5)",
    )
    parser.add_argument(
        "--mode",
        choices=(*MODES, "all"),
        default="all",
        help="page cache and destination memory state (default all)",
    )
    parser.add_argument(
        "--io-workers",
        type=_positive,
        default=defaults.io_workers,
        metavar="N",
        help=f"asyncslab reads in flight, and bound-N's threads (default {defaults.io_workers})",
    )
    parser.add_argument(
        "--read-mb",
        type=_positive,
        default=defaults.read_size >> 20,
        metavar="MB",
        help=f"asyncslab target read size in MiB, also the bound's (default "
        f"{defaults.read_size >> 20})",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        metavar="LIST",
        help="comma-separated subset of: " + ", ".join(CONTENDERS),
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write every raw number as JSON"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to generate the checkpoint (default: a temporary directory under /tmp)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the generated checkpoint (a later run with the same --dir reuses it)",
    )
    parser.add_argument(
        "--many-small",
        action="store_true",
        help="instead: a checkpoint of many 4 KiB tensors, planned one slab per tensor and "
        "stacked; reports tensors/s",
    )
    parser.add_argument(
        "--many-small-count",
        type=_positive,
        default=300_000,
        metavar="N",
        help="tensors in the --many-small checkpoint (default 300000)",
    )
    _add_run_arguments(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How each contender's run is checked and set up."""
    parser.add_argument(
        "--verify",
        type=_verify_count,
        default=None,
        metavar="N|all",
        help="tensors per run compared with safetensors after the clock stops (default all, "
        "so that a contender that skipped a read cannot pass; with --many-small, 2000 spread "
        "evenly: all 300,000 would add ~10 s per run; N samples evenly, 0 checks nothing)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="pause before each contender, so that memory the previous one freed has "
        "settled (default 3)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the contenders in this process, not one fresh process each: a fast smoke "
        "test only (memory and first-touch numbers are then not per contender)",
    )
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the contender processes (experiments, e.g. "
        "THP_MEM_ALLOC_ENABLE=1); repeatable",
    )


# --------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class ManySmall:
    """A many-small-tensor checkpoint and the rule that stacks it into few slabs."""

    path: Path
    count: int
    tensor_bytes: int
    groups: int
    stack_pattern: str
    nbytes: int


def write_many_small(
    directory: str | os.PathLike[str],
    count: int = 300_000,
    *,
    tensor_bytes: int = 4096,
    groups: int = 16,
) -> ManySmall:
    """Write one ``.safetensors`` file of ``count`` float32 tensors of ``tensor_bytes`` each,
    named ``model.layers.{g}.small.{i}.weight`` (``groups`` layers).

    ``safetensors.torch.save_file`` on hundreds of thousands of tensors is slow, so the
    header JSON is built here and the payload is a cheap pattern (distinct per tensor).
    The file follows the format exactly (8-byte little-endian header length, JSON padded
    with spaces to a multiple of 8, contiguous ``data_offsets``).
    """
    import numpy as np

    if count <= 0 or tensor_bytes <= 0 or tensor_bytes % 4:
        raise ValueError("count must be positive and tensor_bytes a positive multiple of 4")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "many_small.safetensors"
    groups = max(1, min(groups, count))
    per_group = -(-count // groups)
    words = tensor_bytes // 4
    parts = ['{"__metadata__":{"format":"pt"}']
    for k in range(count):
        g, i = divmod(k, per_group)
        a = k * tensor_bytes
        parts.append(
            f',"model.layers.{g}.small.{i}.weight":'
            f'{{"dtype":"F32","shape":[{words}],"data_offsets":[{a},{a + tensor_bytes}]}}'
        )
    parts.append("}")
    header = "".join(parts).encode()
    header += b" " * (-len(header) % 8)
    total = count * tensor_bytes
    chunk_words = max(words, (64 * MiB // tensor_bytes) * words)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        done = 0
        while done < total // 4:
            n = min(chunk_words, total // 4 - done)
            block = np.arange(done, done + n, dtype=np.uint32) * np.uint32(2654435761)
            f.write(block.tobytes())
            done += n
    return ManySmall(
        path=path,
        count=count,
        tensor_bytes=tensor_bytes,
        groups=groups,
        stack_pattern=r"model\.layers\.\d+\.small\.(?P<index>\d+)\.weight",
        nbytes=total,
    )


def _generate(root: Path, size: int, workers: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Generate (or reuse) the synthetic checkpoint of ``size`` bytes under ``root``, with
    ``workers`` processes (default: one per two CPUs, at most one per shard)."""
    from ...testing._synthetic import spec_for_size, write_synthetic

    spec = spec_for_size(size)
    target = root / f"asyncslab-bench-{size}"
    marker = target / ".bench-spec"
    if marker.exists() and marker.read_text() == repr(spec):
        nbytes = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        return target, {"reused": True, "bytes": nbytes, "seconds": 0.0, "spec": repr(spec)}
    t = time.perf_counter()
    if workers is None:
        workers = max(1, min(spec.n_shards, (os.cpu_count() or 1) // 2))
    total = int(write_synthetic(target, spec, workers=workers).total_bytes)
    seconds = time.perf_counter() - t
    marker.write_text(repr(spec))
    return target, {
        "reused": False,
        "bytes": total,
        "seconds": seconds,
        "gbps": total / seconds / 1e9 if seconds > 0 else 0.0,
        "spec": repr(spec),
        "workers": workers,
    }


# --------------------------------------------------------------------------- page cache


def _shard_files(checkpoint: Path) -> list[Path]:
    from ...checkpoint import Checkpoint

    return [Path(f.path) for f in Checkpoint.open(checkpoint).files]


def read_all(files: Iterable[Path]) -> tuple[int, float]:
    """Read every file once (warms the page cache); returns bytes and seconds."""
    buffer = bytearray(16 * MiB)
    view = memoryview(buffer)
    total = 0
    t = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t


def _drop_cache(files: Iterable[Path]) -> float | None:
    """Evict the files from the page cache; returns the share of their pages still cached
    after (``None``: unknown). Dirty pages cannot be dropped, so they are written back first
    (fsync); mapped pages are not dropped either (none are mapped here); tmpfs drops nothing."""
    files = list(files)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return _cached_share(files)


def _cached_share(files: Sequence[Path]) -> float | None:
    """Share of the files' pages in the page cache (``mincore`` over a mapping of each)."""
    from ..._os import MAP_FAILED, PAGE, libc_mincore, libc_mmap

    mincore = libc_mincore()
    if mincore is None:
        return None
    mapper = libc_mmap()
    cached = pages = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        n = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        fd = os.open(path, os.O_RDONLY)
        try:
            address = mapper.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address is None or address == MAP_FAILED:
                return None
            try:
                if mincore(address, size, vec) != 0:
                    return None
            finally:
                mapper.munmap(address, size)
        finally:
            os.close(fd)
        cached += sum(b & 1 for b in vec)
        pages += n
    return cached / pages if pages else 0.0


def _cold_check(files: Sequence[Path]) -> dict[str, Any]:
    """Does fadvise(DONTNEED) make reads cold? Time one file dropped, then again warm."""
    probe = max(files, key=lambda p: p.stat().st_size)
    cached = _drop_cache([probe])
    n, cold_s = read_all([probe])
    _, warm_s = read_all([probe])
    cold = n / cold_s / 1e9 if cold_s > 0 else 0.0
    warm = n / warm_s / 1e9 if warm_s > 0 else 0.0
    # Timing alone would pass a file on tmpfs (nothing dropped) as cold: the page cache
    # itself says what was dropped, where mincore can tell.
    effective = cold < 0.7 * warm and (cached is None or cached <= COLD_CACHED_MAX)
    return {
        "file": str(probe),
        "bytes": n,
        "cold_gbps": cold,
        "warm_gbps": warm,
        "cached_after_drop": cached,
        "effective": effective,
    }


# --------------------------------------------------------------------------- machine


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mem_total": _meminfo().get("MemTotal", 0),
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


# --------------------------------------------------------------------------- workers


class _Runner:
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
        available = _meminfo().get("MemAvailable")
        if available is not None and need > 0.9 * available:
            return {"skipped": f"needs ~{_human(need)}, {_human(available)} available"}
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
                return _checked(contender, run_task(task), self.verify)
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
                return _checked(contender, result, self.verify)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker exited {proc.returncode}: {tail[0]}"}


def _checked(contender: str, rec: dict[str, Any], verify: int) -> dict[str, Any]:
    """A timed record whose contender compared fewer tensors than asked is an error, not a
    time: it may have skipped work (first-touch lands no tensors: not asked)."""
    if not _ok(rec) or contender.startswith("first-touch"):
        return rec
    routes = rec.get("tensors", 0)
    want = routes if verify == VERIFY_ALL else min(verify, routes)
    if rec.get("verified") != want:
        bad = dict(rec)
        bad["seconds_unverified"] = bad.pop("seconds")
        bad["error"] = f"verified {rec.get('verified')} of the {want} tensors asked"
        return bad
    return rec


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- statistics


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ok(rec: dict[str, Any] | None) -> bool:
    return rec is not None and "seconds" in rec


def _seconds_of(*names: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    """A run's seconds of the fastest of ``names`` that ran in it (``None``: none did)."""

    def get(by_contender: dict[str, dict[str, Any]]) -> float | None:
        times = [by_contender[c]["seconds"] for c in names if _ok(by_contender.get(c))]
        return min(times) if times else None

    return get


def _started(by_contender: dict[str, dict[str, Any]]) -> float | None:
    """A run's asyncslab seconds with its opening and planning of the checkpoint, which its
    clock leaves out (every worker plans before its clock) and a server start pays."""
    rec = by_contender.get("asyncslab")
    return rec["seconds"] + rec.get("plan_s", 0.0) if rec is not None and _ok(rec) else None


def _paired_over(
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
    return _median(ratios)


def _summarise(
    runs: Sequence[dict[str, dict[str, Any]]], contenders: Sequence[str]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        recs = [r[c] for r in runs if c in r]
        good = [r for r in recs if _ok(r)]
        row: dict[str, Any] = {"runs": len(good)}
        if not good:
            why = next((r.get("skipped") or r.get("error") for r in recs if r), None)
            row["status"] = why or "-"
            out[c] = row
            continue
        secs = [r["seconds"] for r in good]
        nbytes = good[0]["bytes"]
        row.update(
            seconds=_median(secs),
            seconds_all=secs,
            bytes=nbytes,
            tensors=good[0]["tensors"],
            gbps=nbytes / _median(secs) / 1e9 if _median(secs) else 0.0,
            peak_growth=_median([r["peak_growth"] for r in good]),
            peak_growth_max=max(r["peak_growth"] for r in good),
            x_bound=_paired_over(runs, _seconds_of(c), _seconds_of("bound-N")),
            x_best_bound=_paired_over(runs, _seconds_of(c), _seconds_of("bound-1", "bound-N")),
            x_asyncslab=_paired_over(runs, _seconds_of(c), _seconds_of("asyncslab")),
            plan_s=_median([r.get("plan_s", 0.0) for r in good]),
        )
        out[c] = row
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(
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
            _fmt(row["seconds"], ".3f"),
            _fmt(row["gbps"], ".2f"),
            _fmt(row["peak_growth"] / MiB, ".0f"),
            _fmt(row["x_bound"], ".2f"),
            _fmt(row["x_asyncslab"], ".2f"),
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


# --------------------------------------------------------------------------- figures
# The few figures a run is summed up by, each under a key of its own. The bench measures
# and reports them; judging them against goals is the project's business, not the
# library's: benchmarks/targets.py in the repository reads them from the --json report.


def _figure(key: str, label: str, value: float | None, **facts: Any) -> dict[str, Any]:
    return {"figure": key, "label": label, "measured": value, **facts}


def _figures(
    summaries: dict[str, dict[str, dict[str, Any]]],
    runs_by_mode: dict[str, list[dict[str, dict[str, Any]]]],
    asyncslab_records: Sequence[dict[str, Any]],
    slab_bytes: int,
) -> list[dict[str, Any]]:
    pre = summaries.get("warm-pretouched", {}).get("asyncslab", {})
    fresh = summaries.get("warm-fresh", {})
    out = [
        _figure("pretouched_x_bound", "warm pre-touched: asyncslab / bound-N", pre.get("x_bound")),
        _figure(
            "fresh_x_bound",
            "warm fresh: asyncslab / bound-N (fresh)",
            fresh.get("asyncslab", {}).get("x_bound"),
        ),
    ]
    for other in ("old-path", "old-path-mmap", "direct-copy", *PEERS):
        v = fresh.get(other, {}).get("x_asyncslab")
        if v is not None:
            out.append(_figure(f"fresh_{other}_x_asyncslab", f"warm fresh: {other} / asyncslab", v))
    fresh_runs = runs_by_mode.get("warm-fresh", [])
    v = _paired_over(fresh_runs, _seconds_of(*PEERS), _seconds_of("asyncslab"))
    if v is not None:
        label = "warm fresh: best peer configuration / asyncslab"
        out.append(_figure("fresh_best_peer_x_asyncslab", label, v))
    cold_runs = [r for by in runs_by_mode.get("cold", []) for r in by.values() if _ok(r)]
    not_cold = any((r.get("cached_after_drop") or 0.0) > COLD_CACHED_MAX for r in cold_runs)
    label = "cold: asyncslab / best bound"
    if not_cold:
        label += " (a drop left the shards cached)"
    v = summaries.get("cold", {}).get("asyncslab", {}).get("x_best_bound")
    out.append(_figure("cold_x_best_bound", label, v, not_cold=not_cold))
    growths = [r["peak_growth"] for r in asyncslab_records if _ok(r)]
    staging = max((r.get("staging_budget", 0) for r in asyncslab_records if _ok(r)), default=0)
    out.append(
        _figure(
            "peak_rss_growth_mib",
            "asyncslab peak RSS growth (worst run, MiB)",
            max(growths) / MiB if growths else None,
            slabs_and_staging_mib=(slab_bytes + staging) / MiB,
        )
    )
    samples = [s / 1e3 for r in asyncslab_records if _ok(r) for s in r.get("lag_samples_ms", [])]
    lag = lag_summary(samples)
    for stat in ("p99", "max"):
        value = lag[stat] if samples else None
        out.append(_figure(f"lag_{stat}_ms", f"event-loop lag {stat} (ms)", value))
    return out


def _figure_lines(figures: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["figures (benchmarks/targets.py judges them, from the --json report):"]
    for f in figures:
        v = f["measured"]
        # Three decimals: at two, a ratio of 1.1549 would read as 1.15.
        shown = "-" if v is None else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}")
        lines.append(f"  {f['label']}: {shown}")
    return lines


# --------------------------------------------------------------------------- explanation


def _explain(
    summaries: dict[str, dict[str, dict[str, Any]]],
    cold_check: dict[str, Any] | None,
    runs_by_mode: dict[str, list[dict[str, dict[str, Any]]]],
    threads: int,
) -> list[str]:
    """Footer: where the time goes, from this run's numbers."""
    lines = ["where the time goes:"]
    fresh = summaries.get("warm-fresh", {})
    pre = summaries.get("warm-pretouched", {})

    def sec(mode: dict[str, dict[str, Any]], c: str) -> float | None:
        return mode.get(c, {}).get("seconds")

    bn_pre, bn_fresh = sec(pre, "bound-N"), sec(fresh, "bound-N")
    ft1, ftn = sec(fresh, "first-touch-1"), sec(fresh, "first-touch-N")
    a_pre, a_fresh = sec(pre, "asyncslab"), sec(fresh, "asyncslab")
    nbytes = next((r["bytes"] for m in summaries.values() for r in m.values() if "bytes" in r), 0)
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
    plan_s = fresh.get("asyncslab", {}).get("plan_s")
    fresh_runs = runs_by_mode.get("warm-fresh", [])
    started = _median([s for r in fresh_runs if (s := _started(r)) is not None])
    if plan_s is not None and started is not None:
        rivals = [
            f"{label} / that {v:.2f}"
            for label, of in (
                ("old-path", _seconds_of("old-path")),
                ("old-path-mmap", _seconds_of("old-path-mmap")),
                ("best peer", _seconds_of(*PEERS)),
            )
            if (v := _paired_over(fresh_runs, of, _started)) is not None
        ]
        lines.append(
            f"  asyncslab's times above leave out opening the checkpoint and planning (done "
            f"before every contender's clock; the others parse their headers inside theirs): "
            f"{plan_s:.3f} s; a server start pays it: asyncslab fresh with it {started:.3f} s"
            + (f" ({', '.join(rivals)})" if rivals else "")
        )
    old = fresh.get("old-path", {})
    if "seconds" in old and a_fresh:
        lines.append(
            f"  old-path {old['seconds']:.3f} s: one clone per tensor (fresh memory, one torch "
            f"call each), then torch.stack writes every byte again into fresh slabs; peak RSS "
            f"+{old['peak_growth'] / MiB:.0f} MiB = {old['peak_growth'] / max(1, nbytes):.2f}x "
            f"slab bytes"
        )
    mm = fresh.get("old-path-mmap", {})
    if "seconds" in mm:
        recs = [r.get("old-path-mmap", {}) for r in runs_by_mode.get("warm-fresh", [])]
        anon = _median([r["anon_growth_at_peak"] for r in recs if "anon_growth_at_peak" in r])
        file = _median([r["file_growth_at_peak"] for r in recs if "file_growth_at_peak" in r])
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
    if cold_check is not None:
        verdict = (
            "fadvise(DONTNEED) made reads cold"
            if cold_check["effective"]
            else "fadvise(DONTNEED) had no visible effect (or storage is as fast as the "
            "page cache): cold numbers are warm numbers"
        )
        cached = cold_check.get("cached_after_drop")
        lines.append(
            f"  cold check: read after DONTNEED {cold_check['cold_gbps']:.2f} GB/s, again "
            f"{cold_check['warm_gbps']:.2f} GB/s"
            + ("" if cached is None else f", {cached:.1%} of its pages cached after the drop")
            + f": {verdict}"
        )
    return lines if len(lines) > 1 else []


# --------------------------------------------------------------------------- main flows


def _selected(args: argparse.Namespace, universe: Sequence[str]) -> list[str]:
    if not args.contenders:
        return list(universe)
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    return [c for c in universe if c in wanted]


def _run_order(active: Sequence[str], run: int) -> list[str]:
    """The order of run ``run`` (from 0): bound-N right after asyncslab, the pair the
    headline ratio compares, and every other run reversed, so that the machine's drift over a run
    (large on a shared VM: the audit linked from benchmarks/README.md) favours neither side of
    a ratio."""
    order = [c for c in active if c != "bound-N"]
    if "bound-N" in active:
        at = order.index("asyncslab") + 1 if "asyncslab" in order else len(order)
        order.insert(at, "bound-N")
    return order[::-1] if run % 2 else order


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in args.worker_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--worker-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _check_space(directory: Path, need: int) -> str | None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if need + 256 * MiB > free:
        return (
            f"not enough disk space in {directory}: the checkpoint needs ~{_human(need)}, "
            f"{_human(free)} free (use --dir elsewhere or a smaller --size)"
        )
    return None


def _installed(contender: str) -> bool:
    module = PEERS.get(contender)
    return module is None or importlib.util.find_spec(module) is not None


def _bench_sized(
    args: argparse.Namespace, checkpoint: Path, report: dict[str, Any]
) -> tuple[list[str], int]:
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
    modes = list(MODES) if args.mode == "all" else [args.mode]
    contenders = _selected(args, CONTENDERS)
    runner = _Runner(args, checkpoint, _worker_env(args))
    records: list[dict[str, Any]] = []
    runs_by_mode: dict[str, list[dict[str, dict[str, Any]]]] = {}
    cold_check = None

    def shown(rec: dict[str, Any]) -> str:
        return (
            f"{rec['seconds']:.3f} s, {nbytes / rec['seconds'] / 1e9:.2f} GB/s, "
            f"peak +{rec['peak_growth'] / MiB:.0f} MiB"
        )

    warmups: list[dict[str, Any]] = []
    for mode in modes:
        active = [c for c in contenders if c in APPLICABLE[mode]]
        if mode == "cold":
            cold_check = _cold_check(files)
            report["cold_check"] = cold_check
        runs: list[dict[str, dict[str, Any]]] = []
        for i in range(args.runs):
            if mode != "cold":
                n, s = read_all(files)
                warmups.append({"mode": mode, "run": i + 1, "bytes": n, "seconds": s})
            runs.append(
                _one_run(
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
    summaries = {m: _summarise(runs_by_mode[m], contenders) for m in modes}
    asyncslab_records = [r for r in records if r["contender"] == "asyncslab"]
    figures = _figures(summaries, runs_by_mode, asyncslab_records, nbytes)
    report.update(records=records, warmups=warmups, summary=summaries, figures=figures)

    lines: list[str] = []
    lines.append(
        f"checkpoint: {checkpoint} ({len(files)} files, "
        f"{_human(report['checkpoint']['file_bytes'])}); routed {len(plan.routes)} tensors "
        f"into {len(plan.slabs)} slabs = "
        f"{_human(nbytes)} ({nbytes / 1e9:.3f} GB); plan {plan_s:.2f} s"
    )
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
    for mode in modes:
        lines.append("")
        lines.extend(_table(f"mode {mode}", summaries[mode], contenders, APPLICABLE[mode]))
    lines.extend(_lag_lines(asyncslab_records))
    lines.append("")
    lines.extend(_notes(summaries, runs_by_mode))
    explain = _explain(summaries, cold_check, runs_by_mode, args.io_workers)
    if explain:
        lines.append("")
        lines.extend(explain)
    lines.append("")
    lines.extend(_figure_lines(figures))
    return lines, 0


def _lag_lines(asyncslab_records: Sequence[dict[str, Any]]) -> list[str]:
    """The event loop's lag during asyncslab's loads, and the control before them."""
    samples = [s / 1e3 for r in asyncslab_records if _ok(r) for s in r.get("lag_samples_ms", [])]
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
    idle = [s / 1e3 for r in asyncslab_records if _ok(r) for s in r.get("idle_lag_samples_ms", [])]
    if idle:
        il = lag_summary(idle)
        lines.append(
            f"  control, same ticker in the same processes for 0.3 s before each load: p50 "
            f"{il['p50']:.2f} ms, p99 {il['p99']:.2f} ms, max {il['max']:.2f} ms (this "
            f"machine's own scheduling noise)"
        )
    lines.extend(_longest_tick(asyncslab_records))
    return lines


def _longest_tick(records: Sequence[dict[str, Any]]) -> list[str]:
    """Where the longest tick was, and the hypervisor's steal time during that load: on a
    VM a tick can be long because the VM was not running at all."""
    timed = [r for r in records if _ok(r) and r.get("lag_ms", {}).get("n")]
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


def _one_run(
    runner: _Runner,
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
    for c in _run_order(active, i):
        if not _installed(c):
            by_contender[c] = {"skipped": "not installed"}
            continue
        cached = _drop_cache(files) if mode == "cold" else None
        rec = runner.run(c, mode, rules, nbytes)
        if mode == "cold":
            rec["cached_after_drop"] = cached
        by_contender[c] = rec
        records.append({**tag, "run": i + 1, "contender": c, **rec})
        said = shown(rec) if _ok(rec) else rec.get("skipped") or rec.get("error")
        _log(f"[{' '.join(tag.values())} run {i + 1}/{runner.args.runs}] {c}: {said}")
    return by_contender


def _notes(
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


def _bench_many_small(
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
    contenders = _selected(args, MANY_SMALL_CONTENDERS)
    runner = _Runner(args, fixture.path, _worker_env(args))
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
                _one_run(
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
    summaries = {label: _summarise(runs[label], contenders) for label in plans}
    figures = []
    for label in plans:
        row = summaries[label].get("asyncslab", {})
        rate = row["tensors"] / row["seconds"] if "seconds" in row else None
        name = f"many-small ({label} plan): asyncslab tensors/s"
        figures.append(_figure(f"many_small_{label}_tensors_per_s", name, rate))
    report.update(records=records, summary=summaries, figures=figures)
    lines = [
        f"many-small: {count:,} tensors of {fixture.tensor_bytes} B in one file "
        f"({_human(fixture.nbytes)}), built in {build_s:.2f} s; warm page cache, fresh memory",
    ]
    for label in plans:
        n_slabs = next((r.get("slabs") for r in runs[label][0].values() if r.get("slabs")), "?")
        plan_s = summaries[label].get("asyncslab", {}).get("plan_s")
        lines.append("")
        lines.extend(
            _table(
                f"plan {label} ({n_slabs} slabs; planning {_fmt(plan_s, '.2f')} s, untimed)",
                summaries[label],
                contenders,
                set(contenders),
                many_small=True,
            )
        )
    lines.append("")
    for label in plans:
        row = summaries[label].get("asyncslab", {})
        started = _median([s for r in runs[label] if (s := _started(r)) is not None])
        if "tensors" in row and started:
            lines.append(
                f"with opening and planning (a server start pays them; untimed above), "
                f"{label} plan: asyncslab {started:.3f} s = "
                f"{row['tensors'] / started:,.0f} tensors/s"
            )
    lines.extend(_figure_lines(figures))
    return lines, 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); prints the
    table and returns the exit code."""
    report: dict[str, Any] = {
        "command": sys.argv,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("handler", "func")
        },
    }
    created: Path | None = None
    root: Path
    if args.dir is not None:
        root = args.dir
    else:
        created = Path(tempfile.mkdtemp(prefix="asyncslab-bench-", dir="/tmp"))
        root = created
    generated: Path | None = None
    try:
        if args.many_small:
            need = args.many_small_count * (4096 + 100)
            problem = _check_space(root, need)
            if problem:
                print(f"asyncslab bench: {problem}", file=sys.stderr)
                return 2
            generated = root / f"many-small-{args.many_small_count}"
            lines, code = _bench_many_small(args, root, report)
        else:
            if args.checkpoint is not None:
                checkpoint = args.checkpoint
            else:
                problem = _check_space(root, int(args.size * 1.05))
                if problem:
                    print(f"asyncslab bench: {problem}", file=sys.stderr)
                    return 2
                _log(f"checkpoint of {_human(args.size)} under {root} (generated unless kept) ...")
                checkpoint, gen = _generate(root, args.size)
                generated = checkpoint
                report["generation"] = gen
                if not gen["reused"]:
                    _log(f"generated in {gen['seconds']:.2f} s ({gen['gbps']:.2f} GB/s)")
            lines, code = _bench_sized(args, checkpoint, report)
        text = "\n".join(lines)
        print(text, flush=True)
        report["table"] = text
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
        return code
    finally:
        if not args.keep:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            elif generated is not None:
                shutil.rmtree(generated, ignore_errors=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncslab.cli._bench",
        description="Benchmark asyncslab against the old paths, the I/O bound and the "
        "first-touch floor on a generated (or given) checkpoint.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"asyncslab bench: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

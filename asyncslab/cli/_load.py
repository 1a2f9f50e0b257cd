"""``asyncslab load``: a checkpoint loaded with the automatic plan (or, with
``--transformers``, a transformers model), its throughput and memory reported, ``--verify``
and ``--json``. :func:`run_load` and :func:`result_rows` are the demo's load and table too."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._objects import ObjectPath
from .._os import peak_rss
from .._units import format_bytes
from ..checkpoint import Checkpoint
from ..loading import LoadOptions, LoadStatistics, SlabSet, load
from ..planning import Plan
from ..testing import _verify
from ..testing._verify import VerifyResult
from ._common import (
    PROG,
    UsageError,
    bytes_exact,
    jsonable,
    out,
    run_async,
    stderr_line,
)
from ._inspect import open_and_plan
from ._progress import ProgressBar
from ._tables import format_table

__all__ = ["Loaded", "VerifyError", "cmd_load", "result_rows", "run_load", "verify_slabs"]


class VerifyError(UsageError):
    """The reference library could not read what was loaded (one line, exit code 2)."""


def verify_slabs(p: Plan, slabs: SlabSet, stop: threading.Event | None = None) -> VerifyResult:
    """``--verify``: asyncslab.testing.verify_slabs, an unreadable reference a usage
    error."""
    try:
        return _verify.verify_slabs(p, slabs, stop=stop)
    except _verify.ReferenceUnreadable as err:
        raise VerifyError(f"--verify: {err}") from err


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    stats: LoadStatistics
    peak_rss: int | None  # of the process when the load ended (verification not counted)
    verify: VerifyResult | None


async def _load_and_verify(
    checkpoint: Checkpoint,
    p: Plan,
    *,
    device: str,
    options: LoadOptions,
    progress: Callable[[LoadStatistics], None],
    verify: bool,
) -> Loaded:
    slabs = await load(checkpoint, p, device=device, options=options, progress=progress)
    async with slabs:
        stats = slabs.statistics()
        rss = peak_rss()
        result = None
        if verify:
            # On a thread, so that Ctrl-C (which cancels this task) is heard at once; the
            # thread stops before its next tensor.
            stop = threading.Event()
            try:
                result = await asyncio.to_thread(verify_slabs, p, slabs, stop)
            finally:
                stop.set()
    return Loaded(stats, rss, result)


def run_load(
    checkpoint: Checkpoint,
    p: Plan,
    *,
    device: str,
    options: LoadOptions,
    show_progress: bool,
    verify: bool,
    seen: list[LoadStatistics] | None = None,
) -> Loaded:
    """Load (and verify); ``seen`` receives every progress snapshot, the last one also when
    the load fails or is interrupted."""
    bar = ProgressBar(sys.stderr) if show_progress else None

    def progress(stats: LoadStatistics) -> None:
        if seen is not None:
            seen[:] = [stats]
        if bar is not None:
            bar(stats)
            if stats.state != "loading":
                bar.finish()  # before verification's output, or the error's line

    try:
        return run_async(
            _load_and_verify(
                checkpoint, p, device=device, options=options, progress=progress, verify=verify
            )
        )
    finally:
        if bar is not None:
            bar.finish()


def result_rows(loaded: Loaded, p: Plan, *, verify_row: bool = True) -> list[list[Any]]:
    stats, verify, rss = loaded.stats, loaded.verify, loaded.peak_rss
    needed = stats.bytes_needed
    share = f" ({stats.bytes_read / needed * 100:.1f}%)" if needed else ""
    if stats.staging_budget:
        staging = f"{format_bytes(stats.staging_peak)} of {format_bytes(stats.staging_budget)}"
    elif stats.transfer == "mapped":
        staging = "none (copied straight out of the page cache)"
    else:
        staging = "none (reads land in the slabs directly)"
    rows: list[list[Any]] = [
        ["device", stats.device],
        ["files", f"{stats.files:,}"],
        ["tensors", f"{stats.tensors_landed:,} of {stats.tensors:,} routed tensors landed"],
        ["slabs", f"{len(p.slabs):,} in {stats.units:,} units ({stats.units_complete:,} complete)"],
        ["bytes", bytes_exact(stats.bytes_landed)],
        ["seconds", f"{stats.elapsed_s:.3f}"],
        ["GB/s", f"{stats.gbps:.2f}"],
        ["reads", f"{stats.reads:,}"],
        ["peak staging", staging],
        ["peak RSS", format_bytes(rss) if rss is not None else "unknown"],
        ["read/needed", f"{format_bytes(stats.bytes_read)} / {format_bytes(needed)}{share}"],
    ]
    if verify is not None and verify_row:
        status = "OK" if verify.ok else "FAILED"
        rows.append(["verify", f"{status}: {verify.describe()} ({verify.seconds:.2f}s)"])
    return rows


def cmd_load(args: argparse.Namespace) -> int:
    path: Path = args.path
    if args.transformers:
        return _cmd_load_transformers(args)
    if args.dtype is not None:
        raise UsageError("--dtype applies to --transformers only")
    if args.disable_mmap:
        raise UsageError("--disable-mmap applies to --transformers only")
    # `--json -`: the report goes to stdout in place of the table, so that stdout stays one
    # JSON document (as with `inspect --json`); the bar and the errors are on stderr anyway.
    # The raw text is compared, since Path("./-") is Path("-").
    to_stdout = args.json == "-"
    json_path: Path | None = None if args.json is None or to_stdout else Path(args.json)
    if json_path is not None:
        _check_json_path(json_path)
    if args.verify and isinstance(path, ObjectPath):
        raise UsageError("--verify reads local files with safetensors; not an s3:// checkpoint")
    options = LoadOptions(
        io_workers=args.io_workers,
        read_size=args.read_mb,
        staging_bytes=args.staging_mb,
        streams=args.streams,
        transfer=args.transfer,
    )
    seen: list[LoadStatistics] = []
    p: Plan | None = None
    try:
        checkpoint, p = open_and_plan(path, tier_map=args.tier_map, rank=args.rank)
        listed = {f.path.resolve() for f in p.files}
        if checkpoint.index is not None:
            listed.add(checkpoint.index.resolve())
        if json_path is not None and json_path.resolve() in listed:
            json_path = None  # not overwritten with the failure either
            raise UsageError(f"--json {args.json} is a file of the checkpoint")
        loaded = run_load(
            checkpoint,
            p,
            device=args.device,
            options=options,
            show_progress=not args.no_progress,
            verify=args.verify,
            seen=seen,
        )
    except BaseException as err:
        replace = json_path is not None and (p is not None or _holds_json_or_nothing(json_path))
        if replace or to_stdout:
            # A script reading the file after a non-zero exit must not find an earlier
            # run's "complete" there: this run's outcome, with what it had loaded. (Before
            # a plan, the checkpoint's files are unknown: only a report is replaced.) One
            # reading stdout gets a document to parse whatever went wrong once the command
            # began; a usage error (exit 2) writes none, as argparse's own don't.
            state = "cancelled" if isinstance(err, KeyboardInterrupt) else "failed"
            with contextlib.suppress(OSError):
                _write_json(json_path, _load_report(path, p, options, seen, state, err))
        raise
    return _report(path, p, options, loaded, json_path, to_stdout)


def _report(
    path: Path,
    p: Plan,
    options: LoadOptions,
    loaded: Loaded,
    json_path: Path | None,
    to_stdout: bool,
) -> int:
    """``load``'s outcome told: the verdict, the JSON report, the table; the exit status."""
    verify = loaded.verify
    # The JSON and the verdict first: a reader of stdout that left early loses neither.
    if verify is not None and not verify.ok:
        stderr_line(f"{PROG}: verify failed: {verify.describe()}")
    try:
        if json_path is not None or to_stdout:
            report = _load_report(path, p, options, [loaded.stats], None, None, loaded)
            _write_json(json_path, report)
        if not to_stdout:
            out(f"loaded {path}:")
            rows = result_rows(loaded, p)
            out(format_table(rows, align="ll", indent="  ", terminal=sys.stdout))
    except BrokenPipeError:
        if verify is not None and not verify.ok:
            return 1  # the verdict outranks the reader that left
        raise
    return 1 if verify is not None and not verify.ok else 0


def _cmd_load_transformers(args: argparse.Namespace) -> int:
    """``load --transformers``: the model built and loaded as ``from_pretrained`` would, and
    what the load did."""
    for flag, given in (("--verify", args.verify), ("--tier-map", args.tier_map is not None),
                        ("--rank", args.rank is not None)):  # fmt: skip
        if given:
            raise UsageError(f"{flag} does not apply to --transformers (the model decides)")
    json_path: Path | None = None if args.json in (None, "-") else Path(args.json)
    if json_path is not None:
        _check_json_path(json_path)
    from ..engines._transformers import load as load_transformers

    bar = ProgressBar(sys.stderr) if not args.no_progress else None
    try:
        model, report = load_transformers(
            str(args.path),
            dtype=args.dtype,
            device=args.device,
            progress=bar,
            disable_mmap=args.disable_mmap or None,
            io_workers=args.io_workers,
            read_size=args.read_mb,
            staging_bytes=args.staging_mb,
            streams=args.streams,
            transfer=args.transfer,
        )
    finally:
        if bar is not None:
            bar.finish()
    rss = peak_rss()
    doc = {**dataclasses.asdict(report), "model": type(model).__name__, "peak_rss_bytes": rss}
    doc.update(total_s=report.total_s, gbps=report.gbps, dtype=str(model.dtype))
    if args.json is not None:
        _write_json(json_path, doc)
    if args.json != "-":
        converted = f", {len(report.converted):,} through transformers' converters"
        rows = [
            ["model", f"{type(model).__name__} ({model.dtype}, eval mode)"],
            ["device", str(args.device)],
            ["files", f"{report.files:,}"],
            ["tensors", f"{report.placed:,} of {report.tensors:,} straight into their "
                        f"parameters ({report.placed - report.mapped:,} read, "
                        f"{report.mapped:,} mapped from their files)"
                        + (converted if report.converted else "")
                        + (f", {len(report.skipped):,} skipped" if report.skipped else "")],
            ["parameters", f"{report.parameters:,}"],
            ["bytes", bytes_exact(report.bytes) + " read"
                      + (f", {bytes_exact(report.mapped_bytes)} mapped (read at first use)"
                         if report.mapped else "")],
            ["seconds", f"{report.total_s:.3f} (model and plan {report.prepare_s:.3f}, reads "
                        f"{report.load_s:.3f}, finishing {report.finish_s:.3f})"],
            ["GB/s", f"{report.gbps:.2f} (reads)"],
            ["peak RSS", format_bytes(rss) if rss is not None else "unknown"],
        ]  # fmt: skip
        out(f"loaded {args.path} as {type(model).__name__}:")
        out(format_table(rows, align="ll", indent="  ", terminal=sys.stdout))
    return 0


def _load_report(
    path: Path,
    p: Plan | None,
    options: LoadOptions,
    seen: Sequence[LoadStatistics],
    state: str | None,
    error: BaseException | None,
    loaded: Loaded | None = None,
) -> dict[str, Any]:
    """What ``--json`` holds: the load's statistics (the last seen, for a load that broke),
    the plan, the options and, after a failure, the error that ended the command."""
    doc: dict[str, Any] = dataclasses.asdict(seen[-1]) if seen else {}
    if state is not None:
        if doc.get("state") in (None, "loading"):  # broke before or outside the load
            doc["state"] = state
        # The error that ended the command (a load that completed keeps its state: the
        # command may have failed after it, in verification).
        doc["error"] = str(error) or type(error).__name__
    doc.update(
        gbps=seen[-1].gbps if seen else None,
        peak_rss_bytes=loaded.peak_rss if loaded is not None else peak_rss(),
        verify=loaded.verify.as_dict() if loaded is not None and loaded.verify else None,
        checkpoint=str(path),
        plan=None
        if p is None
        else {
            "bytes": p.nbytes,
            "slabs": len(p.slabs),
            "tensors_routed": len(p.routes),
            "fingerprint": p.fingerprint,
        },
        options=dataclasses.asdict(options),
    )
    return doc


def _holds_json_or_nothing(path: Path) -> bool:
    """Whether ``path`` is absent or starts as this command's reports do (as a little-endian
    header length, these bytes would claim a 538 MB header: no valid safetensors file)."""
    try:
        with path.open("rb") as f:
            return f.read(5) == b'{\n  "'
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _write_json(path: Path | None, doc: dict[str, Any]) -> None:
    """To ``path``, or to stdout when it is ``None`` (``--json -``)."""
    text = json.dumps(jsonable(doc), indent=2)
    if path is None:
        out(text)
    else:
        path.write_text(text + "\n", encoding="utf-8")


def _check_json_path(path: Path) -> None:
    """Before the load: a --json that cannot be written fails now, not after it."""
    if path.is_dir():
        raise UsageError(f"--json {path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"--json {path}: {parent} {what}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--json {path} cannot be written (permission denied)")

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

The modules beside this one: ``arguments`` (the options), ``contenders`` (what is compared,
in which modes), ``fixtures`` (the checkpoints), ``cache`` (the page cache), ``runs`` (the
worker processes and their order), ``results`` (medians, ratios, tables, figures),
``explain`` (the words under the tables), ``sized`` and ``many_small`` (the two benchmarks).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .arguments import add_arguments
from .contenders import human
from .fixtures import check_space, generate
from .many_small import bench_many_small
from .runs import log, machine
from .sized import bench_sized

__all__ = ["add_arguments", "main", "run"]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); prints the
    table and returns the exit code."""
    report: dict[str, Any] = {
        "command": sys.argv,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
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
            problem = check_space(root, need)
            if problem:
                print(f"asyncslab bench: {problem}", file=sys.stderr)
                return 2
            generated = root / f"many-small-{args.many_small_count}"
            lines, code = bench_many_small(args, root, report)
        else:
            if args.checkpoint is not None:
                checkpoint = args.checkpoint
            else:
                problem = check_space(root, int(args.size * 1.05))
                if problem:
                    print(f"asyncslab bench: {problem}", file=sys.stderr)
                    return 2
                log(f"checkpoint of {human(args.size)} under {root} (generated unless kept) ...")
                checkpoint, gen = generate(root, args.size)
                generated = checkpoint
                report["generation"] = gen
                if not gen["reused"]:
                    log(f"generated in {gen['seconds']:.2f} s ({gen['gbps']:.2f} GB/s)")
            lines, code = bench_sized(args, checkpoint, report)
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

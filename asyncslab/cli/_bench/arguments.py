"""The options of ``asyncslab bench`` (and ``python -m asyncslab.cli._bench``): what is
measured, where the checkpoint and the report go, and how each contender's run is checked
and set up."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._args import size_arg
from .contenders import CONTENDERS, MODES, VERIFY_ALL, GiB

__all__ = ["add_arguments"]


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (of ``asyncslab bench`` and ``python -m asyncslab.cli._bench``)."""
    _add_measure_arguments(parser)
    _add_output_arguments(parser)
    _add_run_arguments(parser)


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """What is measured: the checkpoint, the runs, the modes, the loader's options and the
    contenders."""
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


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the checkpoint and the report go, and the many-small checkpoint instead."""
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

"""The command line's argument types and the options several subcommands share: each value
is checked by argparse, so that a bad one is one line before anything is read or written."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .._objects import SCHEMES, ObjectPath
from .._units import parse_size
from ..loading import LoadOptions

__all__ = [
    "PATH_HELP",
    "add_load_options",
    "add_plan_arguments",
    "checkpoint_path",
    "device_arg",
    "mib_arg",
    "positive_int",
    "rank_arg",
    "size_arg",
]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > _MOST:
        # One thread, or one stream, each: a typo of many digits would make threads until
        # the process ran out of memory (test_option_values_past_any_sense_are_one_line).
        raise argparse.ArgumentTypeError(f"expected at most {_MOST}, got {text!r}")
    return value


_MOST = 1024


def rank_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a rank >= 0, got {text!r}")
    return value


def mib_arg(text: str) -> int:
    """A positive number of MiB (fractions allowed), as bytes."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB, got {text!r}")
    if value > _MOST_MIB:
        raise argparse.ArgumentTypeError(f"expected at most {_MOST_MIB} MiB (1 TiB), got {text!r}")
    return max(1, int(value * (1 << 20)))


_MOST_MIB = 1 << 20


def device_arg(text: str) -> str:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r} is not supported (cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        # Before anything is written or read (the demo would write its checkpoint first).
        raise argparse.ArgumentTypeError(f"device {text!r} requested, but CUDA is not available")
    return text


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type``: every ``--size`` (``bench``'s too) uses
    this one, so that their messages cannot drift apart."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


PATH_HELP = (
    "a .safetensors file, an index or a checkpoint directory; or the same in object storage, "
    "s3://bucket/prefix (gs://, az://; credentials from the environment, "
    "docs/object-storage.md)"
)


def checkpoint_path(text: str) -> Path:
    """The checkpoint argument: a local path, or an object-store URI kept whole."""
    scheme = text.partition("://")[0]
    if "://" in text and scheme in SCHEMES:
        return ObjectPath.of(scheme, *text.partition("://")[2].partition("/")[::2])
    return Path(text)


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The :class:`LoadOptions` a load takes from the command line, with their defaults."""
    defaults = LoadOptions()
    p.add_argument(
        "--streams",
        type=positive_int,
        default=defaults.streams,
        metavar="N",
        help=f"CUDA copy streams (default {defaults.streams})",
    )
    p.add_argument(
        "--transfer",
        choices=("auto", "direct", "staged", "mapped"),
        default=defaults.transfer,
        help="how bytes reach the slabs: direct reads (cpu), staged through pinned buffers, "
        "or mapped (copied straight out of the page cache; cuda, Linux); auto: direct on "
        "cpu, staged on cuda (default)",
    )
    p.add_argument(
        "--staging-mb",
        type=mib_arg,
        default=defaults.staging_bytes,
        metavar="MB",
        help=f"staging budget in MiB of the staged transfer, on cpu as on cuda (pinned "
        f"there); mapped reads are cut at 1/{defaults.staging_buffers} of it (default "
        f"{defaults.staging_bytes >> 20})",
    )
    p.add_argument(
        "--io-workers",
        type=positive_int,
        default=defaults.io_workers,
        metavar="N",
        help=f"reads in flight of the direct transfer (default {defaults.io_workers})",
    )
    p.add_argument(
        "--read-mb",
        type=mib_arg,
        default=defaults.read_size,
        metavar="MB",
        help=f"target size of one read in MiB, direct transfer (default "
        f"{defaults.read_size >> 20})",
    )


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tier-map",
        type=Path,
        default=None,
        metavar="FILE",
        help="declared tier map (JSON); every expert's tier is checked against it",
    )
    p.add_argument(
        "--rank", type=rank_arg, default=None, metavar="R", help="rank of a rank-sliced checkpoint"
    )

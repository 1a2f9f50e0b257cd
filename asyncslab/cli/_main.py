"""The ``asyncslab`` command: ``demo``, ``inspect``, ``load`` and ``bench``.

``asyncslab demo`` is the project's first command: it writes a synthetic EXL3-like mixed-tier
MoE checkpoint, plans it, loads it with a progress bar and checks every routed tensor
byte-for-byte against the ``safetensors`` library. ``inspect`` plans a checkpoint from its
headers alone; ``load`` loads a real one and reports throughput and memory.

Errors a user can fix (a malformed checkpoint, a bad size, a missing file) are one line on
stderr, ``asyncslab: error: ...``, and exit code 2; ``--debug`` shows the traceback instead.
A failed verification exits 1; an interrupt exits 130.

This module holds the parser and the dispatch; each subcommand lives in a module of its
own (``_demo``, ``_inspect``, ``_load``, ``_bench``), what they share in ``_common`` and
``_args``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from .._units import parse_size
from ..errors import AsyncSlabError
from ._args import (
    PATH_HELP,
    add_load_options,
    add_plan_arguments,
    checkpoint_path,
    device_arg,
    size_arg,
)
from ._common import PROG, UsageError, stderr_line
from ._demo import cmd_demo
from ._inspect import cmd_inspect
from ._load import cmd_load

__all__ = ["build_parser", "main"]


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as :class:`UsageError` (one line) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Load checkpoints straight into the slabs an inference engine computes "
        "with: plan before I/O, one pipelined async pass.",
        epilog="Start with 'asyncslab demo'.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_demo(sub, common)
    _add_inspect(sub, common)
    _add_load(sub, common)
    _add_bench(sub, common)
    return parser


def _add_demo(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="write, plan, load and verify a synthetic mixed-tier MoE checkpoint",
        description="Write the embedded synthetic EXL3-like mixed-tier MoE checkpoint, show "
        "its plan, load it with a progress bar and check every routed tensor byte for byte "
        "against the safetensors library.",
    )
    demo.add_argument(
        "--size",
        type=size_arg,
        default=parse_size("64MiB"),
        metavar="SIZE",
        help="checkpoint size, like 64MiB, 1GiB, 3GB or 500M (default: 64MiB)",
    )
    demo.add_argument(
        "--dir", type=Path, default=None, help="write here and keep it (default: a temp dir)"
    )
    demo.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    demo.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(handler=cmd_demo)


def _add_inspect(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    inspect = sub.add_parser(
        "inspect",
        parents=[common],
        help="plan a checkpoint from its headers (no payload is read)",
        description="Read a checkpoint's headers, plan it with the default rules and print "
        "files, tensors, slabs, bytes, units and the expert tiers of every layer.",
    )
    inspect.add_argument("path", type=checkpoint_path, help=PATH_HELP)
    inspect.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    add_plan_arguments(inspect)
    inspect.set_defaults(handler=cmd_inspect)


def _add_load(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    load_p = sub.add_parser(
        "load",
        parents=[common],
        help="load a checkpoint with the automatic plan and report throughput",
        description="Load a whole checkpoint into its slabs and print files, tensors, bytes, "
        "time, GB/s, peak staging and peak RSS.",
    )
    load_p.add_argument("path", type=checkpoint_path, help=PATH_HELP)
    load_p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    add_load_options(load_p)
    add_plan_arguments(load_p)
    load_p.add_argument(
        "--verify",
        action="store_true",
        help="re-read every routed tensor with safetensors and compare bytes",
    )
    load_p.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write statistics as JSON to FILE; '-' prints them on stdout instead of the "
        "table, as 'inspect --json' does (./- names a file called -)",
    )
    load_p.add_argument("--no-progress", action="store_true", help="no progress bar")
    load_p.add_argument(
        "--transformers",
        action="store_true",
        help="load PATH (a model directory or prefix with its config.json) as a transformers "
        "model, as asyncslab.transformers.from_pretrained does (docs/transformers.md)",
    )
    load_p.add_argument(
        "--dtype",
        default=None,
        help="with --transformers: cast to this dtype (default: the config's, no cast)",
    )
    load_p.add_argument(
        "--disable-mmap",
        action="store_true",
        help="with --transformers on a CPU: read every byte now, none left mapped from the "
        "files (by default a parameter one tensor fills whole is a view of its file, as "
        "transformers' own)",
    )
    load_p.set_defaults(handler=cmd_load)


def _add_bench(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    # Implemented in a subpackage of its own; imported here so that a missing or broken
    # benchmark package costs the other commands nothing.
    try:
        bench_module = importlib.import_module(f"{__package__}._bench")
        add_arguments = bench_module.add_arguments
        run = bench_module.run
    except (ImportError, AttributeError) as err:
        if isinstance(err, ImportError) and err.name == f"{__package__}._bench":
            reason = "bench is not available"
        else:
            reason = f"bench is not available: {err}"
        bench = sub.add_parser(
            "bench", parents=[common], help="benchmarks (not available)", description=reason
        )
        bench.set_defaults(handler=_unavailable(reason), accepts_extra=True)
        return
    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="benchmark loads of synthetic checkpoints",
        description="Benchmark loads of synthetic checkpoints.",
    )
    add_arguments(bench)

    def handler(args: argparse.Namespace) -> int:
        code = run(args)
        return int(code) if code is not None else 0

    bench.set_defaults(handler=handler)


def _unavailable(reason: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        raise UsageError(reason)

    return handler


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``__main__`` raises ``SystemExit``)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    try:
        try:
            parser = build_parser()
            args, extra = parser.parse_known_args(args_list)
        except SystemExit as exit_:  # --help, --version
            return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
        debug = bool(getattr(args, "debug", False))
        if extra and not getattr(args, "accepts_extra", False):
            where = f"{PROG} {args.command}" if args.command else PROG
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
        if args.command is None:
            raise UsageError(
                "missing command: demo, inspect, load or bench (see 'asyncslab --help')"
            )
        code: int = args.handler(args)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        stderr_line(f"{PROG}: interrupted")
        return 130
    except BrokenPipeError:
        # `asyncslab inspect x | head`: the reader left; say nothing more.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (UsageError, AsyncSlabError, ValueError, OSError) as err:
        if debug:
            raise
        _error(err)
        return 2
    except (MemoryError, _OUT_OF_MEMORY) as err:
        if debug:
            raise
        _error(f"out of memory: {err}")
        return 1


_OUT_OF_MEMORY: type[BaseException] = getattr(torch, "OutOfMemoryError", MemoryError)


def _error(err: BaseException | str) -> None:
    message = err if isinstance(err, str) else (str(err) or type(err).__name__)
    stderr_line(f"{PROG}: error: {message}")

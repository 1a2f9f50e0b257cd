"""The ``asyncslab`` command: ``demo``, ``inspect``, ``load`` and ``bench``.

``asyncslab demo`` is the project's first command: it writes a synthetic EXL3-like mixed-tier
MoE checkpoint, plans it, loads it with a progress bar and checks every routed tensor
byte-for-byte against the ``safetensors`` library. ``inspect`` plans a checkpoint from its
headers alone; ``load`` loads a real one and reports throughput and memory.

Errors a user can fix (a malformed checkpoint, a bad size, a missing file) are one line on
stderr, ``asyncslab: error: ...``, and exit code 2; ``--debug`` shows the traceback instead.
A failed verification exits 1; an interrupt exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import torch

from .. import _os
from .._os import peak_rss as peak_rss_bytes
from ..checkpoint import INDEX_SUFFIX, SCHEMES, Checkpoint, ObjectPath
from ..errors import AsyncSlabError, PlanError
from ..loading import LoadOptions, LoadStatistics, SlabSet, load
from ..planning import Plan, plan
from ..testing import _verify
from ..testing._synthetic import (
    SyntheticCheckpoint,
    SyntheticSpec,
    payload_bytes,
    spec_for_size,
    write_synthetic,
)
from ..testing._verify import VerifyResult
from ._progress import (
    ProgressBar,
    format_bytes,
    format_duration,
    format_table,
    parse_size,
    size_arg,
)

__all__ = ["main", "parse_size", "size_arg", "verify_slabs"]

PROG = "asyncslab"
_T = TypeVar("_T")


class UsageError(Exception):
    """Bad command line; reported as one line, exit code 2."""


# --------------------------------------------------------------------------- argument types


def _positive_int(text: str) -> int:
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


def _rank_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a rank >= 0, got {text!r}")
    return value


def _mib_arg(text: str) -> int:
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


def _device_arg(text: str) -> str:
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
    demo.add_argument("--device", type=_device_arg, default="cpu", help="cpu or cuda[:N]")
    demo.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(handler=_cmd_demo)

    inspect = sub.add_parser(
        "inspect",
        parents=[common],
        help="plan a checkpoint from its headers (no payload is read)",
        description="Read a checkpoint's headers, plan it with the default rules and print "
        "files, tensors, slabs, bytes, units and the expert tiers of every layer.",
    )
    inspect.add_argument("path", type=_checkpoint_path, help=_PATH_HELP)
    inspect.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    _add_plan_arguments(inspect)
    inspect.set_defaults(handler=_cmd_inspect)

    load_p = sub.add_parser(
        "load",
        parents=[common],
        help="load a checkpoint with the automatic plan and report throughput",
        description="Load a whole checkpoint into its slabs and print files, tensors, bytes, "
        "time, GB/s, peak staging and peak RSS.",
    )
    load_p.add_argument("path", type=_checkpoint_path, help=_PATH_HELP)
    load_p.add_argument("--device", type=_device_arg, default="cpu", help="cpu or cuda[:N]")
    _add_load_options(load_p)
    _add_plan_arguments(load_p)
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
    load_p.set_defaults(handler=_cmd_load)

    _add_bench(sub, common)
    return parser


def _add_load_options(p: argparse.ArgumentParser) -> None:
    """The :class:`LoadOptions` a load takes from the command line, with their defaults."""
    defaults = LoadOptions()
    p.add_argument(
        "--streams",
        type=_positive_int,
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
        type=_mib_arg,
        default=defaults.staging_bytes,
        metavar="MB",
        help=f"staging budget in MiB of the staged transfer, on cpu as on cuda (pinned "
        f"there); mapped reads are cut at 1/{defaults.staging_buffers} of it (default "
        f"{defaults.staging_bytes >> 20})",
    )
    p.add_argument(
        "--io-workers",
        type=_positive_int,
        default=defaults.io_workers,
        metavar="N",
        help=f"reads in flight of the direct transfer (default {defaults.io_workers})",
    )
    p.add_argument(
        "--read-mb",
        type=_mib_arg,
        default=defaults.read_size,
        metavar="MB",
        help=f"target size of one read in MiB, direct transfer (default "
        f"{defaults.read_size >> 20})",
    )


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tier-map",
        type=Path,
        default=None,
        metavar="FILE",
        help="declared tier map (JSON); every expert's tier is checked against it",
    )
    p.add_argument(
        "--rank", type=_rank_arg, default=None, metavar="R", help="rank of a rank-sliced checkpoint"
    )


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
        _stderr_line(f"{PROG}: interrupted")
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


def _stderr_line(text: str) -> None:
    line = text.replace("\r", " ").replace("\n", " ")
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _error(err: BaseException | str) -> None:
    message = err if isinstance(err, str) else (str(err) or type(err).__name__)
    _stderr_line(f"{PROG}: error: {message}")


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on uvloop when it is installed (servers use it), else on asyncio."""
    _fill_closed_std_fds()
    return _os.run(coro)


def _fill_closed_std_fds() -> None:
    """Open /dev/null on a closed fd 0, 1 or 2 (`asyncslab load ... <&-`): the loop's own fds
    would take those numbers, and libuv aborts the process (an assertion) on closing one."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


# --------------------------------------------------------------------------- shared pieces


_PATH_HELP = (
    "a .safetensors file, an index or a checkpoint directory; or the same in object storage, "
    "s3://bucket/prefix (gs://, az://; credentials from the environment, "
    "docs/object-storage.md)"
)


def _checkpoint_path(text: str) -> Path:
    """The checkpoint argument: a local path, or an object-store URI kept whole."""
    scheme = text.partition("://")[0]
    if "://" in text and scheme in SCHEMES:
        return ObjectPath.of(scheme, *text.partition("://")[2].partition("/")[::2])
    return Path(text)


def _open_and_plan(
    path: Path, *, tier_map: Path | Mapping[int, Mapping[int, int]] | None, rank: int | None
) -> tuple[Checkpoint, Plan]:
    # A URI: Checkpoint.open says what is wrong with it.
    if not isinstance(path, ObjectPath) and not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_file() and path.name.endswith(".json") and not path.name.endswith(INDEX_SUFFIX):
        # A tier map passed as the checkpoint, say: said before opening, in the command
        # line's words. (An index opens the checkpoint it lists.)
        raise UsageError(f"{path} is a JSON file, not a safetensors checkpoint or index")
    if isinstance(tier_map, Path) and tier_map.is_dir():
        raise UsageError(f"{tier_map} is a directory, not a tier map file")
    if isinstance(tier_map, Path) and not tier_map.is_file():
        raise FileNotFoundError(f"{tier_map}: tier map file does not exist")
    checkpoint = Checkpoint.open(str(path) if isinstance(path, ObjectPath) else path)
    try:
        return checkpoint, plan(checkpoint, tier_map=tier_map, rank=rank)
    except PlanError as err:
        n_ranks = err.details.get("ranks")
        if rank is None and isinstance(n_ranks, int):  # in the command line's words
            raise UsageError(
                f"{path} is rank-sliced into {n_ranks} ranks: pass --rank (0..{n_ranks - 1})"
            ) from err
        raise


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def tier_table(p: Plan, indent: str = "  ") -> str | None:
    """``layer | K3 | K4 | ... | experts | expert bytes``; ``None`` when nothing is tiered."""
    tiers: Mapping[int, Mapping[str, int]] = p.extras.get("tiers") or {}
    if not tiers:
        return None
    groups = sorted({g for counts in tiers.values() for g in counts}, key=_natural)
    expert_bytes: dict[str, int] = defaultdict(int)
    for spec in p.slabs.values():
        if spec.labels.get("kind") == "experts":
            expert_bytes[spec.labels.get("layer", "")] += spec.nbytes
    rows: list[list[Any]] = []
    totals = [0] * len(groups)
    for layer, counts in sorted(tiers.items()):
        cells = [counts.get(g, 0) for g in groups]
        totals = [t + c for t, c in zip(totals, cells, strict=True)]
        rows.append([layer, *cells, sum(cells), format_bytes(expert_bytes[str(layer)])])
    rows.append(["all", *totals, sum(totals), format_bytes(sum(expert_bytes.values()))])
    headers = ["layer", *groups, "experts", "expert bytes"]
    return format_table(rows, headers, align="r" * len(headers), indent=indent)


def _checkpoint_info(path: Path, checkpoint: Checkpoint) -> dict[str, Any]:
    def name(p: Path) -> str:
        try:
            return str(p.relative_to(checkpoint.root))
        except ValueError:
            return str(p)

    return {
        "path": str(path),
        "index": name(checkpoint.index) if checkpoint.index is not None else None,
        "files": [
            {
                "name": name(f.path),
                "bytes": f.size,
                "payload_bytes": f.size - f.data_start,
                "tensors": len(f.tensors),
            }
            for f in checkpoint.files
        ],
        "tensors": len(checkpoint),
        "payload_bytes": checkpoint.total_bytes,
    }


def _bytes_exact(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)"


def _plan_rows(p: Plan, checkpoint: Checkpoint) -> list[list[Any]]:
    return [
        [
            "tensors",
            f"{len(checkpoint):,}: {len(p.routes):,} routed, {len(p.checked):,} checked "
            f"(markers), {len(p.skipped):,} skipped",
        ],
        ["slabs", f"{len(p.slabs):,}"],
        ["units", f"{len(p.units):,}"],
        [
            "bytes",
            f"{_bytes_exact(p.nbytes)} to load, of {format_bytes(checkpoint.total_bytes)} payload",
        ],
        ["fingerprint", p.fingerprint],
    ]


def _files_table(info: Mapping[str, Any], indent: str = "  ") -> str:
    files = sorted(info["files"], key=lambda f: _natural(f["name"]))
    rows = [[f["name"], f["tensors"], format_bytes(f["bytes"])] for f in files]
    return format_table(rows, ["file", "tensors", "bytes"], align="lrr", indent=indent)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# --------------------------------------------------------------------------- verification


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
class _Loaded:
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
) -> _Loaded:
    slabs = await load(checkpoint, p, device=device, options=options, progress=progress)
    async with slabs:
        stats = slabs.statistics()
        rss = peak_rss_bytes()
        result = None
        if verify:
            # On a thread, so that Ctrl-C (which cancels this task) is heard at once; the
            # thread stops before its next tensor.
            stop = threading.Event()
            try:
                result = await asyncio.to_thread(verify_slabs, p, slabs, stop)
            finally:
                stop.set()
    return _Loaded(stats, rss, result)


def _run_load(
    checkpoint: Checkpoint,
    p: Plan,
    *,
    device: str,
    options: LoadOptions,
    show_progress: bool,
    verify: bool,
    seen: list[LoadStatistics] | None = None,
) -> _Loaded:
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


def _result_rows(loaded: _Loaded, p: Plan, *, verify_row: bool = True) -> list[list[Any]]:
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
        ["bytes", _bytes_exact(stats.bytes_landed)],
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


def _out(text: str = "", stream: TextIO | None = None) -> None:
    print(text, file=stream if stream is not None else sys.stdout, flush=True)


# --------------------------------------------------------------------------- demo


@contextlib.contextmanager
def _demo_directory(directory: Path | None, keep: bool) -> Iterator[tuple[Path, bool]]:
    """``(path, kept)``: the given directory, a kept temp dir, or one removed afterwards."""
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        yield directory, True
    elif keep:
        yield Path(tempfile.mkdtemp(prefix="asyncslab-demo-")), True
    else:
        with tempfile.TemporaryDirectory(prefix="asyncslab-demo-") as tmp:
            yield Path(tmp), False


_DEMO_MARK = ".asyncslab-demo"


def _check_demo_directory(root: Path, size: int) -> None:
    """Refuse to write the demo over another checkpoint (one a demo wrote may be replaced),
    or to fill the disk."""
    found = sorted(p.name for p in root.iterdir() if p.name.endswith((".safetensors", ".json")))
    if found and not (root / _DEMO_MARK).exists():
        raise UsageError(
            f"{root} already holds a checkpoint not written by the demo "
            f"({', '.join(found[:3])}); choose an empty directory"
        )
    free = shutil.disk_usage(root).free
    if free < size * 1.1:
        raise UsageError(
            f"not enough free space in {root} for a {format_bytes(size)} checkpoint "
            f"({format_bytes(free)} free); use a smaller --size or --dir elsewhere"
        )


def _describe_spec(spec: SyntheticSpec) -> str:
    n_moe = spec.n_layers - spec.first_dense
    tiers = "/".join(f"K{b}" for b in sorted(spec.bits))
    return (
        f"{spec.n_layers} layers ({spec.first_dense} dense, {n_moe} MoE), {spec.n_experts} "
        f"experts per MoE layer ({tiers} bits), hidden {spec.hidden}, expert intermediate "
        f"{spec.intermediate}, {spec.n_shards} shards, {spec.fill} fill"
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    asked: int = args.size
    spec = spec_for_size(asked)
    # The smallest model the demo writes is ~2 MiB, whatever was asked: announcing the
    # request would promise less than the disk is about to get.
    size = payload_bytes(spec)
    raised = (
        f" (--size {format_bytes(asked)} is below the smallest the demo writes)"
        if size > asked * 1.1
        else ""
    )
    _out(
        "asyncslab demo: a synthetic EXL3-like mixed-tier MoE checkpoint of "
        f"{format_bytes(size)}{raised}"
    )
    _out(f"model: {_describe_spec(spec)}")
    with _demo_directory(args.dir, args.keep) as (root, kept):
        _check_demo_directory(root, size)
        for stale in (*root.glob("*.safetensors"), *root.glob("*.json")):
            stale.unlink()  # an earlier demo's (checked above): no shard of it left behind
        (root / _DEMO_MARK).touch()
        started = time.perf_counter()
        written: SyntheticCheckpoint = write_synthetic(root, spec)
        write_s = time.perf_counter() - started
        _out()
        _out(
            f"wrote {root}: {len(written.files)} files, {written.n_tensors:,} tensors, "
            f"{_bytes_exact(written.total_bytes)} in {format_duration(write_s)}"
        )

        checkpoint, p = _open_and_plan(root, tier_map=written.tier_map_path, rank=None)
        info = _checkpoint_info(root, checkpoint)
        _out(_files_table(info))
        _out()
        _out(
            "plan (headers only; each expert's tier read from its trellis shape and checked "
            f"against {written.tier_map_path.name}):"
        )
        _out(format_table(_plan_rows(p, checkpoint), align="ll", indent="  "))
        table = tier_table(p)
        if table is not None:
            _out()
            _out("experts per tier, per layer (one slab per tier, projection and suffix):")
            _out(table)
        _out()
        _out(f"loading into {args.device} slabs ...")
        loaded = _run_load(
            checkpoint,
            p,
            device=args.device,
            options=LoadOptions(),
            show_progress=not args.no_progress,
            verify=True,
        )
        verify = loaded.verify
        assert verify is not None
        _out()
        _out("result:")
        # The verdict is the last line below, not a row here too.
        _out(format_table(_result_rows(loaded, p, verify_row=False), align="ll", indent="  "))
        _out()
        if kept:
            # With the tier map, or the suggested load would check less than the demo did.
            command = ["asyncslab", "load", str(root), "--verify"]
            again = shlex.join([*command, "--tier-map", str(written.tier_map_path)])
            _out(f"kept {root}; load it again with: {again}")
        else:
            _out(f"removed {root}")
    if not verify.ok:
        _stderr_line(f"{PROG}: verify failed: {verify.describe()}")
        return 1
    _out(f"OK: {verify.describe()} (verified in {verify.seconds:.2f}s)")
    return 0


# --------------------------------------------------------------------------- inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    path: Path = args.path
    checkpoint, p = _open_and_plan(path, tier_map=args.tier_map, rank=args.rank)
    info = _checkpoint_info(path, checkpoint)
    if args.json:
        doc = {**p.summary(), "checkpoint": info}
        _out(json.dumps(_jsonable(doc), indent=2))
        return 0
    index = f" (index {info['index']})" if info["index"] else ""
    payload = format_bytes(info["payload_bytes"])
    _out(f"checkpoint {path}{index}: {len(info['files'])} files, {payload} payload")
    _out(_files_table(info))
    _out()
    _out("plan (default rules; headers only, no payload read):")
    _out(format_table(_plan_rows(p, checkpoint), align="ll", indent="  "))
    table = tier_table(p)
    _out()
    if table is None:
        _out("tiers per layer: none (no tiered MoE expert tensors)")
    else:
        _out("tiers per layer:")
        _out(table)
    return 0


# --------------------------------------------------------------------------- load


def _cmd_load(args: argparse.Namespace) -> int:
    path: Path = args.path
    if args.transformers:
        return _cmd_load_transformers(args)
    if args.dtype is not None:
        raise UsageError("--dtype applies to --transformers only")
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
        checkpoint, p = _open_and_plan(path, tier_map=args.tier_map, rank=args.rank)
        listed = {f.path.resolve() for f in p.files}
        if checkpoint.index is not None:
            listed.add(checkpoint.index.resolve())
        if json_path is not None and json_path.resolve() in listed:
            json_path = None  # not overwritten with the failure either
            raise UsageError(f"--json {args.json} is a file of the checkpoint")
        loaded = _run_load(
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
    verify = loaded.verify
    # The JSON and the verdict first: a reader of stdout that left early loses neither.
    if verify is not None and not verify.ok:
        _stderr_line(f"{PROG}: verify failed: {verify.describe()}")
    try:
        if json_path is not None or to_stdout:
            report = _load_report(path, p, options, [loaded.stats], None, None, loaded)
            _write_json(json_path, report)
        if not to_stdout:
            _out(f"loaded {path}:")
            _out(format_table(_result_rows(loaded, p), align="ll", indent="  "))
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
            io_workers=args.io_workers,
            read_size=args.read_mb,
            staging_bytes=args.staging_mb,
            streams=args.streams,
            transfer=args.transfer,
        )
    finally:
        if bar is not None:
            bar.finish()
    rss = peak_rss_bytes()
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
            ["tensors", f"{report.placed:,} of {report.tensors:,} read into their parameters"
                        + (converted if report.converted else "")
                        + (f", {len(report.skipped):,} skipped" if report.skipped else "")],
            ["parameters", f"{report.parameters:,}"],
            ["bytes", _bytes_exact(report.bytes)],
            ["seconds", f"{report.total_s:.3f} (model and plan {report.prepare_s:.3f}, reads "
                        f"{report.load_s:.3f}, finishing {report.finish_s:.3f})"],
            ["GB/s", f"{report.gbps:.2f} (reads)"],
            ["peak RSS", format_bytes(rss) if rss is not None else "unknown"],
        ]  # fmt: skip
        _out(f"loaded {args.path} as {type(model).__name__}:")
        _out(format_table(rows, align="ll", indent="  "))
    return 0


def _load_report(
    path: Path,
    p: Plan | None,
    options: LoadOptions,
    seen: Sequence[LoadStatistics],
    state: str | None,
    error: BaseException | None,
    loaded: _Loaded | None = None,
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
        peak_rss_bytes=loaded.peak_rss if loaded is not None else peak_rss_bytes(),
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
    text = json.dumps(_jsonable(doc), indent=2)
    if path is None:
        _out(text)
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

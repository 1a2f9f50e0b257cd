"""``asyncslab demo``, the project's first command: it writes a synthetic EXL3-like
mixed-tier MoE checkpoint, shows its plan, loads it with a progress bar and checks every
routed tensor byte for byte against the ``safetensors`` library."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .._units import format_bytes, format_duration
from ..checkpoint import Checkpoint
from ..loading import LoadOptions
from ..planning import Plan
from ..testing import spec_for_size
from ..testing._synthetic import SyntheticCheckpoint, SyntheticSpec, payload_bytes, write_synthetic
from ._common import PROG, UsageError, bytes_exact, out, stderr_line
from ._inspect import checkpoint_info, files_table, open_and_plan, plan_rows, tier_table
from ._load import result_rows, run_load
from ._tables import format_table

__all__ = ["cmd_demo"]


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


def _plan_and_show(root: Path, written: SyntheticCheckpoint) -> tuple[Checkpoint, Plan]:
    """The written checkpoint planned from its headers; its files, plan and tiers shown."""
    checkpoint, p = open_and_plan(root, tier_map=written.tier_map_path, rank=None)
    info = checkpoint_info(root, checkpoint)
    out(files_table(info, terminal=sys.stdout))
    out()
    out(
        "plan (headers only; each expert's tier read from its trellis shape and checked "
        f"against {written.tier_map_path.name}):"
    )
    out(format_table(plan_rows(p, checkpoint), align="ll", indent="  ", terminal=sys.stdout))
    table = tier_table(p, terminal=sys.stdout)
    if table is not None:
        out()
        out("experts per tier, per layer (one slab per tier, projection and suffix):")
        out(table)
    return checkpoint, p


def cmd_demo(args: argparse.Namespace) -> int:
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
    out(
        "asyncslab demo: a synthetic EXL3-like mixed-tier MoE checkpoint of "
        f"{format_bytes(size)}{raised}"
    )
    out(f"model: {_describe_spec(spec)}")
    with _demo_directory(args.dir, args.keep) as (root, kept):
        _check_demo_directory(root, size)
        for stale in (*root.glob("*.safetensors"), *root.glob("*.json")):
            stale.unlink()  # an earlier demo's (checked above): no shard of it left behind
        (root / _DEMO_MARK).touch()
        started = time.perf_counter()
        written: SyntheticCheckpoint = write_synthetic(root, spec)
        write_s = time.perf_counter() - started
        out()
        out(
            f"wrote {root}: {len(written.files)} files, {written.n_tensors:,} tensors, "
            f"{bytes_exact(written.total_bytes)} in {format_duration(write_s)}"
        )
        checkpoint, p = _plan_and_show(root, written)
        out()
        out(f"loading into {args.device} slabs ...")
        loaded = run_load(
            checkpoint,
            p,
            device=args.device,
            options=LoadOptions(),
            show_progress=not args.no_progress,
            verify=True,
        )
        verify = loaded.verify
        assert verify is not None
        out()
        out("result:")
        # The verdict is the last line below, not a row here too.
        rows = result_rows(loaded, p, verify_row=False)
        out(format_table(rows, align="ll", indent="  ", terminal=sys.stdout))
        out()
        if kept:
            # With the tier map, or the suggested load would check less than the demo did.
            command = ["asyncslab", "load", str(root), "--verify"]
            again = shlex.join([*command, "--tier-map", str(written.tier_map_path)])
            out(f"kept {root}; load it again with: {again}")
        else:
            out(f"removed {root}")
    if not verify.ok:
        stderr_line(f"{PROG}: verify failed: {verify.describe()}")
        return 1
    out(f"OK: {verify.describe()} (verified in {verify.seconds:.2f}s)")
    return 0

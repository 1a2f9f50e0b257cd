"""``asyncslab inspect``: a checkpoint planned from its headers alone, and the tables that
show a plan (the demo shows its plan with them too). :func:`open_and_plan` is every
subcommand's first step: the checkpoint opened and planned, its problems said in the command
line's words."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from .._objects import ObjectPath
from .._units import format_bytes
from ..checkpoint import INDEX_SUFFIX, Checkpoint
from ..errors import PlanError
from ..planning import Plan, plan
from ._common import UsageError, bytes_exact, jsonable, out
from ._tables import format_table

__all__ = [
    "checkpoint_info",
    "cmd_inspect",
    "files_table",
    "open_and_plan",
    "plan_rows",
    "tier_table",
]


def open_and_plan(
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


def tier_table(p: Plan, indent: str = "  ", terminal: TextIO | None = None) -> str | None:
    """``layer | K3 | K4 | ... | experts | expert bytes``; ``None`` when nothing is tiered.
    ``terminal``: the stream it is printed on (:func:`format_table`)."""
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
    return format_table(rows, headers, align="r" * len(headers), indent=indent, terminal=terminal)


def checkpoint_info(path: Path, checkpoint: Checkpoint) -> dict[str, Any]:
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


def plan_rows(p: Plan, checkpoint: Checkpoint) -> list[list[Any]]:
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
            f"{bytes_exact(p.nbytes)} to load, of {format_bytes(checkpoint.total_bytes)} payload",
        ],
        ["fingerprint", p.fingerprint],
    ]


def files_table(info: Mapping[str, Any], indent: str = "  ", terminal: TextIO | None = None) -> str:
    files = sorted(info["files"], key=lambda f: _natural(f["name"]))
    rows = [[f["name"], f["tensors"], format_bytes(f["bytes"])] for f in files]
    headers = ["file", "tensors", "bytes"]
    return format_table(rows, headers, align="lrr", indent=indent, terminal=terminal)


def cmd_inspect(args: argparse.Namespace) -> int:
    path: Path = args.path
    checkpoint, p = open_and_plan(path, tier_map=args.tier_map, rank=args.rank)
    info = checkpoint_info(path, checkpoint)
    if args.json:
        doc = {**p.summary(), "checkpoint": info}
        out(json.dumps(jsonable(doc), indent=2))
        return 0
    index = f" (index {info['index']})" if info["index"] else ""
    payload = format_bytes(info["payload_bytes"])
    out(f"checkpoint {path}{index}: {len(info['files'])} files, {payload} payload")
    out(files_table(info, terminal=sys.stdout))
    out()
    out("plan (default rules; headers only, no payload read):")
    out(format_table(plan_rows(p, checkpoint), align="ll", indent="  ", terminal=sys.stdout))
    table = tier_table(p, terminal=sys.stdout)
    out()
    if table is None:
        out("tiers per layer: none (no tiered MoE expert tensors)")
    else:
        out("tiers per layer:")
        out(table)
    return 0

"""The checkpoints ``asyncslab bench`` loads: the synthetic one of a given size (reused when
kept), the many-small-tensor one, and the disk space each needs."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contenders import MiB, human

__all__ = ["ManySmall", "check_space", "generate", "write_many_small"]


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


def generate(root: Path, size: int, workers: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Generate (or reuse) the synthetic checkpoint of ``size`` bytes under ``root``, with
    ``workers`` processes (default: one per two CPUs, at most one per shard)."""
    from ...testing import spec_for_size
    from ...testing._synthetic import write_synthetic

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


def check_space(directory: Path, need: int) -> str | None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if need + 256 * MiB > free:
        return (
            f"not enough disk space in {directory}: the checkpoint needs ~{human(need)}, "
            f"{human(free)} free (use --dir elsewhere or a smaller --size)"
        )
    return None

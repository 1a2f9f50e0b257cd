"""How long ``Checkpoint.open`` takes on a checkpoint of many tensors.

    python -m benchmarks.open_headers [--tensors 1000000] [--files 64] [--runs 3]

Writes (once, into --dir) a checkpoint of --tensors tensors over --files files named like a
tensor-parallel-sliced GLM-5.2 EXL3 checkpoint, each tensor 2 bytes so the headers dominate,
laid out as safetensors and transformers write them (entries in name order within a file;
an indented index with sorted keys, so not in file order); then opens it --runs times in
this process and prints each time and the median. Headers only: no payload is read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

from asyncslab import Checkpoint

PROJS = ("gate_proj", "up_proj", "down_proj")
SUFFIXES = ("trellis", "suh", "svh", "mcg", "mul1")


def names(total: int) -> list[str]:
    """GLM-5.2-like names: layers x 256 experts x 3 projections x 4 ranks x 5 suffixes."""
    out: list[str] = []
    layer = 0
    while len(out) < total:
        for expert in range(256):
            for proj in PROJS:
                for rank in range(4):
                    for suffix in SUFFIXES:
                        base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                        out.append(f"{base}.rank{rank}.{suffix}")
        layer += 1
    return out[:total]


def write(root: Path, total: int, files: int) -> None:
    all_names = names(total)
    per = -(-total // files)
    weight_map: dict[str, str] = {}
    for f in range(files):
        # As safetensors writes a file: one dtype, so entries and offsets in name order.
        chunk = sorted(all_names[f * per : (f + 1) * per])
        header = {
            name: {"dtype": "I16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]}
            for i, name in enumerate(chunk)
        }
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        file_name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        with open(root / file_name, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob + bytes(2 * len(chunk)))
        weight_map.update(dict.fromkeys(chunk, file_name))
    # As transformers writes an index: sorted keys, indented, so not in the files' order.
    index = {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="reuse/keep the checkpoint here")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="asyncslab-headers-"))
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        write(root, args.tensors, args.files)
        took = time.perf_counter() - t0
        print(f"wrote {args.tensors:,} tensors in {args.files} files in {took:.1f} s")
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        ckpt = Checkpoint.open(root)
        times.append(time.perf_counter() - t0)
        tensors, files = len(ckpt), len(ckpt.files)
        del ckpt  # freeing a million objects is not part of the next run's opening
    print(
        f"Checkpoint.open: {tensors:,} tensors, {files} files: "
        + ", ".join(f"{t:.2f} s" for t in times)
        + f"; median {statistics.median(times):.2f} s "
        f"({tensors / statistics.median(times) / 1e6:.2f} M tensors/s); load average "
        f"{os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()

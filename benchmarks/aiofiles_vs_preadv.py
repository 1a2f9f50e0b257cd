"""The read primitive, measured: aiofiles against ``os.preadv`` on a thread pool.

    pip install -e '.[bench]'   # aiofiles
    python -m benchmarks.aiofiles_vs_preadv [--size 512MiB] [--runs 3]

Writes a synthetic checkpoint, plans it, then reads every routed tensor's bytes into
preallocated, pre-touched slabs three ways, warm page cache, same process, interleaved:
- ``preadv``: asyncslab's own path (coalesced reads scattered into the slots);
- ``aiofiles``: one task and aiofiles handle per file (files in parallel), ``seek`` +
  ``readinto`` per tensor, since aiofiles has no positional or scatter read; every call is a
  hop to its thread pool;
- ``aiofiles-coalesced``: asyncslab's coalesced reads, one at a time, through aiofiles into
  a bounce buffer, then copied into the slots (one extra copy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import aiofiles
import torch

import asyncslab
import asyncslab.testing
from asyncslab import LoadOptions
from asyncslab._units import parse_size
from asyncslab.loading._read import byte_view
from asyncslab.loading._schedule import schedule


async def via_aiofiles(plan: asyncslab.Plan, slabs: asyncslab.SlabSet) -> None:
    by_file: dict[Path, list[asyncslab.rules.Route]] = defaultdict(list)
    for route in plan.routes:
        by_file[route.file].append(route)

    sink = slabs.loads.current.sink  # where each route lands: the backing, an offset
    assert sink.backing is not None
    view = byte_view(sink.backing.data_ptr(), sink.backing.numel())

    async def one_file(path: Path, routes: list[asyncslab.rules.Route]) -> None:
        async with aiofiles.open(path, "rb", buffering=0) as f:
            for r in routes:
                start = sink.route_base[plan._index[r.tensor]] + r.dst_offset
                await f.seek(r.src_offset)
                await f.readinto(view[start : start + r.nbytes])

    async with asyncio.TaskGroup() as tg:
        for path, routes in by_file.items():
            tg.create_task(one_file(path, routes))


async def via_aiofiles_coalesced(plan: asyncslab.Plan, slabs: asyncslab.SlabSet) -> None:
    sched = schedule(plan, max_read=16 << 20, gap=64 << 10)
    bounce = bytearray(16 << 20)
    sink = slabs.loads.current.sink
    backing = sink.backing
    assert backing is not None
    handles = {i: await aiofiles.open(f.path, "rb", buffering=0) for i, f in enumerate(plan.files)}
    try:
        for op in sched.ops:
            f = handles[op.file]
            await f.seek(op.offset)
            view = memoryview(bounce)[: op.nbytes]
            await f.readinto(view)
            src = torch.frombuffer(bounce, dtype=torch.uint8, count=op.nbytes)
            for route, read_offset, dst_offset, nbytes in op.pieces:
                start = sink.route_base[route] + dst_offset
                backing[start : start + nbytes].copy_(src[read_offset : read_offset + nbytes])
    finally:
        for f in handles.values():
            await f.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=512 << 20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        asyncslab.testing.write_synthetic(d, asyncslab.testing.spec_for_size(args.size))
        ckpt = asyncslab.Checkpoint.open(d)
        plan = asyncslab.plan(ckpt)
        slabs = asyncslab.SlabSet(plan)
        backing = slabs.loads.current.sink.backing
        assert backing is not None
        backing.fill_(1)  # pre-touched: measure the reads, not page faults
        await slabs.load(ckpt)  # warms the page cache
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.runs):
            for name in ("preadv", "aiofiles", "aiofiles-coalesced"):
                slabs.reset()
                t0 = time.perf_counter()
                if name == "preadv":
                    await slabs.load(ckpt, options=LoadOptions())
                elif name == "aiofiles":
                    await via_aiofiles(plan, slabs)
                else:
                    await via_aiofiles_coalesced(plan, slabs)
                times[name].append(time.perf_counter() - t0)
        print(
            f"{plan.nbytes / 2**20:.0f} MiB, {len(plan.routes)} tensors, warm cache, "
            f"pre-touched slabs, {args.runs} runs (median)"
        )
        base = statistics.median(times["preadv"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"  {name:20s} {m:7.3f} s  {plan.nbytes / m / 1e9:6.2f} GB/s  x{m / base:.2f}")
        await slabs.aclose()


if __name__ == "__main__":
    asyncio.run(main())

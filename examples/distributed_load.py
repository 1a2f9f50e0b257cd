"""Load one checkpoint on every rank of a ``torch.distributed`` group and print each rank's
figures: bytes its plan needs, bytes it read from storage, bytes it received from / sent
to the group, wall time and peak RSS.

    torchrun --nproc-per-node 2 examples/distributed_load.py                  # replicated
    torchrun --nproc-per-node 2 examples/distributed_load.py --mode experts --share-reads
    torchrun --nproc-per-node 2 examples/distributed_load.py --mode pre-sliced --cold

Without ``--checkpoint``, rank 0 generates a synthetic tiered-MoE checkpoint of
``--size-mib`` (sliced per rank for ``--mode pre-sliced``) under ``--workdir`` — in a child
process, so its memory does not count in rank 0's peak RSS — while the other ranks wait on
a barrier; later runs reuse it. ``--cold`` evicts the checkpoint's files from the page
cache before loading (``posix_fadvise(DONTNEED)``, once per node), so reads hit storage.

Backend: NCCL with one GPU per local rank when CUDA has enough devices (slabs on
``cuda:LOCAL_RANK``), else gloo with slabs in host memory. The multi-GPU (NCCL) path was
not run where this example was written (no GPUs there); the gloo path was.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import asyncslab
import asyncslab.testing
from asyncslab import Checkpoint, LoadOptions, SlabSet, distributed
from asyncslab.testing import spec_for_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, help="a .safetensors file or directory")
    p.add_argument("--mode", choices=distributed.MODES, default="replicated")
    p.add_argument("--share-reads", action="store_true", help="read each byte once per group")
    p.add_argument("--chunk-mib", type=int, default=16, help="broadcast chunk size")
    p.add_argument(
        "--coalesce-gap-kib",
        type=int,
        default=LoadOptions().coalesce_gap >> 10,
        help="largest unneeded gap read through rather than split (0: read only what is "
        "needed; sliced checkpoints interleave ranks' slices, so the default may read "
        "other ranks' bytes)",
    )
    p.add_argument("--size-mib", type=int, default=256, help="size of a generated checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/asyncslab-distributed"))
    p.add_argument("--cold", action="store_true", help="evict the files from the page cache")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, s")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--verify", action="store_true", help="compare with safetensors reads")
    p.add_argument("--json", type=Path, help="rank 0 writes every rank's figures here")
    return p.parse_args(argv)


def _generate(root: str, size: int, tp_ranks: int) -> None:
    asyncslab.testing.write_synthetic(root, spec_for_size(size, tp_ranks=tp_ranks))
    (Path(root) / ".complete").touch()


def checkpoint_path(args: argparse.Namespace, world: int) -> Path:
    """The checkpoint to load; rank 0 generates it if none was given (the others wait)."""
    if args.checkpoint is not None:
        return args.checkpoint
    tp = world if args.mode == "pre-sliced" else 1
    root = args.workdir / f"synthetic-{args.size_mib}MiB-tp{tp}"
    if dist.get_rank() == 0 and not (root / ".complete").exists():
        started = time.perf_counter()
        child = multiprocessing.get_context("spawn").Process(
            target=_generate, args=(str(root), args.size_mib << 20, tp)
        )
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"generating the checkpoint failed (exit code {child.exitcode})")
        print(f"generated {root} in {time.perf_counter() - started:.1f} s", flush=True)
    dist.barrier()
    return root


def evict(checkpoint: Checkpoint) -> None:
    for shard in checkpoint.files:
        fd = os.open(shard.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def verify(slabs: SlabSet, checkpoint: Checkpoint) -> int:
    """Every slot equals the bytes safetensors reads for it; returns the number checked."""
    from asyncslab.testing import verify_slabs

    result = verify_slabs(slabs.plan, slabs)
    if not result.ok:
        raise SystemExit(f"rank {dist.get_rank()}: {result.describe()}")
    return result.tensors


def _mib(n: int) -> str:
    return f"{n / 2**20:9.1f}"


def print_table(result: distributed.DistributedLoad, args: argparse.Namespace) -> None:
    print(
        f"mode {args.mode}, share_reads={args.share_reads}, {result.world} ranks, "
        f"backend {dist.get_backend()}, fingerprint {result.fingerprint}"
    )
    print(" rank  needed MiB   read MiB  recv MiB  sent MiB  reads  wall s  peak RSS MiB")
    for r in result.ranks:
        print(
            f" {r.rank:4d}  {_mib(r.bytes_needed)}  {_mib(r.bytes_read)} {_mib(r.bytes_received)}"
            f" {_mib(r.bytes_sent)} {r.reads:6d} {r.elapsed_s:7.3f}  {_mib(r.peak_rss)}"
        )
    total_needed = sum(r.bytes_needed for r in result.ranks)
    print(
        f"  all  {_mib(total_needed)}  {_mib(result.bytes_read)}"
        f"{'':20s}  wall {max(r.elapsed_s for r in result.ranks):.3f} s",
        flush=True,
    )


async def run(args: argparse.Namespace, root: Path, device: str) -> None:
    checkpoint = Checkpoint.open(root)
    if args.cold and int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        evict(checkpoint)
    plan = distributed.rank_plan(checkpoint, mode=args.mode)
    dist.barrier()  # start together: the figures time the load, not the stragglers
    result = await distributed.load(
        checkpoint,
        plan,
        share_reads=args.share_reads,
        device=device,
        options=LoadOptions(coalesce_gap=args.coalesce_gap_kib << 10),
        chunk_bytes=args.chunk_mib << 20,
    )
    async with result:
        if args.verify:
            checked = verify(result.slabs, checkpoint)
            print(f"rank {result.rank}: {checked} tensors bit-identical to the file", flush=True)
        if result.rank == 0:
            print_table(result, args)
            if args.json is not None:
                figures = {
                    "mode": args.mode,
                    "share_reads": args.share_reads,
                    "cold": args.cold,
                    "coalesce_gap": args.coalesce_gap_kib << 10,
                    "chunk_bytes": args.chunk_mib << 20,
                    "world": result.world,
                    "checkpoint_bytes": checkpoint.total_bytes,
                    "ranks": [dataclasses.asdict(r) for r in result.ranks],
                }
                args.json.write_text(json.dumps(figures, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = args.backend
    if backend == "auto":
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if enough_gpus else "gloo"
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        root = checkpoint_path(args, dist.get_world_size())
        asyncio.run(run(args, root, device))
    except distributed.DistributedLoadError as err:
        print(f"rank {dist.get_rank()}: {err}", file=sys.stderr, flush=True)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

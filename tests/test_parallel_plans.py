"""Rank-aware plans: expert parallelism (a rank owns a subset of experts) and row slices of
whole tensors (a rank reads only its rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import raw_bytes
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab import Checkpoint, Dense, RowSlice, TieredMoE, load, plan


@pytest.mark.asyncio
@pytest.mark.parametrize("rank", [0, 1])
async def test_expert_parallel_rank_reads_only_its_experts(
    moe_checkpoint: asyncslab.SyntheticCheckpoint, rank: int
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)

    def owns(layer: int, expert: int) -> bool:
        return expert % 2 == rank

    p = plan(ckpt, [TieredMoE(owns=owns), Dense()])
    experts = {r.expert for r in p.routes if r.expert is not None}
    assert experts and all(e % 2 == rank for e in experts)
    for layer, partition in p.extras["partitions"].items():
        assert set(partition.experts) == {
            e for e in moe_checkpoint.tier_map[layer] if e % 2 == rank
        }
    skipped_experts = [n for n in p.skipped if ".mlp.experts." in n]
    assert skipped_experts and all(int(n.split(".")[5]) % 2 != rank for n in skipped_experts)
    slabs = await load(ckpt, p)
    stats = slabs.statistics()
    assert stats.bytes_landed == p.nbytes
    with safe_open(moe_checkpoint.files[0], "pt") as f:
        for name in f.keys():  # noqa: SIM118
            if name in p._index:
                assert torch.equal(raw_bytes(slabs.view(name)), raw_bytes(f.get_tensor(name)))


@pytest.mark.asyncio
@pytest.mark.parametrize("rank", [0, 1, 2])
async def test_row_slices_read_only_their_rows(tmp_path: Path, rank: int) -> None:
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 5),
        "model.layers.0.mlp.down_proj.weight": torch.randn(6, 7).to(torch.bfloat16),
        "model.norm.weight": torch.randn(5),
    }
    save_file(weights, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    p = plan(ckpt, [RowSlice(r".*_proj\.weight", rank=rank, world=3), Dense()])
    slabs = await load(ckpt, p)
    for name, full in weights.items():
        got = slabs.view(name)
        if name.endswith("_proj.weight"):
            rows = full.shape[0] // 3
            expected = full[rank * rows : (rank + 1) * rows]
        else:
            expected = full
        assert torch.equal(raw_bytes(got), raw_bytes(expected))
    needed = sum(r.nbytes for r in p.routes)
    assert needed < sum(t.numel() * t.element_size() for t in weights.values())
    assert slabs.statistics().bytes_needed == needed


def test_row_slice_rejects_uneven_split(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(5, 2)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    with pytest.raises(asyncslab.PlanError, match=r"cannot split shape \[5, 2\]"):
        plan(ckpt, [RowSlice("w", rank=0, world=2)])


def test_row_slices_of_different_ranks_have_different_fingerprints(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 2)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    prints = {plan(ckpt, [RowSlice("w", rank=r, world=2)]).fingerprint for r in (0, 1)}
    assert len(prints) == 2

"""Rank-aware plans: expert parallelism (a rank owns a subset of experts) and row slices of
whole tensors (a rank reads only its rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab import Checkpoint, Dense, RowSlice, TieredMoE, load, plan
from asyncslab.rules import SlabSpec, make_route
from asyncslab.testing import SyntheticCheckpoint
from support.faults import raw_bytes


@pytest.mark.asyncio
@pytest.mark.parametrize("rank", [0, 1])
async def test_expert_parallel_rank_reads_only_its_experts(
    moe_checkpoint: SyntheticCheckpoint, rank: int
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)

    def owns(layer: int, expert: int) -> bool:
        return expert % 2 == rank

    p = plan(ckpt, [TieredMoE(owns=owns), Dense()])
    experts = {r.expert for r in p.routes if r.expert is not None}
    assert experts
    assert all(e % 2 == rank for e in experts)
    for layer, partition in p.extras["partitions"].items():
        assert set(partition.experts) == {
            e for e in moe_checkpoint.tier_map[layer] if e % 2 == rank
        }
    skipped_experts = [n for n in p.skipped if ".mlp.experts." in n]
    assert skipped_experts
    assert all(int(n.split(".")[5]) % 2 != rank for n in skipped_experts)
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


# ---------------------------------------------------------------- mutation audit (RowSlice)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0)])
def test_row_slice_refuses_a_rank_outside_the_world(tmp_path: Path, rank: int, world: int) -> None:
    """A rank outside ``0..world-1`` (an off-by-one in a launcher) is refused by name, not
    planned as rows past the tensor's end or before its start."""
    save_file({"w": torch.zeros(4, 2)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    with pytest.raises(asyncslab.PlanError, match=rf"RowSlice rank {rank} is outside world"):
        plan(ckpt, [RowSlice("w", rank=rank, world=world)])


def test_row_slice_refuses_a_scalar_by_name(tmp_path: Path) -> None:
    """A 0-d tensor has no rows: a PlanError naming it, not an IndexError."""
    save_file({"s": torch.tensor(1.0), "w": torch.zeros(4, 2)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    with pytest.raises(asyncslab.PlanError, match=r"cannot split shape \[\] by rows") as info:
        plan(ckpt, [RowSlice(".*", rank=0, world=2)])
    assert info.value.tensor == "s"


@pytest.mark.asyncio
async def test_row_slice_pattern_matches_whole_names_only(tmp_path: Path) -> None:
    """``RowSlice("w")`` slices ``w`` alone; ``w2`` (matched by prefix only) must load whole
    through the next rule, not as this rank's half of its rows."""
    weights = {"w": torch.randn(4, 3), "w2": torch.randn(4, 3)}
    save_file(weights, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    p = plan(ckpt, [RowSlice("w", rank=1, world=2), Dense()])
    async with await load(ckpt, p) as slabs:
        assert torch.equal(raw_bytes(slabs.view("w")), raw_bytes(weights["w"][2:]))
        assert torch.equal(raw_bytes(slabs.view("w2")), raw_bytes(weights["w2"]))


@pytest.mark.parametrize(("rank", "world"), [(1.0, 2), (1, 2.0)])
def test_row_slice_refuses_a_rank_or_world_that_is_no_int(
    tmp_path: Path, rank: float, world: float
) -> None:
    """``RowSlice(rank=1.0)`` (a rank read from a float config) planned routes with
    ``src_offset=88.0``, ``shape=(2.0, 2)`` and another fingerprint than ``rank=1``; the load
    then failed ("'float' object cannot be interpreted as an integer"). Like
    ``Stack(count=4.0)``, it is refused, naming the argument; a NumPy int is an int."""
    import numpy as np

    save_file({"w": torch.zeros(4, 2)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    name = "rank" if isinstance(rank, float) else "world"
    with pytest.raises(asyncslab.PlanError, match=rf"RowSlice\({name}=[12]\.0\): expected an int"):
        plan(ckpt, [RowSlice("w", rank=rank, world=world)])  # type: ignore[arg-type]
    ints = plan(ckpt, [RowSlice("w", rank=np.int64(1), world=np.int32(2))])  # type: ignore[arg-type]
    assert ints.fingerprint == plan(ckpt, [RowSlice("w", rank=1, world=2)]).fingerprint
    assert type(ints.routes[0].src_offset) is int


def test_make_route_rows_are_ints(tmp_path: Path) -> None:
    """A custom rule's ``rows=(1.0, 2.0)`` gave a route of float offsets and sizes, which
    the load then failed on; rows are refused unless ints (a NumPy int is one)."""
    import numpy as np

    save_file({"w": torch.zeros(4, 2)}, tmp_path / "m.safetensors")
    info = Checkpoint.open(tmp_path / "m.safetensors").tensors["w"]
    spec = SlabSpec("w", "u", torch.float32, (), (1, 2))
    with pytest.raises(asyncslab.PlanError, match=r"rows \(1\.0, 2\.0\): expected two ints"):
        make_route(info, spec, (), rows=(1.0, 2.0))  # type: ignore[arg-type]
    route = make_route(info, spec, (), rows=(np.int64(1), np.int64(2)))  # type: ignore[arg-type]
    assert (route.src_offset - info.offset, route.nbytes, route.shape) == (8, 8, (1, 2))
    assert {type(route.src_offset), type(route.nbytes), type(route.shape[0])} == {int}

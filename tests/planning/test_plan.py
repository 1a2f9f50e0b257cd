"""Planning: where every checkpoint tensor lands, checked before any payload is read.

Covers the layout contract (CONTEXT rule 2), the exact partition as the planner uses it
(rule 1), no silent casts (rule 5) and the plan-time half of the completeness gate (rule 6):
each malformed checkpoint fails with a specific error naming what is wrong.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import itertools
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncslab import (
    Checkpoint,
    Dense,
    Plan,
    PlanError,
    Stack,
    TensorInfo,
    TieredMoE,
    load_tier_map,
    plan,
)
from asyncslab.errors import (
    CoverageError,
    DtypeMismatchError,
    PartitionError,
    ShapeMismatchError,
    TierMapError,
    UnmatchedTensorError,
)
from asyncslab.rules import Claim, SlabSpec, make_route
from asyncslab.testing._synthetic import (
    SyntheticCheckpoint,
    SyntheticSpec,
    expected_tensors,
    write_synthetic,
)

PROJS = ("gate_proj", "up_proj", "down_proj")
SCALES = ("trellis", "suh", "svh")
MARKERS = ("mcg", "mul1")
EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+?)(?:\.rank(\d+))?\.(\w+)")

# Hand-built experts: hidden and (rank-local) intermediate sizes, multiples of 16.
HID, INTER = 32, 16


# --------------------------------------------------------------------------- helpers


def xname(layer: int, expert: int | str, proj: str, suffix: str, rank: int | None = None) -> str:
    r = f".rank{rank}" if rank is not None else ""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}{r}.{suffix}"


def expert_tensors(
    layer: int,
    expert: int | str,
    bits: int,
    *,
    ranks: int | None = None,
    markers: bool = True,
    hidden: int = HID,
    inter: int = INTER,
) -> dict[str, torch.Tensor]:
    """One EXL3-like expert: per projection a trellis int16 (in/16, out/16, 16*K), suh f16
    (in,), svh f16 (out,) and the int32 markers mcg () and mul1 (1,)."""
    out: dict[str, torch.Tensor] = {}
    for proj in PROJS:
        n_in, n_out = (hidden, inter) if proj != "down_proj" else (inter, hidden)
        for rank in range(ranks) if ranks else [None]:
            base = xname(layer, expert, proj, "", rank)[:-1]
            out[f"{base}.trellis"] = torch.zeros(
                (n_in // 16, n_out // 16, 16 * bits), dtype=torch.int16
            )
            out[f"{base}.suh"] = torch.ones(n_in, dtype=torch.float16)
            out[f"{base}.svh"] = torch.ones(n_out, dtype=torch.float16)
            if markers:
                out[f"{base}.mcg"] = torch.tensor(7, dtype=torch.int32)
                out[f"{base}.mul1"] = torch.tensor([9], dtype=torch.int32)
    return out


def moe_layer(layer: int, bits: Iterable[int], **kw: object) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for expert, k in enumerate(bits):
        out.update(expert_tensors(layer, expert, k, **kw))  # type: ignore[arg-type]
    return out


def write(directory: Path, tensors: Mapping[str, torch.Tensor]) -> Checkpoint:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file(dict(tensors), path)
    return Checkpoint.open(path)


def rewrite(
    ck: SyntheticCheckpoint,
    directory: Path,
    change: Callable[[dict[str, torch.Tensor]], None],
) -> Checkpoint:
    """All of ``ck``'s tensors, edited in place by ``change``, as one file in ``directory``."""
    tensors: dict[str, torch.Tensor] = {}
    for path in ck.files:
        tensors.update(load_file(path))
    change(tensors)
    return write(directory, tensors)


def set_bits(tensors: dict[str, torch.Tensor], layer: int, expert: int, bits: int) -> None:
    for proj in PROJS:
        name = xname(layer, expert, proj, "trellis")
        a, b, _ = tensors[name].shape
        tensors[name] = torch.zeros((a, b, 16 * bits), dtype=torch.int16)


def linear(slot: tuple[int, ...], dims: tuple[int, ...]) -> int:
    index = 0
    for i, n in zip(slot, dims, strict=True):
        index = index * n + i
    return index


def groups_of(tiers: Mapping[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e, k in sorted(tiers.items()):
        out.setdefault(k, []).append(e)
    return out


def is_expert(name: str) -> bool:
    return EXPERT_RE.fullmatch(name) is not None


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """The generator's default: 4 layers (3 MoE), 8 experts in K3/K4, three shard files."""
    return write_synthetic(tmp_path_factory.mktemp("gen"), SyntheticSpec())


@pytest.fixture(scope="module")
def gen_plan(gen: SyntheticCheckpoint) -> Plan:
    return plan(Checkpoint.open(gen.root))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """A tiny generated checkpoint for tests that edit tensors."""
    spec = SyntheticSpec(hidden=64, intermediate=32, vocab=64, n_shards=2)
    return write_synthetic(tmp_path_factory.mktemp("small"), spec)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    spec = SyntheticSpec(tp_ranks=2, hidden=64, intermediate=64, vocab=64, n_shards=2)
    return write_synthetic(tmp_path_factory.mktemp("tp2"), spec)


# --------------------------------------------------------------------------- layout contract


def test_expert_slots_follow_the_layout_contract(gen: SyntheticCheckpoint, gen_plan: Plan) -> None:
    declared = json.loads(gen.tier_map_path.read_text())
    assert {int(k): {int(e): b for e, b in v.items()} for k, v in declared.items()} == {
        k: dict(v) for k, v in gen.tier_map.items()
    }
    assert set(gen.tier_map) == {1, 2, 3}
    for layer, tiers in gen.tier_map.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        groups = groups_of(tiers)
        assert len(groups) == 2  # the generator mixes K3 and K4 in every layer
        for expert, bits in tiers.items():
            offset = groups[bits].index(expert)
            for suffix in SCALES:
                w13 = f"{prefix}.K{bits}.w13.{suffix}"
                w2 = f"{prefix}.K{bits}.w2.{suffix}"
                assert gen_plan.where(xname(layer, expert, "gate_proj", suffix)) == (
                    w13,
                    (0, offset),
                )
                assert gen_plan.where(xname(layer, expert, "up_proj", suffix)) == (w13, (1, offset))
                assert gen_plan.where(xname(layer, expert, "down_proj", suffix)) == (w2, (offset,))
                route = gen_plan.route(xname(layer, expert, "up_proj", suffix))
                assert (route.layer, route.expert, route.shard, route.suffix) == (
                    layer,
                    expert,
                    "up_proj",
                    suffix,
                )
                assert route.unit == f"layers.{layer}"
        hidden, inter = gen.spec.hidden, gen.spec.intermediate
        for bits, members in groups.items():
            n = len(members)
            slab = gen_plan.slabs
            w13 = f"{prefix}.K{bits}.w13"
            w2 = f"{prefix}.K{bits}.w2"
            assert slab[f"{w13}.trellis"].shape == (2, n, hidden // 16, inter // 16, 16 * bits)
            assert slab[f"{w13}.suh"].shape == (2, n, hidden)
            assert slab[f"{w13}.svh"].shape == (2, n, inter)
            assert slab[f"{w2}.trellis"].shape == (n, inter // 16, hidden // 16, 16 * bits)
            assert slab[f"{w2}.suh"].shape == (n, inter)
            assert slab[f"{w2}.svh"].shape == (n, hidden)
            for proj in ("w13", "w2"):
                assert slab[f"{prefix}.K{bits}.{proj}.trellis"].dtype == torch.int16
                assert slab[f"{prefix}.K{bits}.{proj}.suh"].dtype == torch.float16
                assert slab[f"{prefix}.K{bits}.{proj}.svh"].dtype == torch.float16
                assert slab[f"{prefix}.K{bits}.{proj}.svh"].unit == f"layers.{layer}"


def test_every_slot_is_filled_once_and_routes_are_in_payload_order(
    gen: SyntheticCheckpoint, gen_plan: Plan
) -> None:
    expected = expected_tensors(gen.spec)
    filled: dict[str, set[tuple[int, ...]]] = {name: set() for name in gen_plan.slabs}
    for route in gen_plan.routes:
        spec = gen_plan.slabs[route.slab]
        assert route.dst_offset == linear(route.slot, spec.slot_dims) * spec.slot_nbytes
        assert route.dst_offset == spec.slot_offset(route.slot)
        assert route.nbytes == spec.slot_nbytes
        dtype, shape = expected[route.tensor]
        assert (spec.dtype, spec.item_shape) == (dtype, shape), route.tensor
        assert route.slot not in filled[route.slab]
        filled[route.slab].add(route.slot)
    for name, spec in gen_plan.slabs.items():
        assert spec.shape == spec.slot_dims + spec.item_shape
        assert filled[name] == set(itertools.product(*map(range, spec.slot_dims))), name
    order = {f.path: i for i, f in enumerate(gen_plan.files)}
    assert len(order) == 3
    keys = [(order[r.file], r.src_offset) for r in gen_plan.routes]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert {r.file for r in gen_plan.routes} == set(order)  # experts straddle all files
    assert sum(s.nbytes for s in gen_plan.slabs.values()) == gen_plan.nbytes
    assert sum(r.nbytes for r in gen_plan.routes) == gen_plan.nbytes


def test_every_tensor_is_routed_checked_or_skipped_exactly_once(
    gen: SyntheticCheckpoint, gen_plan: Plan
) -> None:
    routed = [r.tensor for r in gen_plan.routes]
    everything = routed + list(gen_plan.checked) + list(gen_plan.skipped)
    assert sorted(everything) == sorted(expected_tensors(gen.spec))
    assert gen_plan.skipped == ()
    markers = [n for n in expected_tensors(gen.spec) if n.rsplit(".", 1)[1] in MARKERS]
    assert sorted(gen_plan.checked) == sorted(markers)
    # Non-expert tensors get one slab each, named like the tensor.
    dense = [n for n in routed if not is_expert(n)]
    assert all(gen_plan.where(n) == (n, ()) for n in dense)


def test_markers_are_checked_not_placed(gen_plan: Plan) -> None:
    name = xname(2, 5, "down_proj", "mcg")
    assert name in gen_plan.checked
    assert name not in {r.tensor for r in gen_plan.routes}
    with pytest.raises(
        KeyError, match=r"mlp\.experts\.5\.down_proj\.mcg' is checked but not placed"
    ):
        gen_plan.where(name)
    with pytest.raises(KeyError, match=r"is checked but not placed"):
        gen_plan.route(xname(1, 0, "gate_proj", "mul1"))
    with pytest.raises(KeyError, match=r"'no\.such\.tensor' is not in this plan"):
        gen_plan.where("no.such.tensor")


# --------------------------------------------------------------------------- tier map


def test_declared_tier_map_gives_the_inferred_plan(
    gen: SyntheticCheckpoint, gen_plan: Plan, tmp_path: Path
) -> None:
    ck = Checkpoint.open(gen.root)
    as_ints = {layer: dict(tiers) for layer, tiers in gen.tier_map.items()}
    as_json = json.loads(gen.tier_map_path.read_text())  # string keys, as a user would load it
    as_lists = {
        str(layer): [tiers[e] for e in range(len(tiers))] for layer, tiers in as_ints.items()
    }
    list_file = tmp_path / "tiers.json"
    list_file.write_text(json.dumps({"layers": as_lists}))
    declared = [
        plan(ck, tier_map=gen.tier_map_path),
        plan(ck, tier_map=str(gen.tier_map_path)),
        plan(ck, tier_map=as_ints),
        plan(ck, tier_map=as_json),
        plan(ck, tier_map=list_file),
        plan(ck, tier_map=as_lists),
        plan(ck, tier_map=load_tier_map(list_file)),
    ]
    # The same forms given to the rule itself, as plan() asks when the rules are one's own
    # (a path was read as its characters: "declares layers ., /, _, a, ...").
    for form in (gen.tier_map_path, str(gen.tier_map_path), as_json, list_file, as_lists):
        declared.append(plan(ck, [TieredMoE(tier_map=form), Dense()]))
    for p in declared:
        assert p.fingerprint == gen_plan.fingerprint
        assert p.routes == gen_plan.routes
    assert load_tier_map(list_file) == load_tier_map(gen.tier_map_path) == as_ints
    with pytest.raises(TierMapError, match="cannot read tier map"):
        TieredMoE(tier_map=tmp_path / "missing.json")


@pytest.mark.parametrize(
    "fusion",
    [
        {"w13": ("gate_proj", "up_proj"), "w1": ("gate_proj",), "w2": ("down_proj",)},
        {"w13": ("gate_proj", "gate_proj", "up_proj"), "w2": ("down_proj",)},
    ],
)
def test_tiered_moe_refuses_a_projection_fused_twice(fusion: dict[str, tuple[str, ...]]) -> None:
    # It ended in a bare ValueError (max() of an empty sequence), or in a coverage error
    # whose missing slots depended on which listing won.
    with pytest.raises(PlanError, match=r"lists projections \['gate_proj'\] more than once"):
        TieredMoE(fusion=fusion)


def test_tiered_moe_refuses_a_fusion_entry_that_is_a_string() -> None:
    # ("down_proj") is a string: its letters were taken for projections ("'o' twice").
    with pytest.raises(PlanError, match=r"fusion\['w2'\] = 'down_proj': expected a tuple"):
        TieredMoE(fusion={"w13": ("gate_proj", "up_proj"), "w2": ("down_proj")})  # noqa: UP034


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"1": {"1": 3, "01": 4}}, "layer 1: expert 1 is given twice"),
        ({"1": [3], 1: [4]}, "layer 1 is given twice"),
        ({"1.9": [3]}, "layer '1.9' is not a number"),
        ({True: [3]}, "layer True is not a number"),
        ({"1": {1.7: 3}}, "layer 1: expert 1.7 is not a number"),
    ],
)
def test_a_tier_map_refuses_keys_that_are_no_numbers_or_collide(
    source: dict[Any, Any], message: str
) -> None:
    # Each was read as some other map: 1.7 and True as 1, "1" and "01" as one expert.
    with pytest.raises(TierMapError, match=re.escape(message)):
        load_tier_map(source)


def test_a_tier_map_takes_integers_of_any_kind(gen: SyntheticCheckpoint, gen_plan: Plan) -> None:
    import numpy as np

    ck = Checkpoint.open(gen.root)
    as_numpy = {
        np.int64(layer): {np.int32(e): np.int64(b) for e, b in tiers.items()}
        for layer, tiers in gen.tier_map.items()
    }
    assert plan(ck, [TieredMoE(tier_map=as_numpy), Dense()]).routes == gen_plan.routes
    assert plan(ck, tier_map=as_numpy).routes == gen_plan.routes
    as_arrays = {  # bits per expert as an array, the natural NumPy form
        layer: np.array([tiers[e] for e in range(len(tiers))])
        for layer, tiers in gen.tier_map.items()
    }
    assert plan(ck, tier_map=as_arrays).routes == gen_plan.routes
    for bits in (4.0, True, 0):
        with pytest.raises(TierMapError, match="bits must be a positive int"):
            TieredMoE(tier_map={1: {0: bits}})


@pytest.mark.parametrize("layout", ["expert-major", "bogus", ""])
def test_tiered_moe_refuses_an_unknown_layout(layout: str) -> None:
    # A typo planned the default layout: silently the wrong bytes for expert-major kernels.
    with pytest.raises(PlanError, match=f"layout={layout!r}; expected 'shard_major' or"):
        TieredMoE(layout=layout)  # type: ignore[arg-type]


def test_tier_map_list_form(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", moe_layer(3, [3, 4, 3, 3, 4]))
    path = tmp_path / "tiers.json"
    path.write_text('{"3": [3, 4, 3, 3, 4]}')
    assert load_tier_map(path) == {3: {0: 3, 1: 4, 2: 3, 3: 3, 4: 4}}
    p = plan(ck, tier_map=path)
    assert p.extras["tiers"] == {3: {"K3": 3, "K4": 2}}
    assert p.where(xname(3, 4, "down_proj", "svh")) == (
        "model.layers.3.mlp.experts.K4.w2.svh",
        (1,),
    )
    assert p.fingerprint == plan(ck).fingerprint


def test_declared_tier_disagreeing_with_trellis_shape(gen: SyntheticCheckpoint) -> None:
    layer = 2
    expert = min(gen.tier_map[layer])
    observed = gen.tier_map[layer][expert]
    wrong = {lay: dict(t) for lay, t in gen.tier_map.items()}
    wrong[layer][expert] = 7 - observed  # 3 <-> 4
    with pytest.raises(
        TierMapError,
        match=rf"layer {layer}: .*expert {expert} declared {7 - observed}, shape says {observed}",
    ) as info:
        plan(Checkpoint.open(gen.root), tier_map=wrong)
    err = info.value
    assert err.details == {
        "layer": layer,
        "expert": expert,
        "expected": 7 - observed,
        "got": observed,
    }
    assert err.tensor is not None
    assert f"layers.{layer}.mlp.experts.{expert}." in err.tensor


def test_tier_map_missing_a_layer(gen: SyntheticCheckpoint) -> None:
    partial = {layer: dict(t) for layer, t in gen.tier_map.items() if layer != 3}
    with pytest.raises(TierMapError, match=r"tier map has no entry for MoE layer 3") as info:
        plan(Checkpoint.open(gen.root), tier_map=partial)
    assert info.value.details["layer"] == 3


def test_tier_map_declaring_a_layer_without_experts(gen: SyntheticCheckpoint) -> None:
    extra = {**{layer: dict(t) for layer, t in gen.tier_map.items()}, 0: {0: 3}, 9: {0: 3}}
    with pytest.raises(TierMapError, match=r"declares layers 0, 9, which have no experts"):
        plan(Checkpoint.open(gen.root), tier_map=extra)


def test_tier_map_with_an_expert_the_checkpoint_lacks(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", moe_layer(1, [3, 4, 3]))
    with pytest.raises(PartitionError, match=r"layer 1: .*experts in no group: 3\b"):
        plan(ck, tier_map={1: {0: 3, 1: 4, 2: 3, 3: 4}})
    with pytest.raises(PartitionError, match=r"layer 1: .*unknown experts: 2\b"):
        plan(ck, tier_map={1: {0: 3, 1: 4}})


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[3, 4]",
        '"layers"',
        '{"1": 3}',
        '{"1": {"0": "3"}}',
        '{"1": {"0": 3.0}}',
        '{"1": {"0": 0}}',
        '{"1": {"0": true}}',
        '{"1": [3, null]}',
        '{"one": {"0": 3}}',
        '{"1": {"zero": 3}}',
    ],
)
def test_malformed_tier_map_file(gen: SyntheticCheckpoint, tmp_path: Path, text: str) -> None:
    path = tmp_path / "tiers.json"
    path.write_text(text)
    with pytest.raises(TierMapError) as info:
        load_tier_map(path)
    assert info.value.file == str(path)
    with pytest.raises(TierMapError, match=re.escape(str(path))):
        plan(Checkpoint.open(gen.root), tier_map=path)


def test_missing_tier_map_file(tmp_path: Path) -> None:
    with pytest.raises(TierMapError, match="cannot read tier map"):
        load_tier_map(tmp_path / "absent.json")


def test_tier_map_and_rank_belong_to_the_default_rules(gen: SyntheticCheckpoint) -> None:
    ck = Checkpoint.open(gen.root)
    with pytest.raises(PlanError, match="pass them to your rules"):
        plan(ck, [TieredMoE(), Dense()], tier_map=gen.tier_map_path)
    with pytest.raises(PlanError, match="pass them to your rules"):
        plan(ck, [TieredMoE(), Dense()], rank=0)


# --------------------------------------------------------------------------- dtypes (rule 5)


def test_consistent_checkpoint_is_accepted(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", moe_layer(1, [3, 4, 3, 4]))
    p = plan(ck)
    assert {s.dtype for n, s in p.slabs.items() if n.endswith(".trellis")} == {torch.int16}
    assert {s.dtype for n, s in p.slabs.items() if not n.endswith(".trellis")} == {torch.float16}
    assert len(p.checked) == 4 * 3 * 2
    assert p.extras["tiers"] == {1: {"K3": 2, "K4": 2}}


def test_int32_trellis_among_int16(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4])
    bad = xname(1, 2, "up_proj", "trellis")
    tensors[bad] = tensors[bad].to(torch.int32)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        DtypeMismatchError,
        match=r"dtype I32, plan expects I16 \(suffix 'trellis', layer 1, expert 2, shard 'up_proj'",
    ) as info:
        plan(ck)
    err = info.value
    assert err.tensor == bad
    assert err.file == str(ck.tensors[bad].file)
    assert err.details["expected"] == "I16"
    assert err.details["got"] == "I32"
    assert (err.details["layer"], err.details["expert"], err.details["shard"]) == (1, 2, "up_proj")


def test_int32_trellis_as_the_very_first_tensor(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4], markers=False)
    bad = xname(1, 0, "gate_proj", "trellis")
    tensors[bad] = tensors[bad].to(torch.int32)
    ck = write(tmp_path / "ck", tensors)
    # Precondition: the malformed tensor is the first one in the checkpoint, by name order
    # and by payload offset, so "the dtype of the first tensor seen" would be I32.
    first = ck.files[0]
    assert next(iter(ck.tensors)) == bad
    assert ck.tensors[bad].offset == min(i.offset for i in ck.tensors.values()) == first.data_start
    with pytest.raises(
        DtypeMismatchError,
        match=r"dtype I32, plan expects I16 "
        r"\(suffix 'trellis', layer 1, expert 0, shard 'gate_proj'",
    ) as info:
        plan(ck)
    err = info.value
    assert err.tensor == bad
    assert (err.details["expected"], err.details["got"], err.details["expert"]) == ("I16", "I32", 0)


def test_every_trellis_int32_is_still_wrong(tmp_path: Path) -> None:
    """Consistent among themselves is not enough: the schema decides."""
    tensors = moe_layer(1, [3, 4], markers=False)
    for name in [n for n in tensors if n.endswith(".trellis")]:
        tensors[name] = tensors[name].to(torch.int32)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(DtypeMismatchError, match=r"dtype I32, plan expects I16"):
        plan(ck)
    # ... and a schema that says int32 accepts it.
    schema = {"trellis": torch.int32, "suh": torch.float16, "svh": torch.float16}
    p = plan(ck, [TieredMoE(schema=schema)])
    assert p.slabs["model.layers.1.mlp.experts.K3.w13.trellis"].dtype == torch.int32


def test_float32_suh_among_float16(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 3, 4, 4])
    bad = xname(1, 3, "down_proj", "suh")
    tensors[bad] = tensors[bad].to(torch.float32)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        DtypeMismatchError,
        match=r"dtype F32, plan expects F16 \(suffix 'suh', layer 1, expert 3, shard 'down_proj'",
    ) as info:
        plan(ck)
    err = info.value
    assert err.tensor == bad
    assert (err.details["expected"], err.details["got"], err.details["expert"]) == ("F16", "F32", 3)


def test_marker_with_wrong_dtype(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3])
    bad = xname(1, 1, "gate_proj", "mcg")
    tensors[bad] = tensors[bad].to(torch.int64)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        DtypeMismatchError,
        match=r"dtype I64, marker 'mcg' must be I32 \(layer 1, expert 1, shard 'gate_proj'\)",
    ) as info:
        plan(ck)
    err = info.value
    assert err.tensor == bad
    assert (err.details["expected"], err.details["got"]) == ("I32", "I64")
    assert (err.details["layer"], err.details["expert"], err.details["shard"]) == (
        1,
        1,
        "gate_proj",
    )


# --------------------------------------------------------------------------- shapes


def test_wrong_svh_length_is_named(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 3, 3, 4])
    bad = xname(1, 1, "gate_proj", "svh")
    tensors[bad] = torch.ones(INTER + 16, dtype=torch.float16)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        ShapeMismatchError,
        match=rf"shape \[{INTER + 16}\], slot expects \[{INTER}\] "
        r"\(suffix 'svh', layer 1, expert 1, "
        r"shard 'gate_proj'",
    ) as info:
        plan(ck)
    err = info.value
    assert err.tensor == bad
    assert (err.details["expected"], err.details["got"]) == ((INTER,), (INTER + 16,))


def test_a_third_bit_rate_is_a_third_group(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", moe_layer(1, [3, 4, 2, 3, 4, 4]))
    p = plan(ck)
    assert p.extras["tiers"] == {1: {"K2": 1, "K3": 2, "K4": 3}}
    assert list(p.extras["tiers"][1]) == ["K2", "K3", "K4"]
    prefix = "model.layers.1.mlp.experts"
    assert p.where(xname(1, 2, "up_proj", "trellis")) == (f"{prefix}.K2.w13.trellis", (1, 0))
    assert p.where(xname(1, 3, "gate_proj", "trellis")) == (f"{prefix}.K3.w13.trellis", (0, 1))
    assert p.where(xname(1, 5, "down_proj", "trellis")) == (f"{prefix}.K4.w2.trellis", (2,))
    assert p.slabs[f"{prefix}.K2.w13.trellis"].shape == (2, 1, HID // 16, INTER // 16, 32)


def test_projections_disagreeing_on_an_experts_tier(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3])
    tensors[xname(1, 2, "down_proj", "trellis")] = torch.zeros((1, 2, 64), dtype=torch.int16)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(TierMapError, match=r"layer 1 expert 2: projections disagree on the tier"):
        plan(ck)


# --------------------------------------------------------------------------- coverage


def test_missing_projection_tensor_is_named(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4])
    gone = xname(1, 2, "up_proj", "trellis")
    del tensors[gone]
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        CoverageError, match=rf"layer 1: 1 expert tensors missing: {re.escape(gone)}$"
    ) as info:
        plan(ck)
    assert info.value.details["missing"] == [gone]


def test_missing_expert_in_the_middle(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4, 3])
    for name in [n for n in tensors if ".experts.2." in n]:
        del tensors[name]
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        PartitionError, match=r"layer 1: not an exact partition: experts in no group: 2$"
    ) as info:
        plan(ck)
    assert info.value.details["layer"] == 1


def test_missing_last_expert_needs_a_count_or_a_tier_map(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4, 3])
    for name in [n for n in tensors if ".experts.4." in n]:
        del tensors[name]
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(PartitionError, match=r"experts in no group: 4$"):
        plan(ck, [TieredMoE(n_experts=5)])
    with pytest.raises(PartitionError, match=r"experts in no group: 4$"):
        plan(ck, tier_map={1: {0: 3, 1: 4, 2: 3, 3: 4, 4: 3}})


def test_two_spellings_of_one_expert(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3, 4, 3, 4])
    tensors.update(expert_tensors(1, "05", 4))
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(CoverageError, match=r"expert 5, .*already taken by") as info:
        plan(ck)
    message = str(info.value)
    assert ".experts.5." in message
    assert ".experts.05." in message


def test_unknown_suffix_or_projection(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4])
    odd = xname(1, 1, "gate_proj", "scale")
    ck = write(tmp_path / "a", {**tensors, odd: torch.ones(2)})
    with pytest.raises(
        UnmatchedTensorError, match=r"expert tensor with unknown suffix 'scale'"
    ) as info:
        plan(ck)
    assert info.value.tensor == odd
    odd = xname(1, 0, "gate_up_proj", "trellis")
    ck = write(tmp_path / "b", {**tensors, odd: torch.zeros((2, 2, 48), dtype=torch.int16)})
    with pytest.raises(UnmatchedTensorError, match=r"unknown projection 'gate_up_proj'") as info:
        plan(ck)
    assert info.value.tensor == odd


def test_tensors_no_rule_claims(gen: SyntheticCheckpoint) -> None:
    ck = Checkpoint.open(gen.root)
    dense = sorted(n for n in expected_tensors(gen.spec) if not is_expert(n))
    assert "lm_head.weight" in dense
    assert "model.layers.1.mlp.gate.weight" in dense
    with pytest.raises(
        UnmatchedTensorError, match=rf"{len(dense)} tensors match no rule: 'lm_head.weight', "
    ) as info:
        plan(ck, [TieredMoE()])
    assert info.value.details["tensors"] == dense

    ignored = plan(ck, [TieredMoE()], ignore=[r"(?!.*\.mlp\.experts\.\d).*"])
    assert sorted(ignored.skipped) == dense
    with pytest.raises(KeyError, match="is skipped by this plan"):
        ignored.where("lm_head.weight")
    tolerant = plan(ck, [TieredMoE()], unmatched="ignore")
    assert sorted(tolerant.skipped) == dense
    assert tolerant.fingerprint == ignored.fingerprint
    # The expert part of the plan is what the default rules give.
    experts = {r.tensor: (r.slab, r.slot) for r in tolerant.routes}
    full = plan(ck)
    assert experts == {r.tensor: (r.slab, r.slot) for r in full.routes if is_expert(r.tensor)}


def test_unknown_unmatched_policy_is_refused(gen: SyntheticCheckpoint) -> None:
    """A misspelt policy must not drop tensors silently."""
    with pytest.raises(PlanError, match=r"unmatched='warn'.*'error' or 'ignore'"):
        plan(Checkpoint.open(gen.root), [TieredMoE()], unmatched="warn")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- rank slices


def test_rank_sliced_checkpoint_needs_a_rank(tp2: SyntheticCheckpoint) -> None:
    with pytest.raises(PlanError, match=r"rank-sliced into 2 ranks; pass rank= \(0\.\.1\)"):
        plan(Checkpoint.open(tp2.root))
    with pytest.raises(PlanError, match=r"rank=2, but the checkpoint has ranks 0\.\.1"):
        plan(Checkpoint.open(tp2.root), rank=2)


def test_each_rank_routes_only_its_own_slices(tp2: SyntheticCheckpoint) -> None:
    ck = Checkpoint.open(tp2.root)
    everything = set(expected_tensors(tp2.spec))
    plans = [plan(ck, rank=r) for r in (0, 1)]
    routed = [{r.tensor for r in p.routes} for p in plans]
    for rank, p in enumerate(plans):
        other = 1 - rank
        experts = {n for n in routed[rank] if is_expert(n)}
        assert experts
        assert all(f".rank{rank}." in n for n in experts)
        assert all(f".rank{other}." in n for n in p.skipped)
        assert {n for n in everything if f".rank{other}." in n} == set(p.skipped)
        assert set(p.checked) == {
            n for n in everything if f".rank{rank}." in n and n.rsplit(".", 1)[1] in MARKERS
        }
        assert routed[rank] | set(p.checked) | set(p.skipped) == everything
        where = p.where(xname(1, 0, "up_proj", "svh", rank))
        assert where.slab.startswith("model.layers.1.mlp.experts.K")
        assert where.slot[0] == 1
    routed_experts = [{n for n in s if is_expert(n)} for s in routed]
    assert routed_experts[0].isdisjoint(routed_experts[1])
    # Same layout on both ranks (same slab shapes), different tensors.
    assert plans[0].layout_fingerprint == plans[1].layout_fingerprint
    assert plans[0].fingerprint != plans[1].fingerprint
    inter = tp2.spec.intermediate // 2
    prefix = "model.layers.1.mlp.experts"
    k = tp2.tier_map[1][0]
    n = sum(1 for b in tp2.tier_map[1].values() if b == k)
    assert plans[0].slabs[f"{prefix}.K{k}.w13.svh"].shape == (2, n, inter)
    assert plans[0].slabs[f"{prefix}.K{k}.w2.suh"].shape == (n, inter)


def test_missing_rank_slice_is_named(tmp_path: Path) -> None:
    tensors = moe_layer(1, [3, 4, 3], ranks=2, inter=2 * INTER)
    for name in [n for n in tensors if ".experts.1.down_proj.rank1." in n]:
        del tensors[name]
    ck = write(tmp_path / "ck", tensors)
    for rank in (0, 1):
        with pytest.raises(
            CoverageError, match=r"layer 1 expert 1 down_proj\.\w+: rank slices 1 missing"
        ) as info:
            plan(ck, rank=rank)
        details = info.value.details
        assert (details["layer"], details["expert"], details["missing_ranks"]) == (1, 1, [1])


def test_rank_on_an_unsliced_checkpoint(gen: SyntheticCheckpoint) -> None:
    with pytest.raises(PlanError, match=r"rank=0 was given, but .* not rank-sliced"):
        plan(Checkpoint.open(gen.root), rank=0)


def test_mixed_sliced_and_whole_experts(tmp_path: Path) -> None:
    tensors = {**expert_tensors(1, 0, 3, ranks=2), **expert_tensors(1, 1, 3)}
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(PlanError, match="mixes rank-sliced and whole expert tensors"):
        plan(ck, rank=0)


# --------------------------------------------------------------------------- Stack and Dense

STACK = Stack(r"model\.layers\.(?P<index>\d+)\.attn\.q\.weight")


def q_weights(n: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.attn.q.weight": torch.full((4, 4), float(i), dtype=dtype)
        for i in range(n)
    }


def test_stack_puts_layers_into_one_slab(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", q_weights(4))
    p = plan(ck, [STACK])
    slab = p.slabs["model.layers.*.attn.q.weight"]
    assert slab.shape == (4, 4, 4)
    assert slab.dtype == torch.float32
    assert list(p.slabs) == ["model.layers.*.attn.q.weight"]
    for i in range(4):
        name = f"model.layers.{i}.attn.q.weight"
        assert p.where(name) == ("model.layers.*.attn.q.weight", (i,))
        assert p.route(name).dst_offset == i * 64
        assert p.route(name).layer == i
    assert p.nbytes == 4 * 64


def test_stack_with_a_missing_index(tmp_path: Path) -> None:
    tensors = q_weights(4)
    del tensors["model.layers.1.attn.q.weight"]
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        CoverageError,
        match=r"slab 'model\.layers\.\*\.attn\.q\.weight' .*1 of 4 slots have no tensor: \(1,\)",
    ):
        plan(ck, [STACK])


def test_stack_members_disagreeing_on_dtype(tmp_path: Path) -> None:
    tensors = q_weights(4)
    tensors["model.layers.2.attn.q.weight"] = tensors["model.layers.2.attn.q.weight"].bfloat16()
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        DtypeMismatchError, match=r"disagree on dtype \(.*BF16: model\.layers\.2\.attn"
    ):
        plan(ck, [STACK])
    with pytest.raises(
        DtypeMismatchError, match=r"dtype BF16, plan expects F32 \(layer 2,"
    ) as info:
        plan(ck, [Stack(STACK.pattern, dtype=torch.float32)])
    assert info.value.tensor == "model.layers.2.attn.q.weight"
    assert (info.value.details["expected"], info.value.details["got"]) == ("F32", "BF16")


def test_stack_pattern_needs_an_index_group(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", q_weights(2))
    with pytest.raises(PlanError, match="needs a named group 'index'"):
        plan(ck, [Stack(r"model\.layers\.(\d+)\.attn\.q\.weight")])


def test_dense_required_dtype(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", q_weights(2))
    rule = Dense(dtypes={r".*\.q\.weight": torch.bfloat16})
    with pytest.raises(DtypeMismatchError, match=r"dtype F32, plan expects BF16") as info:
        plan(ck, [rule])
    assert info.value.tensor == "model.layers.0.attn.q.weight"
    assert (info.value.details["expected"], info.value.details["got"]) == ("BF16", "F32")
    p = plan(ck, [Dense(dtypes={r".*\.q\.weight": torch.float32})])
    assert p.where("model.layers.1.attn.q.weight") == ("model.layers.1.attn.q.weight", ())
    assert p.slabs["model.layers.1.attn.q.weight"].unit == "layers.1"


# --------------------------------------------------------------------------- other models

MIXTRAL = TieredMoE(
    pattern=(
        r"(?P<prefix>model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts)"
        r"\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<suffix>weight)"
    ),
    fusion={"w13": ("w1", "w3"), "w2": ("w2",)},
    schema={"weight": torch.float32},
    markers={},
    tier_suffix=None,
)


def mixtral(
    n_layers: int = 2, n_experts: int = 4, h: int = 8, i: int = 4
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for layer in range(n_layers):
        p = f"model.layers.{layer}.block_sparse_moe"
        out[f"{p}.gate.weight"] = torch.zeros(n_experts, h)
        for e in range(n_experts):
            out[f"{p}.experts.{e}.w1.weight"] = torch.zeros(i, h)
            out[f"{p}.experts.{e}.w3.weight"] = torch.zeros(i, h)
            out[f"{p}.experts.{e}.w2.weight"] = torch.zeros(h, i)
    return out


def test_mixtral_like_names(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", mixtral())
    p = plan(ck, [MIXTRAL, Dense()])
    assert p.extras["tiers"] == {0: {"all": 4}, 1: {"all": 4}}
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        assert p.slabs[f"{prefix}.all.w13.weight"].shape == (2, 4, 4, 8)
        assert p.slabs[f"{prefix}.all.w2.weight"].shape == (4, 8, 4)
        for e in range(4):
            assert p.where(f"{prefix}.{e}.w1.weight") == (f"{prefix}.all.w13.weight", (0, e))
            assert p.where(f"{prefix}.{e}.w3.weight") == (f"{prefix}.all.w13.weight", (1, e))
            assert p.where(f"{prefix}.{e}.w2.weight") == (f"{prefix}.all.w2.weight", (e,))
        gate = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        assert p.where(gate) == (gate, ())
    assert p.checked == ()
    assert p.skipped == ()


def test_expert_pattern_without_a_required_group(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", mixtral())
    rule = TieredMoE(
        pattern=r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<suffix>weight)",
        fusion=MIXTRAL.fusion,
        schema=MIXTRAL.schema,
        markers={},
        tier_suffix=None,
    )
    with pytest.raises(PlanError, match=r"pattern .* lacks the named groups \['layer'\]"):
        plan(ck, [rule, Dense()])


def test_mixtral_like_errors(tmp_path: Path) -> None:
    tensors = mixtral()
    tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = torch.zeros(
        4, 8, dtype=torch.bfloat16
    )
    with pytest.raises(DtypeMismatchError, match=r"suffix 'weight', layer 1, expert 2, shard 'w3'"):
        plan(write(tmp_path / "a", tensors), [MIXTRAL, Dense()])
    tensors = mixtral()
    for name in [n for n in tensors if ".experts.1." in n and n.startswith("model.layers.0.")]:
        del tensors[name]
    with pytest.raises(PartitionError, match=r"layer 0: .*experts in no group: 1$"):
        plan(write(tmp_path / "b", tensors), [MIXTRAL, Dense()])


# --------------------------------------------------------------------------- purity, summary


def test_planning_reads_no_payload(
    small: SyntheticCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(small.root, root)
    ck = Checkpoint.open(root)
    before = plan(ck, tier_map=dict(small.tier_map))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"plan() did I/O: {args!r}")

    with monkeypatch.context() as m:
        for name in ("open", "read", "pread", "readv", "preadv"):
            if hasattr(os, name):
                m.setattr(os, name, forbidden)
        m.setattr(builtins, "open", forbidden)
        m.setattr(io, "open", forbidden)
        during = plan(ck, tier_map=dict(small.tier_map))
    assert during == before

    # Garbage in every payload byte: the plan does not change.
    for shard in ck.files:
        with open(shard.path, "r+b") as f:
            f.seek(shard.data_start)
            f.write(os.urandom(shard.size - shard.data_start))
    assert plan(ck, tier_map=dict(small.tier_map)) == before
    assert plan(Checkpoint.open(root)).fingerprint == before.fingerprint


def test_summary_reports_tiers_per_layer(gen: SyntheticCheckpoint, gen_plan: Plan) -> None:
    summary = gen_plan.summary()
    json.dumps(summary)  # JSON-ready
    expected = {
        layer: {f"K{k}": n for k, n in sorted(Counter(tiers.values()).items())}
        for layer, tiers in gen.tier_map.items()
    }
    assert summary["tiers"] == expected
    assert summary["tensors_routed"] == len(gen_plan.routes)
    assert summary["tensors_checked"] == len(gen_plan.checked)
    assert summary["bytes"] == gen_plan.nbytes
    assert summary["files"] == 3
    assert summary["fingerprint"] == gen_plan.fingerprint
    assert sum(u["bytes"] for u in summary["units"].values()) == gen_plan.nbytes
    assert sum(u["tensors"] for u in summary["units"].values()) == len(gen_plan.routes)
    assert set(summary["groups"]) == {"K3", "K4"}
    assert "partitions" not in summary


def test_fingerprint_is_stable_and_sees_a_tier_change(
    small: SyntheticCheckpoint, tmp_path: Path
) -> None:
    again = write_synthetic(tmp_path / "again", small.spec)
    a, b = plan(Checkpoint.open(small.root)), plan(Checkpoint.open(again.root))
    assert a.fingerprint == b.fingerprint
    assert a.layout_fingerprint == b.layout_fingerprint
    # One file instead of two: routes move between files, the fingerprint does not.
    same = rewrite(small, tmp_path / "onefile", lambda t: None)
    assert plan(same).fingerprint == a.fingerprint

    layer, expert = 2, 0
    old = small.tier_map[layer][expert]
    new = 7 - old
    changed = plan(rewrite(small, tmp_path / "changed", lambda t: set_bits(t, layer, expert, new)))
    assert changed.fingerprint != a.fingerprint
    assert changed.layout_fingerprint != a.layout_fingerprint
    counts = Counter(small.tier_map[layer].values())
    counts[old] -= 1
    counts[new] += 1
    assert changed.summary()["tiers"][layer] == {f"K{k}": n for k, n in sorted(counts.items()) if n}
    assert changed.where(xname(layer, expert, "down_proj", "trellis")).slab == (
        f"model.layers.{layer}.mlp.experts.K{new}.w2.trellis"
    )


def test_stack_count_catches_missing_last_indices(tmp_path: Path) -> None:
    """Without a count, layers 0..2 of 4 look complete; with ``count=4`` they do not."""
    tensors = q_weights(4)
    del tensors["model.layers.3.attn.q.weight"]
    ck = write(tmp_path / "ck", tensors)
    assert plan(ck, [STACK]).slabs["model.layers.*.attn.q.weight"].slot_dims == (3,)
    with pytest.raises(CoverageError, match=r"1 of 4 slots have no tensor: \(3,\)"):
        plan(ck, [Stack(STACK.pattern, count=4)])
    with pytest.raises(CoverageError, match=r"index 2 is past count=2") as info:
        plan(ck, [Stack(STACK.pattern, count=2)])
    assert info.value.tensor == "model.layers.2.attn.q.weight"
    full = write(tmp_path / "full", q_weights(4))
    assert plan(full, [Stack(STACK.pattern, count=4)]).slabs[
        "model.layers.*.attn.q.weight"
    ].slot_dims == (4,)


def test_stack_count_of_any_integer_plans_the_same_layout(tmp_path: Path) -> None:
    import numpy as np

    full = write(tmp_path / "full", q_weights(4))
    as_int = plan(full, [Stack(STACK.pattern, count=4)])
    as_numpy = plan(full, [Stack(STACK.pattern, count=np.int64(4))])
    # A NumPy count was the slab's dims as is: another layout fingerprint, same bytes.
    assert as_numpy.layout_fingerprint == as_int.layout_fingerprint
    assert as_numpy.fingerprint == as_int.fingerprint
    for count in (4.0, True):
        with pytest.raises(PlanError, match=r"Stack\(count=.*\): expected an int"):
            Stack(STACK.pattern, count=count)  # type: ignore[arg-type]


def test_tiered_moe_n_experts_catches_a_missing_last_expert(tmp_path: Path) -> None:
    """Inferred from the headers, experts 0..2 look like all of them; ``n_experts=4`` says
    expert 3 is missing."""
    tensors: dict[str, torch.Tensor] = {}
    for expert in range(3):
        tensors.update(expert_tensors(1, expert, 3))
    ck = write(tmp_path / "ck", tensors)
    plan(ck)
    with pytest.raises(PartitionError, match=r"layer 1: .*experts in no group: 3$"):
        plan(ck, [TieredMoE(n_experts=4)])


# --------------------------------------------------------------------------- found by probing


def test_experts_of_two_towers_sharing_a_layer_number_are_refused(tmp_path: Path) -> None:
    # A second tower ("model.vision.") with experts 4..7 at layer 1: they were planned into
    # slabs named after the first tower's layer 1, silently.
    spec = SyntheticSpec(n_layers=2, n_experts=4, hidden=64, intermediate=32, vocab=128)
    ckpt = write_synthetic(tmp_path, spec)
    moved = {}
    for path in ckpt.files:
        for name, tensor in load_file(str(path)).items():
            m = EXPERT_RE.fullmatch(name)
            if m and int(m[1]) == 1:
                vision = name.replace("model.", "model.vision.", 1)
                moved[vision.replace(f"experts.{m[2]}.", f"experts.{int(m[2]) + 4}.", 1)] = tensor
    assert moved
    save_file(moved, str(tmp_path / "vision.safetensors"))
    index = json.loads(ckpt.index.read_text()) if ckpt.index else None
    if index is not None:
        index["weight_map"].update(dict.fromkeys(moved, "vision.safetensors"))
        ckpt.index.write_text(json.dumps(index))
    with pytest.raises(PartitionError, match="2 prefixes .* share this layer number") as info:
        plan(Checkpoint.open(tmp_path))
    assert info.value.tensor is not None
    assert info.value.tensor.startswith("model.vision.")


def test_a_tier_map_contradicting_n_experts_is_refused(tmp_path: Path) -> None:
    # n_experts was silently ignored once a tier map was given.
    ckpt = write_synthetic(tmp_path, SyntheticSpec(n_layers=2, n_experts=4))
    tier_map = load_tier_map(ckpt.tier_map_path)
    with pytest.raises(TierMapError, match="n_experts=8 says 0..7"):
        plan(Checkpoint.open(tmp_path), rules=[TieredMoE(tier_map=tier_map, n_experts=8), Dense()])
    plan(Checkpoint.open(tmp_path), rules=[TieredMoE(tier_map=tier_map, n_experts=4), Dense()])


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_pauses_the_cyclic_collector_and_restores_it(
    moe_checkpoint: SyntheticCheckpoint, enabled: bool
) -> None:
    # The collector walked the plan's objects again and again (35-60 % of planning time);
    # planning pauses it, and must leave it as the caller had it, also when it fails.
    import gc

    ckpt = Checkpoint.open(moe_checkpoint.root)
    seen: list[bool] = []

    class Spy(Dense):
        def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
            seen.append(gc.isenabled())
            return super().claim(checkpoint, pending)

    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        plan(ckpt, [Spy()])
        assert seen == [False]
        assert gc.isenabled() is enabled
        with pytest.raises(PlanError):
            plan(ckpt, [Spy()], unmatched="nonsense")  # type: ignore[arg-type]
        assert gc.isenabled() is enabled
    finally:
        if was:
            gc.enable()


def test_slot_offsets_are_row_major_and_out_of_range_slots_are_refused() -> None:
    spec = SlabSpec("s", "u", torch.float16, (2, 3), (4,))  # slots of 8 bytes
    assert [spec.slot_offset((i, j)) for i in range(2) for j in range(3)] == [
        8 * k for k in range(6)
    ]
    for bad in [(2, 0), (0, 3), (-1, 0), (0,), (0, 0, 0), ()]:
        with pytest.raises(PlanError, match="outside slab"):
            spec.slot_offset(bad)
    single = SlabSpec("d", "u", torch.float32, (), (5,))
    assert single.slot_offset(()) == 0
    with pytest.raises(PlanError, match="outside slab"):
        single.slot_offset((0,))


def test_one_shape_cut_into_other_slots_is_another_layout(tmp_path: Path) -> None:
    # Two slabs named alike, one (2,) slots of (4, 8), the other one slot of (2, 4, 8),
    # had one layout fingerprint: loading one plan into the other's slabs was allowed, then
    # view(), slot() and binding refused the tensors just loaded.
    stacked_dir, dense_dir = tmp_path / "stacked", tmp_path / "dense"
    stacked_dir.mkdir()
    dense_dir.mkdir()
    pair = {"w.0": torch.zeros(4, 8), "w.1": torch.ones(4, 8)}
    save_file(pair, str(stacked_dir / "m.safetensors"))
    save_file({"w.*": torch.zeros(2, 4, 8)}, str(dense_dir / "m.safetensors"))
    stacked = plan(Checkpoint.open(stacked_dir), [Stack(r"w\.(?P<index>\d+)", unit="globals")])
    dense = plan(Checkpoint.open(dense_dir), [Dense(unit_of=lambda name: "globals")])
    (a,), (b,) = stacked.slabs.values(), dense.slabs.values()
    assert (a.name, a.unit, a.dtype, a.shape) == (b.name, b.unit, b.dtype, b.shape)
    assert a.slot_dims != b.slot_dims
    assert stacked.layout_fingerprint != dense.layout_fingerprint


def test_every_remaining_tensor_includes_a_name_with_a_newline(tmp_path: Path) -> None:
    # The reference writes and reads such a name; Dense's ".*" did not match it, so the
    # default plan refused the checkpoint (UnmatchedTensorError).
    import asyncio

    from asyncslab import load

    tensors = {"nl\nname": torch.arange(4.0), "cr\rname": torch.ones(2), "ok": torch.zeros(3)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt)
    assert {r.tensor for r in p.routes} == set(tensors)

    async def loaded() -> None:
        async with await load(ckpt, p) as slabs:
            for name, t in tensors.items():
                assert torch.equal(slabs.view(name), t)

    asyncio.run(loaded())


def test_a_rule_dtype_must_be_a_torch_dtype() -> None:
    # A name ("bfloat16") was accepted, then failed at allocation with AttributeError.
    with pytest.raises(TypeError, match=r"Stack\(dtype=...\): a torch.dtype"):
        Stack(r"w\.(?P<index>\d+)", dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Dense\(dtypes=\{'x': ...\}\): a torch.dtype"):
        Dense(dtypes={"x": "f16"})  # type: ignore[dict-item]
    Stack(r"w\.(?P<index>\d+)", dtype=torch.bfloat16)
    Dense(dtypes={"x": torch.float16})


def test_stack_with_one_index_spelled_twice_and_another_missing(tmp_path: Path) -> None:
    """Layer 1 missing and layer 2 present twice ("2" and "02"): as many routes as slots, but
    two into slot (2,) and none into (1,). Accepted, slot 1 would be handed out as complete
    holding uninitialised bytes; the plan must refuse the second route into slot (2,)."""
    tensors = q_weights(4)
    del tensors["model.layers.1.attn.q.weight"]
    tensors["model.layers.02.attn.q.weight"] = torch.full((4, 4), 2.0)
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(CoverageError, match=r"slot \(2,\), already taken by") as info:
        plan(ck, [STACK])
    message = str(info.value)
    assert "model.layers.2.attn.q.weight" in message
    assert "model.layers.02.attn.q.weight" in message
    assert info.value.details["slot"] == (2,)


class _TwoSlabs:
    """A rule of one's own: ``a.0``, ``a.1`` into slots (0,), (1,) of slab ``a`` and ``b.0``,
    ``b.1`` into slots (0,), ``second`` of slab ``b`` (slab ``b``'s routes after ``a``'s)."""

    def __init__(self, second: Any) -> None:
        self.second = second

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        specs = {k: SlabSpec(k, "globals", torch.float32, (2,), (3,)) for k in "ab"}
        routes = [make_route(pending[f"{k}.{i}"], specs[k], (i,)) for k in "ab" for i in (0, 1)]
        # make_route refuses a float index: put it in afterwards, offset and all unchanged.
        routes[-1] = dataclasses.replace(routes[-1], slot=(self.second,))
        return Claim(slabs=tuple(specs.values()), routes=tuple(routes))


def test_a_float_slot_is_refused_even_beside_the_equal_int_slot(tmp_path: Path) -> None:
    """Slot (1.0,) of slab ``b`` equals slot (1,) of slab ``a`` as a key (same dims, same
    byte offset): a plan that took it would let the loader and view() disagree on what slot
    1.0 is. Everything else about the route is right (with slot (1,) the plan is accepted),
    so the refusal can only be for the float."""
    tensors = {
        f"{k}.{i}": torch.full((3,), 10.0 * j + i) for j, k in enumerate("ab") for i in (0, 1)
    }
    ck = write(tmp_path / "ck", tensors)
    ok = plan(ck, [_TwoSlabs(1)])
    assert ok.where("b.1") == ("b", (1,))
    with pytest.raises(
        CoverageError, match=r"slot \(1\.0,\), outside slab 'b'.*tuple of ints"
    ) as info:
        plan(ck, [_TwoSlabs(1.0)])
    assert info.value.tensor == "b.1"


class _Rewired:
    """A rule of one's own routing ``w`` and ``v`` (each (4, 3) float32) into one-slot slabs
    of their own, or their rows 0..2 with ``rows``; ``change`` then rewrites ``v``'s route."""

    def __init__(self, change: Callable[[Any, Mapping[str, TensorInfo]], Any], rows: bool) -> None:
        self.change, self.rows = change, rows

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        shape = (2, 3) if self.rows else (4, 3)
        specs = {k: SlabSpec(k, "globals", torch.float32, (), shape) for k in "wv"}
        rows = (0, 2) if self.rows else None
        routes = {k: make_route(pending[k], specs[k], (), rows=rows) for k in "wv"}
        routes["v"] = self.change(routes["v"], checkpoint.tensors)
        return Claim(slabs=tuple(specs.values()), routes=tuple(routes.values()))


def _as_is(route: Any, pending: Mapping[str, TensorInfo]) -> Any:
    return route


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
@pytest.mark.parametrize(
    "change",
    [
        # w's bytes (its offset, or its file too) under v's name
        lambda r, t: dataclasses.replace(r, src_offset=t["w"].offset + r.slice_start),
        # one element on: the last element of v's slot would be the next tensor's first
        lambda r, t: dataclasses.replace(r, src_offset=r.src_offset + 4),
        # another shard's bytes at the same offset
        lambda r, t: dataclasses.replace(r, file=t["x"].file),
    ],
    ids=["another tensor", "shifted", "another file"],
)
def test_a_route_must_read_its_own_tensors_bytes(
    tmp_path: Path, rows: bool, change: Callable[[Any, Mapping[str, TensorInfo]], Any]
) -> None:
    """The loader reads the bytes a route names. A custom rule's route that names another
    tensor's bytes (or a header's, or another file's) would fill its slot with them, and
    the plan would count as complete: the planner refuses it, naming the tensor and both
    byte ranges, whoever made the route."""
    w, v = torch.arange(12.0).reshape(4, 3), -torch.arange(12.0).reshape(4, 3)
    ck = write(tmp_path / "ck", {"w": w, "v": v})
    save_file({"x": torch.zeros(1)}, tmp_path / "ck" / "other.safetensors")
    ck = Checkpoint.open(tmp_path / "ck")
    assert ck.tensors["x"].file != ck.tensors["v"].file
    ok = plan(ck, [_Rewired(_as_is, rows)], ignore=["x"])  # the same rule, unchanged: fine
    assert ok.where("v") == ("v", ())
    with pytest.raises(PlanError, match=r"tensor 'v': reads bytes \[\d+, \d+\) of ") as info:
        plan(ck, [_Rewired(change, rows)], ignore=["x"])
    info_v = ck.tensors["v"]
    assert info.value.details["expected"] == (info_v.offset, info_v.offset + info_v.nbytes)
    assert "make_route" in str(info.value)


@pytest.mark.parametrize(
    "change",
    [
        # half a row in: rows that straddle two of the tensor's rows
        lambda r, t: dataclasses.replace(r, src_offset=r.src_offset + 6, slice_start=6),
        # rows 3..5 of a tensor of 4 rows: the last row is past its end
        lambda r, t: dataclasses.replace(r, src_offset=r.src_offset + 36, slice_start=36),
        # rows of another width, same byte count
        lambda r, t: dataclasses.replace(r, shape=(3, 2)),
    ],
    ids=["half a row in", "past the end", "other rows"],
)
def test_a_row_slice_must_be_whole_rows_of_its_tensor(
    tmp_path: Path, change: Callable[[Any, Mapping[str, TensorInfo]], Any]
) -> None:
    """A sliced route carries rows of its tensor (``make_route(..., rows=...)``); one that
    starts inside a row, runs past the tensor's end or reads rows of another width would
    load bytes that are not those rows."""
    w, v = torch.arange(12.0).reshape(4, 3), -torch.arange(12.0).reshape(4, 3)
    ck = write(tmp_path / "ck", {"w": w, "v": v})

    class Sliced(_Rewired):
        def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
            claim = super().claim(checkpoint, pending)
            if self.change is not _as_is and claim.routes[-1].shape == (3, 2):
                specs = (claim.slabs[0], dataclasses.replace(claim.slabs[1], item_shape=(3, 2)))
                return Claim(slabs=specs, routes=claim.routes)
            return claim

    assert plan(ck, [Sliced(_as_is, True)]).where("v") == ("v", ())
    with pytest.raises(PlanError, match=r"tensor 'v': reads bytes .*, not whole rows of it"):
        plan(ck, [Sliced(change, True)])


# ------------------------------------------------------------ mutation audit (rules, MoE)


def test_a_rank_missing_from_every_expert_is_named(tmp_path: Path) -> None:
    """Sliced into ranks 0..2 with every rank-1 slice gone: counting the ranks present (2)
    instead of reading the largest (2 + 1) took 0 and 2 for a complete pair, so rank 0
    planned as if nothing were missing, and rank 2 was told the checkpoint has ranks 0..1."""
    tensors = moe_layer(1, [3, 4, 3], ranks=3, inter=3 * INTER)
    for name in [n for n in tensors if ".rank1." in n]:
        del tensors[name]
    ck = write(tmp_path / "ck", tensors)
    for rank in (0, 2):
        with pytest.raises(
            CoverageError, match=r"rank slices 1 missing \(checkpoint has ranks 0\.\.2\)"
        ) as info:
            plan(ck, rank=rank)
        assert info.value.details["missing_ranks"] == [1]


def test_a_stray_expert_id_is_refused_before_sizing_the_partition(tmp_path: Path) -> None:
    """Without ``n_experts`` or a tier map, the expert count comes from the largest id; one
    stray id (``experts.1000``, or ``10**9``) must be refused as such, not make a partition
    of that many experts (memory and time in its size) and list hundreds of "missing"
    experts."""
    tensors = {**moe_layer(1, [3, 4]), **expert_tensors(1, 1000, 3)}
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        PartitionError,
        match=r"layer 1: expert ids run to 1000, but only 3 experts are present; "
        r"pass n_experts= or a tier map",
    ) as info:
        plan(ck)
    assert info.value.details["layer"] == 1


def test_an_expert_without_a_tier_tensor_is_named_as_such(tmp_path: Path) -> None:
    """Expert 1 has its scales but no trellis, so no tier. The error must say that, not
    "experts in no group: 1" (a partition error about an expert whose tensors are there)."""
    tensors = moe_layer(1, [3, 4, 3])
    for proj in PROJS:
        del tensors[xname(1, 1, proj, "trellis")]
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        CoverageError, match=r"layer 1: experts 1 have no 'trellis' tensor, so their tier"
    ) as info:
        plan(ck)
    assert info.value.details["experts"] == [1]


def test_a_stray_stack_index_is_refused_as_such(tmp_path: Path) -> None:
    """Without ``count``, a stray index (``layers.1000``) would size the slab 1001 slots: it
    is refused by name instead of listing ~1000 "empty" slots (or, for an index like 10**12,
    planning a slab of that many)."""
    tensors = {**q_weights(2), "model.layers.1000.attn.q.weight": torch.zeros(4, 4)}
    ck = write(tmp_path / "ck", tensors)
    with pytest.raises(
        CoverageError, match=r"indices run to 1000, but only 3 tensors are present"
    ) as info:
        plan(ck, [STACK])
    assert info.value.tensor is not None


def test_stack_dtype_is_required_even_when_the_members_agree(tmp_path: Path) -> None:
    """``Stack(dtype=...)`` states the precision a model needs: members that agree among
    themselves on another dtype are still refused (rule 5), never stacked as they are."""
    ck = write(tmp_path / "ck", q_weights(3))
    with pytest.raises(DtypeMismatchError, match=r"dtype F32, plan expects BF16"):
        plan(ck, [Stack(STACK.pattern, dtype=torch.bfloat16)])
    p = plan(ck, [Stack(STACK.pattern, dtype=torch.float32)])
    assert p.slabs["model.layers.*.attn.q.weight"].dtype == torch.float32


def test_dense_dtypes_first_full_match_wins(tmp_path: Path) -> None:
    """``Dense(dtypes=...)``: the first pattern that matches the *whole* name decides. A
    prefix match (``model\\.layers\\.0`` against ``model.layers.0.attn.q.weight``) or a
    later catch-all winning would require bfloat16 of float32 tensors and refuse a correct
    checkpoint."""
    ck = write(tmp_path / "ck", q_weights(2))
    rule = Dense(
        dtypes={
            r"model\.layers\.0": torch.bfloat16,
            r".*\.q\.weight": torch.float32,
            r".*": torch.bfloat16,
        }
    )
    p = plan(ck, [rule])
    assert {s.dtype for s in p.slabs.values()} == {torch.float32}


def test_dense_pattern_claims_only_whole_names(tmp_path: Path) -> None:
    """``Dense(pattern)`` claims tensors whose whole name matches: ``w`` must not also claim
    ``w.scale`` (which would then land in the wrong rule's unit, or dtype requirement)."""
    tensors = {"w": torch.zeros(4), "w.scale": torch.ones(2, dtype=torch.float16)}
    ck = write(tmp_path / "ck", tensors)
    p = plan(ck, [Dense("w", unit_of=lambda name: "weights"), Dense(unit_of=lambda name: "rest")])
    assert p.slabs["w"].unit == "weights"
    assert p.slabs["w.scale"].unit == "rest"


def test_expert_major_slabs_say_so_in_shape_and_label(tmp_path: Path) -> None:
    """An engine picks its kernel from a slab's ``layout`` label: an expert-major W13 slab
    must be ``(n, 2, ...)`` and labelled ``expert_major`` (a ``shard_major`` label on it
    would have the engine read gate rows as up rows)."""
    ck = write(tmp_path / "ck", moe_layer(1, [3, 4, 3]))
    p = plan(ck, [TieredMoE(layout="expert_major")])
    w13 = p.slabs["model.layers.1.mlp.experts.K3.w13.trellis"]
    assert w13.slot_dims == (2, 2)
    assert w13.labels["layout"] == "expert_major"
    assert p.where(xname(1, 2, "up_proj", "trellis")).slot == (1, 1)
    assert p.slabs["model.layers.1.mlp.experts.K4.w13.suh"].slot_dims == (1, 2)
    assert p.slabs["model.layers.1.mlp.experts.K4.w2.svh"].labels["layout"] == "expert_major"


def test_a_tier_map_is_not_silently_ignored_without_a_tier_suffix(tmp_path: Path) -> None:
    """Mixtral-like experts in one group (``tier_suffix=None``) and a declared tier map
    naming experts 0..1 of layer 0 when 0..3 exist: the map is verified nowhere, so the plan
    was accepted as if none were given. The combination is refused when the rule is made,
    saying why."""
    ck = write(tmp_path / "ck", mixtral())
    assert plan(ck, [MIXTRAL, Dense()]).extras["partitions"]  # without the map: fine
    with pytest.raises(PlanError, match=r"tier_suffix=None\) puts every expert in one group"):
        dataclasses.replace(MIXTRAL, tier_map={0: {0: 3, 1: 4}, 1: {0: 9}})

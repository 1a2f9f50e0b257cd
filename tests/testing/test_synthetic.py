"""Behaviour of the synthetic checkpoint generator, checked through the real safetensors reader."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, spec_for_size, write_synthetic
from asyncslab.testing._fill import MCG_MARKER, MUL1_MARKER, fill_pattern
from asyncslab.testing._synthetic import expected_tensors

EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(?:rank(\d+)\.)?(\w+)$"
)


def read_all(ck: SyntheticCheckpoint) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file name, tensor) over every shard, failing on duplicates."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for path in ck.files:
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert name not in out, f"{name} written twice"
                out[name] = (path.name, f.get_tensor(name))
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tiers_from_trellis(
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[int, dict[int, int]]:
    tiers: dict[int, dict[int, int]] = {}
    for name, (_, shape) in expected.items():
        m = EXPERT_RE.match(name)
        if m and m.group(5) == "trellis":
            layer, expert, bits = int(m.group(1)), int(m.group(2)), shape[-1] // 16
            assert tiers.setdefault(layer, {}).setdefault(expert, bits) == bits
    return tiers


@pytest.fixture(scope="module")
def default_ck(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    return write_synthetic(tmp_path_factory.mktemp("default"))


def test_files_hold_exactly_the_expected_tensors(default_ck: SyntheticCheckpoint) -> None:
    spec = default_ck.spec
    expected = expected_tensors(spec)
    got = read_all(default_ck)
    assert set(got) == set(expected)
    for name, (dtype, shape) in expected.items():
        t = got[name][1]
        assert (t.dtype, tuple(t.shape)) == (dtype, shape), name
    assert default_ck.n_tensors == len(expected)
    assert default_ck.total_bytes == sum(t.nbytes for _, t in got.values())
    assert [p.name for p in default_ck.files] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    # Every tensor kind the spec promises, with the promised shapes.
    H, inter, E = spec.hidden, spec.intermediate, spec.n_experts
    assert expected["model.embed_tokens.weight"] == (torch.bfloat16, (spec.vocab, H))
    assert expected["model.layers.0.mlp.down_proj.weight"] == (torch.bfloat16, (H, inter))
    assert expected["model.layers.1.mlp.gate.weight"] == (torch.bfloat16, (E, H))
    assert expected["model.layers.1.mlp.shared_experts.up_proj.weight"] == (
        torch.bfloat16,
        (inter, H),
    )
    assert "model.layers.0.mlp.gate.weight" not in expected
    assert "model.layers.1.mlp.up_proj.weight" not in expected
    k = default_ck.tier_map[1][0]
    assert expected["model.layers.1.mlp.experts.0.down_proj.trellis"] == (
        torch.int16,
        (inter // 16, H // 16, 16 * k),
    )
    assert expected["model.layers.1.mlp.experts.0.down_proj.suh"] == (torch.float16, (inter,))
    assert expected["model.layers.1.mlp.experts.0.down_proj.svh"] == (torch.float16, (H,))
    assert list(expected)[0] == "model.embed_tokens.weight"
    assert list(expected)[-2:] == ["model.norm.weight", "lm_head.weight"]


def test_random_fill_has_the_promised_distributions(default_ck: SyntheticCheckpoint) -> None:
    got = read_all(default_ck)
    dense = got["model.layers.0.self_attn.q_proj.weight"][1].float()
    assert abs(dense.std().item() - 0.02) < 0.002
    norm = got["model.layers.0.input_layernorm.weight"][1].float()
    assert torch.allclose(norm, torch.ones_like(norm), atol=0.1)
    trellis = got["model.layers.1.mlp.experts.0.gate_proj.trellis"][1]
    assert trellis.min().item() < -30000
    assert trellis.max().item() > 30000
    suh = got["model.layers.1.mlp.experts.0.gate_proj.suh"][1].float()
    assert 0.7 < suh.std().item() < 1.3


def test_markers_are_fixed_constants(default_ck: SyntheticCheckpoint, tmp_path: Path) -> None:
    got = read_all(default_ck)
    mcg = got["model.layers.2.mlp.experts.3.up_proj.mcg"][1]
    mul1 = got["model.layers.2.mlp.experts.3.up_proj.mul1"][1]
    assert mcg.dtype == mul1.dtype == torch.int32
    assert mcg.shape == ()
    assert mul1.shape == (1,)
    assert mcg.item() == MCG_MARKER
    assert mul1.tolist() == [MUL1_MARKER]
    bare = expected_tensors(SyntheticSpec(markers=False))
    assert not any(n.endswith((".mcg", ".mul1")) for n in bare)
    assert len(bare) == len(expected_tensors(SyntheticSpec())) - 2 * 3 * 8 * 3


def test_index_matches_files(default_ck: SyntheticCheckpoint) -> None:
    assert default_ck.index == default_ck.root / "model.safetensors.index.json"
    doc = json.loads(default_ck.index.read_text())
    assert doc["metadata"]["total_size"] == default_ck.total_bytes
    weight_map = doc["weight_map"]
    assert set(weight_map) == set(expected_tensors(default_ck.spec))
    assert set(weight_map.values()) == {p.name for p in default_ck.files}
    for path in default_ck.files:
        with safe_open(path, framework="pt") as f:
            assert set(f.keys()) == {n for n, fn in weight_map.items() if fn == path.name}


def test_shards_are_roughly_equal_and_an_expert_straddles_files(
    default_ck: SyntheticCheckpoint,
) -> None:
    got = read_all(default_ck)
    per_file = {p.name: 0 for p in default_ck.files}
    files_of_expert: dict[tuple[int, int], set[str]] = {}
    for name, (fname, t) in got.items():
        per_file[fname] += t.nbytes
        if m := EXPERT_RE.match(name):
            files_of_expert.setdefault((int(m.group(1)), int(m.group(2))), set()).add(fname)
    mean = default_ck.total_bytes / len(per_file)
    assert all(0.6 * mean < b < 1.4 * mean for b in per_file.values()), per_file
    assert any(len(files) > 1 for files in files_of_expert.values())


def test_writes_are_deterministic(tmp_path: Path) -> None:
    spec = SyntheticSpec(n_layers=3, n_experts=4)
    a = write_synthetic(tmp_path / "a", spec)
    b = write_synthetic(tmp_path / "b", spec)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len(names) == len(a.files) + 2  # shards, index, tier map
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a.tier_map == b.tier_map
    assert a.total_bytes == b.total_bytes


def test_seed_changes_content_and_tier_draw(tmp_path: Path) -> None:
    a = write_synthetic(tmp_path / "a", SyntheticSpec(seed=0, n_layers=3))
    b = write_synthetic(tmp_path / "b", SyntheticSpec(seed=1, n_layers=3))
    assert a.tier_map != b.tier_map
    ta, tb = read_all(a), read_all(b)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert raw(ta[name][1]) != raw(tb[name][1])


def test_tier_map_matches_trellis_widths(default_ck: SyntheticCheckpoint) -> None:
    spec = default_ck.spec
    on_disk = json.loads(default_ck.tier_map_path.read_text())
    assert default_ck.tier_map_path == default_ck.root / "tier_map.json"
    parsed = {int(layer): {int(e): bits for e, bits in d.items()} for layer, d in on_disk.items()}
    assert parsed == {layer: dict(d) for layer, d in default_ck.tier_map.items()}
    assert set(parsed) == set(range(spec.first_dense, spec.n_layers))
    got = read_all(default_ck)
    seen = 0
    for name, (_, t) in got.items():
        m = EXPERT_RE.match(name)
        if m and m.group(5) == "trellis":
            assert t.shape[-1] // 16 == parsed[int(m.group(1))][int(m.group(2))], name
            seen += 1
    assert seen == (spec.n_layers - spec.first_dense) * spec.n_experts * 3
    for layer, draw in parsed.items():
        assert set(draw) == set(range(spec.n_experts))
        assert set(draw.values()) == set(spec.bits), layer


@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**32),
    bits=st.lists(st.integers(1, 8), min_size=1, max_size=4, unique=True),
    extra_experts=st.integers(0, 10),
    n_layers=st.integers(1, 4),
)
def test_every_tier_is_populated_in_every_moe_layer(
    seed: int, bits: list[int], extra_experts: int, n_layers: int
) -> None:
    spec = SyntheticSpec(
        n_layers=n_layers,
        first_dense=0,
        n_experts=len(bits) + extra_experts,
        bits=tuple(bits),
        seed=seed,
        n_shards=1,
    )
    tiers = tiers_from_trellis(expected_tensors(spec))
    assert set(tiers) == set(range(n_layers))
    for draw in tiers.values():
        assert set(draw) == set(range(spec.n_experts))
        assert set(draw.values()) == set(bits)


def test_lowest_tier_holds_roughly_58_percent() -> None:
    spec = SyntheticSpec(n_layers=17, first_dense=1, n_experts=64, n_shards=1)
    tiers = tiers_from_trellis(expected_tensors(spec))
    draws = [b for d in tiers.values() for b in d.values()]
    assert 0.50 < draws.count(3) / len(draws) < 0.66


def test_tp_ranks_write_pre_sliced_rank_tensors(tmp_path: Path) -> None:
    spec = SyntheticSpec(tp_ranks=2, n_layers=2)
    ck = write_synthetic(tmp_path, spec)
    got = read_all(ck)
    assert set(got) == set(expected_tensors(spec))
    H, inter_local = spec.hidden, spec.intermediate // 2
    ranks_seen = set()
    for name, (_, t) in got.items():
        m = EXPERT_RE.match(name)
        if not m:
            continue
        assert m.group(4) is not None, f"unsliced expert tensor {name}"
        ranks_seen.add(int(m.group(4)))
        proj, suffix = m.group(3), m.group(5)
        n_in, n_out = (H, inter_local) if proj != "down_proj" else (inter_local, H)
        bits = ck.tier_map[int(m.group(1))][int(m.group(2))]
        want = {
            "trellis": (n_in // 16, n_out // 16, 16 * bits),
            "suh": (n_in,),
            "svh": (n_out,),
            "mcg": (),
            "mul1": (1,),
        }
        assert tuple(t.shape) == want[suffix], name
    assert ranks_seen == {0, 1}
    # Shared experts and dense MLPs stay whole.
    assert tuple(got["model.layers.1.mlp.shared_experts.gate_proj.weight"][1].shape) == (
        spec.intermediate,
        H,
    )
    # Ranks hold different slices, not copies.
    r0 = got["model.layers.1.mlp.experts.0.gate_proj.rank0.trellis"][1]
    r1 = got["model.layers.1.mlp.experts.0.gate_proj.rank1.trellis"][1]
    assert not torch.equal(r0, r1)


def test_single_shard_writes_model_safetensors_without_index(tmp_path: Path) -> None:
    ck = write_synthetic(tmp_path, SyntheticSpec(n_shards=1, n_layers=2))
    assert ck.index is None
    assert ck.files == (tmp_path / "model.safetensors",)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "tier_map.json"]
    assert set(read_all(ck)) == set(expected_tensors(ck.spec))


def test_spec_for_size_hits_its_target(tmp_path: Path) -> None:
    target = 64 << 20
    spec = spec_for_size(target)
    assert spec.fill == "random"  # below the pattern threshold
    assert spec.hidden >= 4 * spec.intermediate // spec.tp_ranks
    assert spec.n_experts >= 8
    ck = write_synthetic(tmp_path, spec)
    assert abs(ck.total_bytes - target) <= 0.1 * target
    on_disk = sum(p.stat().st_size for p in ck.files)
    assert abs(on_disk - target) <= 0.1 * target


@pytest.mark.parametrize("target", [1 << 30, 16 << 30])
def test_spec_for_size_scales_without_writing(target: int) -> None:
    spec = spec_for_size(target)
    size = sum(
        math.prod(shape) * dtype.itemsize for dtype, shape in expected_tensors(spec).values()
    )
    assert abs(size - target) <= 0.1 * target
    assert spec.fill == "pattern"
    assert size / spec.n_shards <= 1.1 * (1 << 30)
    assert spec.hidden >= 2 * spec.intermediate


def test_spec_for_size_respects_overrides() -> None:
    spec = spec_for_size(1 << 30, tp_ranks=4, seed=7, fill="random", n_shards=5)
    assert (spec.tp_ranks, spec.seed, spec.fill, spec.n_shards) == (4, 7, "random", 5)
    assert spec.intermediate % (16 * 4) == 0


def test_pattern_fill_is_distinct_per_tensor_and_per_block(tmp_path: Path) -> None:
    # hidden=1024 makes q/k projections (2 MiB) span several pattern blocks.
    spec = SyntheticSpec(fill="pattern", hidden=1024, n_layers=2, n_experts=2, vocab=64)
    ck = write_synthetic(tmp_path / "a", spec)
    got = read_all(ck)
    q = raw(got["model.layers.0.self_attn.q_proj.weight"][1])
    k = raw(got["model.layers.0.self_attn.k_proj.weight"][1])
    assert q != k
    assert len(set(q[:4096])) > 200  # not a constant or short-period fill
    half = len(q) // 2
    assert q[:half] != q[half:]
    t0 = raw(got["model.layers.1.mlp.experts.0.up_proj.suh"][1])
    t1 = raw(got["model.layers.1.mlp.experts.1.up_proj.suh"][1])
    assert t0 != t1
    assert set(read_all(ck)) == set(expected_tensors(spec))
    again = write_synthetic(tmp_path / "b", spec)
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(ck.files, again.files, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden": 100}, "hidden"),
        ({"intermediate": 48, "tp_ranks": 2}, "intermediate"),
        ({"bits": (3, 3)}, "bits"),
        ({"bits": (9,)}, "bits"),
        ({"first_dense": 5}, "first_dense"),
        ({"n_shards": 10_000}, "n_shards"),
        ({"fill": "zeros"}, "fill"),
        ({"dense_dtype": torch.int8}, "dense_dtype"),
        ({"dense_dtype": torch.float8_e4m3fn}, "dense_dtype"),
    ],
)
def test_invalid_specs_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticSpec(**kwargs)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float16, (3,)),
        (torch.int32, (3,)),
        (torch.uint8, (5,)),
        (torch.bfloat16, (4, 300_000)),
    ],
)
def test_pattern_fill_handles_any_byte_length(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # Shapes whose byte length is not a multiple of 8 take the narrower-word paths.
    a, b = fill_pattern(dtype, shape, 1), fill_pattern(dtype, shape, 2)
    assert (a.dtype, tuple(a.shape)) == (dtype, shape)
    assert raw(a) == raw(fill_pattern(dtype, shape, 1))
    assert raw(a) != raw(b)

"""Binding into modules: parameters and buffers become views of slabs — dense weights one to
one, a layer's expert weights per tier as stacked views — with nothing copied, nothing left
unbound silently, and nothing changed when binding fails (CONTEXT rules 4 and 6)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import asyncslab
import asyncslab.testing
from asyncslab import (
    BindError,
    Checkpoint,
    IncompleteLoadError,
    LoadOptions,
    LoadStatistics,
    Plan,
    SlabSet,
    bind_module,
    load,
    plan,
)
from asyncslab.testing import SyntheticCheckpoint
from support.faults import raw_bytes

LAYER = 1  # the synthetic checkpoint's first MoE layer (first_dense=1)
PREFIX = f"model.layers.{LAYER}."
DENSE = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "input_layernorm.weight")
ROUTER = "mlp.gate.weight"
FUSION = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
SUFFIXES = ("trellis", "suh", "svh")


# --------------------------------------------------------------------------- the toy module


class Projection(nn.Module):
    """One tier's fused projection: trellis and suh as parameters, svh as a buffer."""

    def __init__(self, plan: Plan, slab_prefix: str) -> None:
        super().__init__()
        for suffix in SUFFIXES:
            spec = plan.slabs[f"{slab_prefix}.{suffix}"]
            empty = torch.empty(spec.shape, dtype=spec.dtype)
            if suffix == "svh":
                self.register_buffer(suffix, empty)
            else:
                self.register_parameter(suffix, nn.Parameter(empty, requires_grad=False))

    def score(self) -> torch.Tensor:
        """One number per (shard, expert) slot, from every code and scale of the slot."""
        codes = self.trellis.float().flatten(start_dim=self.suh.dim() - 1)
        return codes.mean(-1) * self.suh.float().mean(-1) * self.svh.float().mean(-1)


class Toy(nn.Module):
    """Mirrors layer 1 of the synthetic checkpoint: attention and norm weights, the router,
    and each tier's stacked expert slabs. Its names are the checkpoint's minus the prefix
    (``mlp.experts.K3.w13.trellis``), so the mapping is ``PREFIX + name``."""

    def __init__(self, plan: Plan, groups: tuple[str, ...]) -> None:
        super().__init__()
        hidden = plan.slabs[PREFIX + "input_layernorm.weight"].shape[0]
        n_experts = plan.slabs[PREFIX + ROUTER].shape[0]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.self_attn.k_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(hidden, n_experts, bias=False, dtype=torch.bfloat16)
        self.mlp.experts = nn.ModuleDict(
            {
                g: nn.ModuleDict(
                    {f: Projection(plan, f"{PREFIX}mlp.experts.{g}.{f}") for f in FUSION}
                )
                for g in groups
            }
        )
        # A buffer no checkpoint has: never mapped, and binding must leave it alone.
        self.register_buffer("scratch", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (self.self_attn.q_proj(x) + self.self_attn.k_proj(x)) * self.input_layernorm.weight
        parts = [h.float().flatten(), self.mlp.gate(h).float().flatten()]
        for group in self.mlp.experts.values():
            parts.extend(proj.score().flatten() for proj in group.values())
        return torch.cat(parts)


def to_slab(name: str) -> str | None:
    """The callable form of the mapping: the checkpoint's prefix, ``scratch`` unbound."""
    return None if name == "scratch" else PREFIX + name


def names_of(module: nn.Module) -> list[str]:
    return [
        *(n for n, _ in module.named_parameters(remove_duplicate=False)),
        *(n for n, _ in module.named_buffers(remove_duplicate=False)),
    ]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer object, to prove a failed bind changed nothing."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def assert_unchanged(module: nn.Module, before: Mapping[str, torch.Tensor]) -> None:
    after = snapshot(module)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name] is tensor, f"{name} was replaced"


# --------------------------------------------------------------------------- fixtures


async def load_layer(written: SyntheticCheckpoint) -> tuple[Checkpoint, SlabSet]:
    ckpt = Checkpoint.open(written.root)
    slabs = await load(ckpt, plan(ckpt, tier_map=written.tier_map_path))
    return ckpt, slabs


def tier_groups(written: SyntheticCheckpoint) -> dict[str, list[int]]:
    """Layer 1's tiers, from the tier map written beside the checkpoint (not from the plan):
    group ``K<bits>``, members in expert-id order."""
    groups: dict[str, list[int]] = {}
    for expert, bits in sorted(written.tier_map[LAYER].items()):
        groups.setdefault(f"K{bits}", []).append(expert)
    return dict(sorted(groups.items()))


def read_layer(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of layer 1, read the old way with the safetensors library."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in ckpt.files:
        with safe_open(str(shard.path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.startswith(PREFIX):
                    tensors[name.removeprefix(PREFIX)] = f.get_tensor(name)
    return tensors


def reference_state(
    tensors: Mapping[str, torch.Tensor], groups: Mapping[str, list[int]]
) -> dict[str, torch.Tensor]:
    """The toy's state dict built as engines build it tensor by tensor: dense weights as
    they are, each tier's experts stacked with ``torch.stack`` (W13: gate then up)."""
    state = {name: tensors[name] for name in (*DENSE, ROUTER)}
    for group, members in groups.items():
        for suffix in SUFFIXES:
            state[f"mlp.experts.{group}.w13.{suffix}"] = torch.stack(
                [
                    torch.stack([tensors[f"mlp.experts.{e}.{proj}.{suffix}"] for e in members])
                    for proj in FUSION["w13"]
                ]
            )
            state[f"mlp.experts.{group}.w2.{suffix}"] = torch.stack(
                [tensors[f"mlp.experts.{e}.down_proj.{suffix}"] for e in members]
            )
    state["scratch"] = torch.arange(4.0)
    return state


def make_input(hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(5, hidden, generator=g).to(torch.bfloat16)


# --------------------------------------------------------------------------- binding


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["dict", "callable"])
async def test_binds_dense_and_tier_slabs_without_copying(
    moe_checkpoint: SyntheticCheckpoint, form: str
) -> None:
    ckpt, slabs = await load_layer(moe_checkpoint)
    groups = tier_groups(moe_checkpoint)
    assert len(groups) == 2  # both tiers present, so both stacked layouts are exercised
    toy = Toy(slabs.plan, tuple(groups))
    names = [n for n in names_of(toy) if n != "scratch"]
    mapping: Mapping[str, str] | Callable[[str], str | None] = (
        {n: PREFIX + n for n in names} if form == "dict" else to_slab
    )
    scratch = toy.scratch

    views = bind_module(toy, slabs, mapping)

    assert sorted(views) == sorted(names)
    bound = snapshot(toy)
    expected = reference_state(read_layer(ckpt), groups)
    for name in names:
        slab = slabs.slab(PREFIX + name)
        tensor = bound[name]
        # Pointer identity, backing to module: the module computes on the slab itself.
        assert tensor.data_ptr() == slab.data_ptr(), name
        assert tensor.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr(), name
        assert views[name].data_ptr() == slab.data_ptr(), name
        assert (tensor.shape, tensor.dtype) == (slab.shape, slab.dtype), name
        assert torch.equal(raw_bytes(tensor), raw_bytes(expected[name])), name
    params = dict(toy.named_parameters())
    assert all(isinstance(p, nn.Parameter) and not p.requires_grad for p in params.values())
    # Buffers bind too (svh), and stay buffers; an unmapped buffer is left as it was.
    buffers = dict(toy.named_buffers())
    assert {n for n in buffers if n.endswith(".svh")} == {n for n in names if n.endswith(".svh")}
    assert not any(n.endswith(".svh") for n in params)
    assert toy.scratch is scratch


@pytest.mark.asyncio
async def test_bound_forward_equals_state_dict_copy(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt, slabs = await load_layer(moe_checkpoint)
    groups = tier_groups(moe_checkpoint)
    bound = Toy(slabs.plan, tuple(groups))
    bind_module(bound, slabs, to_slab)
    # The old way: per-expert tensors from safetensors, stacked, copied in by load_state_dict.
    copied = Toy(slabs.plan, tuple(groups))
    copied.load_state_dict(reference_state(read_layer(ckpt), groups), strict=True)

    x = make_input(bound.input_layernorm.weight.shape[0])
    with torch.no_grad():
        got, want = bound(x), copied(x)
    assert got.shape == want.shape
    assert torch.equal(raw_bytes(got), raw_bytes(want))


@pytest.mark.asyncio
async def test_slot_views_point_into_the_tier_slab(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """``(slab, slot)`` binds one expert's shard; a slot prefix binds a stacked view (every
    expert's gate shard of a tier). Each view starts at the slab's base plus its offset."""
    ckpt, slabs = await load_layer(moe_checkpoint)
    groups = tier_groups(moe_checkpoint)
    tensors = read_layer(ckpt)
    group, members = next(iter(groups.items()))
    slab_name = f"{PREFIX}mlp.experts.{group}.w13.trellis"
    spec = slabs.plan.slabs[slab_name]
    slab = slabs.slab(slab_name)

    module = nn.Module()
    mapping: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard, proj in enumerate(FUSION["w13"]):
        for offset, expert in enumerate(members):
            name = f"e{expert}_{proj}"
            empty = torch.empty(spec.item_shape, dtype=spec.dtype)
            module.register_parameter(name, nn.Parameter(empty, requires_grad=False))
            mapping[name] = (slab_name, (shard, offset))
    gates = torch.empty(spec.shape[1:], dtype=spec.dtype)
    module.register_buffer("all_gates", gates)
    mapping["all_gates"] = (slab_name, (0,))

    views = bind_module(module, slabs, mapping)

    for name, (_, slot) in mapping.items():
        tensor = getattr(module, name)
        # A slot prefix starts where its first full slot does.
        first = slot + (0,) * (len(spec.slot_dims) - len(slot))
        assert tensor.data_ptr() == slab.data_ptr() + spec.slot_offset(first)
        assert tensor.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
        assert views[name].data_ptr() == tensor.data_ptr()
    for proj in FUSION["w13"]:
        for expert in members:
            want = tensors[f"mlp.experts.{expert}.{proj}.trellis"]
            assert torch.equal(getattr(module, f"e{expert}_{proj}"), want)
            assert torch.equal(slabs.view(f"{PREFIX}mlp.experts.{expert}.{proj}.trellis"), want)
    assert torch.equal(
        module.all_gates,
        torch.stack([tensors[f"mlp.experts.{e}.gate_proj.trellis"] for e in members]),
    )


@pytest.mark.asyncio
async def test_reload_in_place_keeps_bound_pointers(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt, slabs = await load_layer(moe_checkpoint)
    toy = Toy(slabs.plan, tuple(tier_groups(moe_checkpoint)))
    bind_module(toy, slabs, to_slab)
    pointers = {n: t.data_ptr() for n, t in snapshot(toy).items()}
    x = make_input(toy.input_layernorm.weight.shape[0])
    with torch.no_grad():
        before = toy(x)
    with torch.no_grad():
        slabs.slab(PREFIX + "self_attn.q_proj.weight").zero_()
        assert not torch.equal(toy(x), before)  # the module reads the slab itself
    slabs.reset()
    await slabs.load(ckpt)
    assert {n: t.data_ptr() for n, t in snapshot(toy).items()} == pointers
    with torch.no_grad():
        assert torch.equal(raw_bytes(toy(x)), raw_bytes(before))


# --------------------------------------------------------------------------- refusals


@pytest.mark.asyncio
async def test_unbound_parameter_is_listed_and_nothing_changes(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    _, slabs = await load_layer(moe_checkpoint)
    groups = tuple(tier_groups(moe_checkpoint))
    toy = Toy(slabs.plan, groups)
    before = snapshot(toy)
    forgotten = {"self_attn.k_proj.weight", f"mlp.experts.{groups[0]}.w2.suh"}

    def partial(name: str) -> str | None:
        return None if name in forgotten else to_slab(name)

    with pytest.raises(BindError, match=r"2 parameters left unbound") as caught:
        bind_module(toy, slabs, partial)
    for name in forgotten:
        assert repr(name) in str(caught.value)
    assert_unchanged(toy, before)

    # Not strict: the rest binds, the forgotten ones keep what they had.
    views = bind_module(toy, slabs, partial, strict=False)
    assert forgotten.isdisjoint(views)
    after = snapshot(toy)
    for name in forgotten:
        assert after[name] is before[name]
    q_proj = "self_attn.q_proj.weight"
    assert after[q_proj].data_ptr() == views[q_proj].data_ptr()


@pytest.mark.asyncio
async def test_shape_and_dtype_mismatches_are_listed_and_nothing_changes(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    _, slabs = await load_layer(moe_checkpoint)
    groups = tuple(tier_groups(moe_checkpoint))
    toy = Toy(slabs.plan, groups)
    before = snapshot(toy)
    wrong = {
        # (8, 256) router into the (256, 256) q_proj: shape.
        "self_attn.q_proj.weight": PREFIX + ROUTER,
        # float16 suh of one slot into the bfloat16 norm weight: dtype, same shape.
        "input_layernorm.weight": (f"{PREFIX}mlp.experts.{groups[0]}.w13.suh", (0, 0)),
        # int16 trellis slab of the other tier into a buffer: shape (other tier size).
        f"mlp.experts.{groups[0]}.w2.svh": f"{PREFIX}mlp.experts.{groups[1]}.w2.svh",
    }
    mapping = {n: wrong.get(n, PREFIX + n) for n in names_of(toy) if n != "scratch"}

    with pytest.raises(BindError, match=r"^3 cannot be bound") as caught:
        bind_module(toy, slabs, mapping)
    message = str(caught.value)
    assert "self_attn.q_proj.weight: module has (256, 256) torch.bfloat16" in message
    assert f"{PREFIX}{ROUTER} is (8, 256) torch.bfloat16" in message
    assert "input_layernorm.weight: module has (256,) torch.bfloat16" in message
    assert "[0, 0] is (256,) torch.float16" in message
    assert f"mlp.experts.{groups[0]}.w2.svh: module has" in message
    assert_unchanged(toy, before)


@pytest.mark.asyncio
async def test_mapping_naming_a_missing_parameter_is_refused(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    _, slabs = await load_layer(moe_checkpoint)
    toy = Toy(slabs.plan, tuple(tier_groups(moe_checkpoint)))
    before = snapshot(toy)
    mapping = {n: PREFIX + n for n in names_of(toy) if n != "scratch"}
    mapping["self_attn.v_proj.weight"] = PREFIX + "self_attn.v_proj.weight"
    with pytest.raises(BindError, match=r"does not have: \['self_attn\.v_proj\.weight'\]"):
        bind_module(toy, slabs, mapping)
    assert_unchanged(toy, before)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("target", "why"),
    [
        (PREFIX + "self_attn.v_proj.wieght", r"no slab 'model\.layers\.1\.self_attn\.v_proj\."),
        ((PREFIX + "input_layernorm.weight", (3,)), r"slot \[3\] is outside slab"),
        ((PREFIX + "mlp.experts.K3.w13.suh", (2, 0)), r"slot \[2, 0\] is outside slab"),
        ((PREFIX + "mlp.experts.K3.w13.suh", (0, -1)), r"slot \[0, -1\] is outside slab"),
        (
            (PREFIX + "mlp.experts.K3.w13.suh", 0),
            r"target .* is not a slab name, \(slab name, slot\)",
        ),
    ],
)
async def test_unknown_slab_or_slot_is_a_bind_error(
    moe_checkpoint: SyntheticCheckpoint, target: object, why: str
) -> None:
    _, slabs = await load_layer(moe_checkpoint)
    module = nn.Module()
    module.w = nn.Parameter(torch.empty(256, dtype=torch.float16), requires_grad=False)
    before = snapshot(module)
    with pytest.raises(BindError, match=r"w: " + why):
        bind_module(module, slabs, {"w": target})  # type: ignore[dict-item]
    assert_unchanged(module, before)


@pytest.mark.asyncio
async def test_list_slot_is_a_view_never_an_indexing_copy(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """``slab[[0]]`` would be advanced indexing: a *copy* of shape (1, ...). A slot given as
    a list must index like the tuple it stands for, so a module whose parameter happens to
    have the copy's shape is refused rather than bound to memory no slab owns."""
    _, slabs = await load_layer(moe_checkpoint)
    slab_name = PREFIX + "mlp.experts.K3.w13.suh"
    slab = slabs.slab(slab_name)
    module = nn.Module()
    module.copy_shaped = nn.Parameter(torch.empty(1, *slab.shape[1:], dtype=slab.dtype))
    with pytest.raises(BindError, match=r"module has \(1, "):
        bind_module(module, slabs, {"copy_shaped": (slab_name, [0])})  # type: ignore[dict-item]
    module.gates = nn.Parameter(torch.empty(slab.shape[1:], dtype=slab.dtype))
    views = bind_module(module, slabs, {"gates": (slab_name, [0])}, strict=False)  # type: ignore[dict-item]
    assert views["gates"].data_ptr() == module.gates.data_ptr() == slab.data_ptr()


@pytest.mark.asyncio
async def test_tied_parameter_must_be_bound_under_every_name(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """A parameter shared by two modules (tied embeddings) is listed under both names: binding
    one name only would leave the other on its old tensor, so strict binding refuses it."""
    _, slabs = await load_layer(moe_checkpoint)
    shared = nn.Parameter(torch.empty(256, dtype=torch.bfloat16))
    module = nn.Module()
    module.a, module.b = nn.Module(), nn.Module()
    module.a.weight = shared
    module.b.weight = shared
    with pytest.raises(BindError, match=r"\['b\.weight'\]"):
        bind_module(module, slabs, {"a.weight": "model.norm.weight"})
    assert module.a.weight is shared
    assert module.b.weight is shared
    bind_module(module, slabs, {"a.weight": "model.norm.weight", "b.weight": "model.norm.weight"})
    assert module.a.weight.data_ptr() == module.b.weight.data_ptr()
    assert module.a.weight.data_ptr() == slabs.slab("model.norm.weight").data_ptr()


# --------------------------------------------------------------------------- completeness gate


@pytest.mark.asyncio
async def test_incomplete_slabs_are_refused_and_nothing_changes(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt, tier_map=moe_checkpoint.tier_map_path)
    async with SlabSet(p) as slabs:  # allocated, never loaded
        toy = Toy(p, tuple(tier_groups(moe_checkpoint)))
        before = snapshot(toy)
        with pytest.raises(IncompleteLoadError, match=r"unit 'layers\.1' is incomplete"):
            bind_module(toy, slabs, to_slab)
        assert_unchanged(toy, before)

        await slabs.load(ckpt)
        bind_module(toy, slabs, to_slab)
        rebound = Toy(p, tuple(tier_groups(moe_checkpoint)))
        before = snapshot(rebound)
        slabs.reset()  # allocations stay, every unit incomplete again
        with pytest.raises(IncompleteLoadError, match=r"layers\.1"):
            bind_module(rebound, slabs, to_slab)
        assert_unchanged(rebound, before)


def per_unit_module(p: Plan, order: list[str]) -> tuple[nn.Module, dict[str, str]]:
    """One placeholder parameter per unit (its first slab), in the given unit order."""
    module = nn.Module()
    mapping: dict[str, str] = {}
    for i, unit in enumerate(order):
        spec = p.slabs[p.units[unit][0]]
        empty = torch.empty(spec.shape, dtype=spec.dtype)
        module.register_parameter(f"p{i}", nn.Parameter(empty, requires_grad=False))
        mapping[f"p{i}"] = spec.name
    return module, mapping


@pytest.mark.asyncio
async def test_bind_during_a_load_refuses_units_still_loading(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """Mid-load, with some units complete and others not: a bind that needs both fails on
    the incomplete one *after* resolving the complete ones, and still changes nothing."""
    ckpt = Checkpoint.open(moe_checkpoint.root)
    p = plan(ckpt, tier_map=moe_checkpoint.tier_map_path)
    units = list(p.units)
    attempts: list[tuple[list[str], BaseException | None, bool]] = []

    async with SlabSet(p) as slabs:

        def progress(stats: LoadStatistics) -> None:
            done = [u for u in units if u in stats.unit_completed_at]
            if attempts or not 0 < len(done) < len(units):
                return
            # Complete units first, so the failure comes after successful look-ups.
            module, mapping = per_unit_module(p, done + [u for u in units if u not in done])
            before = snapshot(module)
            error: BaseException | None = None
            try:
                bind_module(module, slabs, mapping)
            except IncompleteLoadError as err:
                error = err
            attempts.append((done, error, all(snapshot(module)[n] is t for n, t in before.items())))

        options = LoadOptions(io_workers=1, read_size=32 << 10, coalesce_gap=0, progress_interval=0)
        await slabs.load(ckpt, options=options, progress=progress)

        assert len(attempts) == 1, "no moment with some units complete and others loading"
        done, error, unchanged = attempts[0]
        assert isinstance(error, IncompleteLoadError)
        assert error.details["unit"] not in done
        assert unchanged
        module, mapping = per_unit_module(p, units)
        assert len(bind_module(module, slabs, mapping)) == len(units)


@pytest.mark.asyncio
async def test_meta_module_binds_without_allocating(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """A module built on the meta device (no memory) is fully usable after binding."""
    ckpt, slabs = await load_layer(moe_checkpoint)
    groups = tier_groups(moe_checkpoint)
    with torch.device("meta"):
        toy = Toy(slabs.plan, tuple(groups))
    bind_module(toy, slabs, to_slab)
    leftovers = [n for n, t in snapshot(toy).items() if t.is_meta]
    assert leftovers == ["scratch"]  # the one buffer no checkpoint has
    toy.scratch = torch.arange(4.0)
    reference = Toy(slabs.plan, tuple(groups))
    reference.load_state_dict(reference_state(read_layer(ckpt), groups))
    x = make_input(toy.input_layernorm.weight.shape[0])
    with torch.no_grad():
        assert torch.equal(raw_bytes(toy(x)), raw_bytes(reference(x)))


@pytest.mark.asyncio
async def test_expert_major_layout_binds_reshaped_views(tmp_path: Path) -> None:
    """layout="expert_major" puts each expert's gate and up next to each other, so a
    transformers-style fused (n, 2*I, H)-shaped parameter is a view of the W13 slab."""
    written = asyncslab.testing.write_synthetic(tmp_path, asyncslab.testing.SyntheticSpec())
    ckpt = asyncslab.Checkpoint.open(written.root)
    p = asyncslab.plan(ckpt, [asyncslab.TieredMoE(layout="expert_major"), asyncslab.Dense()])
    name = "model.layers.1.mlp.experts.K3.w13.trellis"
    n, shards, *item = p.slabs[name].shape
    assert shards == 2
    slabs = await asyncslab.load(ckpt, p)
    fused = torch.nn.Module()
    fused.register_buffer("w", torch.empty(n, 2 * item[0], *item[1:], dtype=torch.int16))
    views = asyncslab.bind_module(fused, slabs, {"w": (name, (), (n, 2 * item[0], *item[1:]))})
    assert views["w"].data_ptr() == slabs.slab(name).data_ptr()
    expert = p.extras["partitions"][1].groups["K3"][0]
    up = slabs.view(f"model.layers.1.mlp.experts.{expert}.up_proj.trellis")
    assert torch.equal(fused.w[0, item[0] :], up)  # expert 0 of the tier: its up rows
    # A shape that needs a copy is refused, never copied silently.
    other = torch.nn.Module()
    other.register_buffer("w", torch.empty(1, dtype=torch.int16))
    with pytest.raises(asyncslab.BindError, match="cannot be viewed"):
        asyncslab.bind_module(other, slabs, {"w": (name, (), (7, 3))})


def _one_submodule_under_two_names(like: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """A module whose one submodule, with a ``weight`` shaped like ``like``, is registered
    as both ``a`` and ``b``; and that submodule."""
    shared = nn.Module()
    shared.weight = nn.Parameter(torch.empty_like(like))
    module = nn.Module()
    module.a = module.b = shared
    return module, shared


@pytest.mark.asyncio
async def test_a_submodule_under_two_names_binds_one_target(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    """One submodule registered under two names has one slot per parameter: mapped to two
    slabs, the last used to win with no error (and the returned views disagreed with the
    module); mapped under one name, it is bound under both."""
    _, slabs = await load_layer(moe_checkpoint)
    norm = slabs.slab("model.norm.weight")
    module, shared = _one_submodule_under_two_names(norm)
    before = shared.weight
    other = next(
        n for n, s in slabs.plan.slabs.items() if s.shape == norm.shape and n != "model.norm.weight"
    )
    with pytest.raises(BindError, match="b.weight: the same slot as a.weight"):
        bind_module(module, slabs, {"a.weight": "model.norm.weight", "b.weight": other})
    assert shared.weight is before
    views = bind_module(module, slabs, {"a.weight": "model.norm.weight"})
    assert views["a.weight"].data_ptr() == views["b.weight"].data_ptr() == norm.data_ptr()
    assert module.b.weight.data_ptr() == norm.data_ptr()


@pytest.mark.asyncio
async def test_a_lazy_parameter_is_a_bind_error(
    moe_checkpoint: SyntheticCheckpoint,
) -> None:
    _, slabs = await load_layer(moe_checkpoint)
    module = nn.Module()
    module.lin = nn.LazyLinear(4, bias=False)
    with pytest.raises(BindError, match="lin.weight: uninitialized"):
        bind_module(module, slabs, {"lin.weight": "model.norm.weight"})


@pytest.mark.asyncio
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
async def test_a_submodule_mapped_only_under_its_second_name_is_bound(
    moe_checkpoint: SyntheticCheckpoint, strict: bool
) -> None:
    """A submodule registered as ``a`` and ``b``, mapped only as ``b``: its one slot is
    mapped. Dropping the mapping because ``a`` came first made strict binding fail on a
    parameter that was mapped, and non-strict binding keep the random initialisation
    without a word."""
    _, slabs = await load_layer(moe_checkpoint)
    norm = slabs.slab("model.norm.weight")
    module, shared = _one_submodule_under_two_names(norm)
    views = bind_module(module, slabs, {"b.weight": "model.norm.weight"}, strict=strict)
    storage = norm.untyped_storage()
    start = storage.data_ptr()
    assert start <= shared.weight.data_ptr() < start + storage.nbytes()
    assert shared.weight.untyped_storage().data_ptr() == start
    assert shared.weight.data_ptr() == norm.data_ptr()
    assert torch.equal(raw_bytes(module.a.weight), raw_bytes(norm))
    assert views["a.weight"].data_ptr() == views["b.weight"].data_ptr() == norm.data_ptr()

"""Loads into tensors asyncslab did not allocate (``SlabSet(plan, tensors=...)``), and plans
whose routes are flat runs of a tensor's elements: an engine's own parameters as the slabs."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from asyncslab import Checkpoint, LoadOptions, PlanError, SlabSet, TensorInfo, plan
from asyncslab.errors import ClosedError, CoverageError, IncompleteLoadError, LoadError
from asyncslab.rules import Claim, SlabSpec, make_route
from support.faults import raw_bytes


def _checkpoint(tmp_path: Path) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    tensors = {
        "a": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "b": -torch.arange(10, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    return Checkpoint.open(tmp_path / "m.safetensors"), tensors


class _Fused:
    """Both tensors into one engine parameter, as vLLM fuses projections: ``a`` whole at
    the front of a float32 buffer, then ``b``'s bytes, each a flat run of elements."""

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        a, b = pending["a"], pending["b"]
        specs = (
            SlabSpec("p@0", "globals", torch.float32, (), (24,)),
            SlabSpec("p@96", "globals", torch.bfloat16, (), (10,)),
        )
        return Claim(
            slabs=specs,
            routes=(
                make_route(a, specs[0], (), elements=(0, 24)),
                make_route(b, specs[1], (), elements=(0, 10)),
            ),
        )


def _into(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    raw = buffer.view(torch.uint8)
    return {"p@0": raw[:96].view(torch.float32), "p@96": raw[96:116].view(torch.bfloat16)}


@pytest.mark.asyncio
@pytest.mark.parametrize("transfer", ["direct", "staged", "mapped"])
async def test_a_load_writes_into_the_given_tensors_in_place(tmp_path: Path, transfer: str) -> None:
    ckpt, tensors = _checkpoint(tmp_path)
    p = plan(ckpt, [_Fused()])
    engine = torch.full((29,), 7.0)  # 116 bytes: both tensors
    address = engine.data_ptr()
    slabs = SlabSet(p, tensors=_into(engine))
    assert slabs.device == torch.device("cpu")
    await slabs.load(ckpt, options=LoadOptions(transfer=transfer))  # type: ignore[arg-type]
    assert engine.data_ptr() == address
    loaded = raw_bytes(engine).clone()
    assert torch.equal(loaded[:96], raw_bytes(tensors["a"]))
    assert torch.equal(loaded[96:116], raw_bytes(tensors["b"]))
    assert torch.equal(loaded[116:], raw_bytes(torch.full((29,), 7.0))[116:])  # untouched
    assert slabs.slab("p@96").data_ptr() == address + 96
    # A reload writes into the same memory; closing frees nothing of the engine's.
    engine.fill_(0)
    slabs.reset()
    await slabs.load(ckpt)
    assert engine.data_ptr() == address
    assert torch.equal(raw_bytes(engine)[:116], loaded[:116])
    await slabs.aclose()
    assert torch.equal(raw_bytes(engine)[:116], loaded[:116])


class _Layers:
    """``a`` into a slab of unit ``layers.0``, ``b`` into one of ``layers.1``: an engine's two
    layers, each complete on its own."""

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        specs = (
            SlabSpec("p", "layers.0", torch.float32, (), (4, 6)),
            SlabSpec("q", "layers.1", torch.bfloat16, (), (10,)),
        )
        return Claim(
            slabs=specs,
            routes=(make_route(pending["a"], specs[0], ()), make_route(pending["b"], specs[1], ())),
        )


@pytest.mark.asyncio
@pytest.mark.parametrize("transfer", ["direct", "staged", "mapped"])
async def test_a_released_unit_is_the_engines_alone_while_the_load_goes_on(
    tmp_path: Path, transfer: str
) -> None:
    ckpt, tensors = _checkpoint(tmp_path)
    p = plan(ckpt, [_Layers()])
    # Memory whose end can be seen: a tensor over a numpy array keeps the array alive, and
    # nothing else does.
    arrays = {"p": np.zeros(24, dtype=np.float32), "q": np.zeros(10, dtype=np.int16)}
    alive = {name: weakref.ref(array) for name, array in arrays.items()}
    engine = {
        "p": torch.from_numpy(arrays["p"]).view(4, 6),
        "q": torch.from_numpy(arrays["q"]).view(torch.bfloat16),
    }
    del arrays
    slabs = SlabSet(p, tensors=engine)
    landed: dict[str, torch.Tensor] = {}
    freed: dict[str, bool] = {}

    async def processed(unit: str, owner: SlabSet) -> None:
        # The engine replaces the layer's weights with what it computes from them (a
        # repacking), then asks the load to let go of the old ones.
        (name,) = [n for n, spec in p.slabs.items() if spec.unit == unit]
        landed[name] = engine.pop(name).clone()
        owner.release(unit)
        freed[name] = alive[name]() is None

    await slabs.load(ckpt, options=LoadOptions(transfer=transfer), on_unit_ready=processed)  # type: ignore[arg-type]
    assert freed == {"p": True, "q": True}
    assert torch.equal(landed["p"], tensors["a"])
    assert torch.equal(landed["q"], tensors["b"])
    assert slabs.complete
    with pytest.raises(ClosedError, match="unit 'layers.0' was released"):
        slabs.slab("p")
    with pytest.raises(ClosedError, match="loads no more"):
        slabs.reset()
    with pytest.raises(ClosedError, match="loads no more"):
        await slabs.load(ckpt)
    await slabs.aclose()


@pytest.mark.asyncio
async def test_only_a_complete_unit_of_given_tensors_can_be_released(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    p = plan(ckpt, [_Layers()])
    async with SlabSet(
        p, tensors={"p": torch.zeros(4, 6), "q": torch.zeros(10).bfloat16()}
    ) as given:
        with pytest.raises(IncompleteLoadError, match="unit 'layers.1' is incomplete"):
            given.release("layers.1")
        with pytest.raises(KeyError, match="'layers.7' is not in the plan"):
            given.release("layers.7")
    async with SlabSet(p) as own:
        await own.load(ckpt)
        with pytest.raises(LoadError, match="one allocation of its own"):
            own.release("layers.0")
        assert own.slab("p").shape == (4, 6)


def test_given_tensors_must_be_the_plans_slabs(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    p = plan(ckpt, [_Fused()])
    good = _into(torch.zeros(29))
    with pytest.raises(PlanError, match=r"no tensor for slab 'p@96' \(1 missing"):
        SlabSet(p, tensors={"p@0": good["p@0"]})
    with pytest.raises(PlanError, match=r"'q' is no slab"):
        SlabSet(p, tensors={**good, "q": torch.zeros(1)})
    with pytest.raises(PlanError, match=r"slab 'p@0' is torch.float64 \[24\], the plan's slab "):
        SlabSet(p, tensors={**good, "p@0": torch.zeros(24, dtype=torch.float64)})
    with pytest.raises(PlanError, match=r"slab 'p@0' is torch.float32 \[4, 6\]"):
        SlabSet(p, tensors={**good, "p@0": torch.zeros(4, 6)})
    with pytest.raises(PlanError, match="not contiguous"):
        SlabSet(p, tensors={**good, "p@0": torch.zeros(48)[::2]})
    with pytest.raises(PlanError, match="is on meta, not cpu"):
        SlabSet(p, "cpu", tensors={**good, "p@0": torch.zeros(24, device="meta")})
    # Two slabs over one byte: each byte must be written once.
    shared = torch.zeros(29).view(torch.uint8)
    overlapping = {
        "p@0": shared[:96].view(torch.float32),
        "p@96": shared[94:114].view(torch.bfloat16),
    }
    with pytest.raises(PlanError, match="'p@0' and 'p@96' share memory"):
        SlabSet(p, tensors=overlapping)


def test_element_runs_are_checked_like_any_route(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    a = ckpt.tensors["a"]
    spec = SlabSpec("s", "globals", torch.float32, (), (5,))
    route = make_route(a, spec, (), elements=(7, 12))
    assert (route.src_offset, route.nbytes, route.shape) == (a.offset + 28, 20, (5,))
    with pytest.raises(PlanError, match=r"elements \(20, 25\) are outside the 24"):
        make_route(a, spec, (), elements=(20, 25))
    with pytest.raises(PlanError, match="expected two ints"):
        make_route(a, spec, (), elements=(1.0, 6))  # type: ignore[arg-type]


class _Columns:
    """A tensor-parallel rank's columns of ``a`` (4 x 6, columns 3..5), one run per row:
    several routes for one tensor, each a disjoint slice."""

    def __init__(self, overlap: bool = False) -> None:
        self.overlap = overlap

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        a = pending["a"]
        specs, routes = [], []
        for row in range(4):
            start = 10 if self.overlap and row == 2 else row * 6 + 3  # row 1 is 9..11
            spec = SlabSpec(f"p@{row}", "globals", torch.float32, (), (3,))
            specs.append(spec)
            routes.append(make_route(a, spec, (), elements=(start, start + 3)))
        return Claim(slabs=tuple(specs), routes=tuple(routes), checked=("b",))


@pytest.mark.asyncio
async def test_one_tensor_may_be_read_as_disjoint_slices(tmp_path: Path) -> None:
    ckpt, tensors = _checkpoint(tmp_path)
    p = plan(ckpt, [_Columns()])
    assert len(p.routes) == 4
    assert p.where("a").slab == "p@0"
    local = torch.zeros(4, 3)
    views = {f"p@{row}": local[row] for row in range(4)}
    await SlabSet(p, tensors=views).load(ckpt)
    assert torch.equal(local, tensors["a"][:, 3:])
    with pytest.raises(CoverageError, match="routes it 4 times, not as disjoint slices"):
        plan(ckpt, [_Columns(overlap=True)])


class _Twice:
    """``a`` whole, and again whole or as a slice of all its rows: one tensor routed
    twice, not as disjoint slices (the slice compares equal to the whole by its bytes)."""

    def __init__(self, second: str) -> None:
        self.second = second

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        a = pending["a"]
        whole = SlabSpec("whole", "globals", torch.float32, (), (4, 6))
        if self.second == "whole":
            again = SlabSpec("again", "globals", torch.float32, (), (4, 6))
            routes = (make_route(a, whole, ()), make_route(a, again, ()))
        else:
            again = SlabSpec("again", "globals", torch.float32, (), (4, 6))
            routes = (make_route(a, whole, ()), make_route(a, again, (), rows=(0, 4)))
        return Claim(slabs=(whole, again), routes=routes, checked=("b",))


@pytest.mark.parametrize("second", ["whole", "all rows"])
def test_a_tensor_routed_twice_is_refused(tmp_path: Path, second: str) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    with pytest.raises(CoverageError, match="routes it 2 times, not as disjoint slices"):
        plan(ckpt, [_Twice(second)])

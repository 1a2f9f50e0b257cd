"""Bytes an engine's loader writes from several checkpoint tensors by design (``_overwrites``):
the last in the engine's reading order stands, as in the engine's own load, and what is
overwritten whole is never read; every other overlap stays refused.

The toy engine fuses ``q`` and ``k`` of each layer into one parameter as vLLM fuses
``q_proj`` and ``k_proj`` into ``qkv_proj``, and gives each fused parameter one companion
(``shape``, as compressed-tensors' ``weight_shape``) that each shard writes whole, and
each expert one ``scale`` that its ``gate`` and ``up`` both write (as a static FP8
expert's ``w13_input_scale``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from asyncslab import Checkpoint, SlabSet
from asyncslab.engines._coverage import IntoPlan, plan_into
from asyncslab.engines._recording import capture
from asyncslab.engines._stream import stream_tensors
from asyncslab.errors import CoverageError

EXPERTS = 2


class Fused(nn.Module):
    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        self.qkv = nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
        # int32 where the checkpoint has int64 in the "cast" variant: a transformed companion.
        kind = torch.int32 if variant == "cast" else torch.int64
        self.qkv_shape = nn.Parameter(torch.zeros(2, dtype=kind), requires_grad=False)
        self.w13 = nn.Parameter(
            torch.zeros(EXPERTS, 4, 4, dtype=torch.bfloat16), requires_grad=False
        )
        # float64 where the checkpoint has float32 in "check float64": cast, and checked.
        scale = torch.float64 if variant == "check float64" else torch.float32
        self.w13_scale = nn.Parameter(torch.zeros(EXPERTS, dtype=scale), requires_grad=False)
        # Elements [0, 3) from ``q.band``, [2, 5) from ``k.band``: one element overlaps.
        self.band = nn.Parameter(torch.zeros(5, dtype=torch.float32), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rows = {"q": (0, 4), "k": (4, 2), "query": (0, 4)}
        for name, w in weights:
            parts = name.split(".")
            if parts[0] in rows and parts[1] == "weight":
                start, n = rows[parts[0]]
                self.qkv.data.narrow(0, start, n).copy_(w)
            elif parts[0] in rows and parts[1] == "shape":
                self.qkv_shape.data.copy_(w)
            elif parts[0] in rows and parts[1] == "band":
                self.band.data.narrow(0, 0 if parts[0] == "q" else 2, 3).copy_(w)
            elif parts[0] == "experts":
                expert, proj, leaf = int(parts[1]), parts[2], parts[3]
                if leaf == "weight":
                    self.w13.data[expert].narrow(0, 0 if proj == "gate" else 2, 2).copy_(w)
                    continue
                slot = self.w13_scale.data[expert]
                # As vLLM's MoE loader checks a compressed-tensors expert's input scales: the
                # second must agree with the first, unless the slot is still as created.
                if self.variant.startswith("check") and slot != 0 and (slot - w).abs() > 1e-5:
                    raise ValueError(f"scales of expert {expert} differ")
                self.w13_scale.data[expert] = w
            else:
                raise KeyError(f"no parameter for {name!r}")


def fused_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {
        "q.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "k.weight": torch.randn(2, 4, generator=g).bfloat16(),
        "q.shape": torch.tensor([4, 4]),
        "k.shape": torch.tensor([2, 4]),
        "q.band": torch.randn(3, generator=g),
        "k.band": torch.randn(3, generator=g),
    }
    for e in range(EXPERTS):
        for proj in ("gate", "up"):
            out[f"experts.{e}.{proj}.weight"] = torch.randn(2, 4, generator=g).bfloat16()
            out[f"experts.{e}.{proj}.scale"] = torch.rand((), generator=g) + 0.5
    return out


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(path / "b.safetensors"))
    return Checkpoint.open_files([path / "a.safetensors", path / "b.safetensors"])


def planned(model: Fused, ckpt: Checkpoint, order: Callable[[str], Any] | None = None) -> IntoPlan:
    specs = [(n, i.dtype, i.shape) for n, i in ckpt.tensors.items()]
    captured = capture(model.load_weights, specs, model.named_parameters())
    return plan_into(ckpt, captured, model.named_parameters(), order=order)


async def load(model: Fused, ckpt: Checkpoint, into: IntoPlan) -> None:
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    if into.transformed:
        model.load_weights(stream_tensors(ckpt, list(into.transformed)))


def reference(tensors: dict[str, torch.Tensor], names: list[str], variant: str = "") -> Fused:
    model = Fused(variant)
    model.load_weights((n, tensors[n]) for n in names)
    return model


def same_bytes(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.asyncio
async def test_the_last_writer_in_the_engines_order_stands_and_the_rest_are_not_read(
    tmp_path: Path, reverse: bool
) -> None:
    tensors = fused_weights()
    ckpt = write(tmp_path, tensors)
    # The engine's reading order: the checkpoint's, or another one it names.
    names = list(ckpt.tensors)
    if reverse:
        names.reverse()
    rank = {n: i for i, n in enumerate(names)}
    model = Fused()
    into = planned(model, ckpt, order=rank.__getitem__ if reverse else None)
    first = [n for n in names if n.endswith((".shape", ".scale", ".band"))]
    # Of each shared companion, the writers before the last are never read.
    losers = {n for n in first if any(rank[m] > rank[n] for m in _partners(n))}
    losers -= {"q.band", "k.band"}  # overwritten in part only
    assert set(into.overwritten) == losers
    assert len(losers) == 1 + EXPERTS  # q.shape or k.shape; gate.scale or up.scale, per expert
    routed = {r.tensor for r in into.plan.routes}
    assert not losers & routed
    assert {"q.band", "k.band"} <= into.shared
    assert not into.transformed
    await load(model, ckpt, into)
    same_bytes(model, reference(tensors, names))


def _partners(name: str) -> list[str]:
    swap = {"q": "k", "k": "q", "gate": "up", "up": "gate"}
    parts = name.split(".")
    i = 0 if parts[0] in swap else 2
    return [".".join([*parts[:i], swap[parts[i]], *parts[i + 1 :]])]


@pytest.mark.asyncio
async def test_a_partly_overwritten_tensor_is_read_for_the_bytes_that_stand(
    tmp_path: Path,
) -> None:
    tensors = fused_weights()
    ckpt = write(tmp_path, tensors)
    model = Fused()
    into = planned(model, ckpt)
    names = list(ckpt.tensors)
    first, last = sorted(("q.band", "k.band"), key=names.index)
    # The earlier one is read for the two elements the later one does not write.
    size = tensors[first].element_size()
    routes = [r for r in into.plan.routes if r.tensor == first]
    # Bytes of the tensor read: q.band's first two elements, or k.band's last two.
    assert [(r.slice_start, r.nbytes) for r in routes] == [
        (0 if first == "q.band" else size, 2 * size)
    ]
    await load(model, ckpt, into)
    same_bytes(model, reference(tensors, names))
    assert torch.equal(model.band[2], tensors[last][0 if last == "k.band" else 2])


@pytest.mark.asyncio
async def test_shared_bytes_the_loader_transforms_go_through_it_in_order(tmp_path: Path) -> None:
    """A companion the loader casts is written by it after the main load, every writer of
    its bytes handed over in order, so the engine's last write stands."""
    tensors = fused_weights()
    ckpt = write(tmp_path, tensors)
    model = Fused("cast")
    into = planned(model, ckpt)
    first, last = sorted(("q.shape", "k.shape"), key=list(ckpt.tensors).index)
    # The earlier one's bytes are all the later one's: it need not go through the loader.
    assert last in into.transformed
    assert first in into.overwritten
    assert first not in into.transformed
    await load(model, ckpt, into)
    same_bytes(model, reference(tensors, list(ckpt.tensors), "cast"))
    assert model.qkv_shape.tolist() == tensors[last].tolist()


def test_two_spellings_of_one_tensor_are_still_refused(tmp_path: Path) -> None:
    """``query`` lands on ``q``'s rows, and its companion on ``q``'s: every tensor of the
    two modules overlaps, so they are not two shards of one parameter."""
    tensors = fused_weights()
    tensors["query.weight"] = tensors["q.weight"].clone()
    tensors["query.shape"] = tensors["q.shape"].clone()
    ckpt = write(tmp_path, tensors)
    with pytest.raises(CoverageError, match=r"both write bytes .* of 'q(kv|kv_shape)'") as info:
        planned(Fused(), ckpt)
    assert info.value.tensor in ("q.weight", "query.weight", "q.shape", "query.shape")
    assert "one checkpoint tensor only, or from the same companion of two shards" in str(info.value)


def test_an_overlap_of_unfused_modules_or_of_other_companions_is_refused(tmp_path: Path) -> None:
    class Crossed(Fused):
        """Writes ``extra.scale`` where expert 0's scale goes: a companion of the same name
        as the expert's, of a module that is no shard beside the expert's."""

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            def renamed(name: str) -> str:
                return "experts.0.gate.scale" if name == "extra.scale" else name

            super().load_weights((renamed(n), w) for n, w in weights)

    tensors = fused_weights()
    tensors["extra.scale"] = torch.rand(())
    ckpt = write(tmp_path, tensors)
    with pytest.raises(CoverageError, match="'w13_scale'"):
        planned(Crossed(), ckpt)


@pytest.mark.parametrize("variant", ["check", "check float64"])
@pytest.mark.asyncio
async def test_a_loader_that_reads_back_what_it_wrote_is_handed_every_writer(
    tmp_path: Path, variant: str
) -> None:
    """While recorded, the loader's check reads a slot no copy has changed, and passes: the
    tensors writing that slot go through the loader instead, every one in order, so that
    the check runs on the real values: agreeing ones load as in the engine's own load,
    disagreeing ones fail as there. The same where the loader also casts them."""
    tensors = fused_weights()
    for e in range(EXPERTS):
        tensors[f"experts.{e}.up.scale"] = tensors[f"experts.{e}.gate.scale"].clone()
    ckpt = write(tmp_path / "agree", tensors)
    model = Fused(variant)
    into = planned(model, ckpt)
    scales = {f"experts.{e}.{p}.scale" for e in range(EXPERTS) for p in ("gate", "up")}
    assert set(into.transformed) == scales
    assert all(
        w.startswith("the loader reads back bytes it writes") for w in into.transformed.values()
    )
    assert not scales & set(into.overwritten)
    await load(model, ckpt, into)
    same_bytes(model, reference(tensors, list(ckpt.tensors), variant))

    tensors["experts.1.up.scale"] = tensors["experts.1.up.scale"] * 2
    ckpt = write(tmp_path / "differ", tensors)
    with pytest.raises(ValueError, match="scales of expert 1 differ"):
        reference(tensors, list(ckpt.tensors), variant)
    model = Fused(variant)
    with pytest.raises(ValueError, match="scales of expert 1 differ"):
        await load(model, ckpt, planned(model, ckpt))

"""Recording a model of many experts from a few (``_derive``): what it derives must be what
a full recording of the same loader says, tensor by tensor; where the loader does not treat
a layer's experts as the reference layer's, the member is recorded whole, never guessed."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from asyncslab import Checkpoint, SlabSet
from asyncslab.engines._coverage import plan_into
from asyncslab.engines._derive import MIN_EXPERTS, capture_derived
from asyncslab.engines._recording import Capture, capture
from asyncslab.errors import CaptureError, CoverageError

LAYERS, EXPERTS = 4, 16


class Moe(nn.Module):
    """Per layer, the experts' ``w1`` and ``w3`` fused into one ``(E, 2, 2, 4)`` parameter
    (gate then up), ``w2`` stacked into ``(E, 4, 2)``, and a router. ``odd`` makes the loader
    treat experts otherwise (see the tests)."""

    def __init__(self, odd: str = "", experts: int = EXPERTS) -> None:
        super().__init__()
        self.odd = odd
        self.experts = experts
        self.layers = nn.ModuleList(nn.Module() for _ in range(LAYERS))
        for layer in self.layers:
            layer.w13 = nn.Parameter(torch.zeros(experts, 2, 2, 4), requires_grad=False)
            layer.w2 = nn.Parameter(torch.zeros(experts, 4, 2), requires_grad=False)
            layer.gate = nn.Parameter(torch.zeros(experts, 4), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            parts = name.split(".")
            layer_no = int(parts[1])
            layer = self.layers[layer_no]
            if parts[2] == "gate":
                layer.gate.data.copy_(w)
                continue
            expert = int(parts[3])
            if self.odd == "swap 5 and 6" and expert in (5, 6):
                expert = 11 - expert  # in every layer: the reference layer shows it
            if self.odd == "last expert of layer 2" and layer_no == 2 and expert == EXPERTS - 1:
                expert = 0  # and expert 0 of layer 2 into the last slot
            elif self.odd == "last expert of layer 2" and layer_no == 2 and expert == 0:
                expert = EXPERTS - 1
            if self.odd == "transpose layer 3" and layer_no == 3 and parts[4] == "w2":
                layer.w2.data[expert].copy_(w.t().contiguous().view(4, 2))
                continue
            if self.odd == "local experts" and not 4 <= expert < 12:
                continue  # another rank's, as under expert parallelism
            slot = expert - 4 if self.odd == "local experts" else expert
            if parts[4] == "w1":
                layer.w13.data[slot, 0].copy_(w)
            elif parts[4] == "w3":
                layer.w13.data[slot, 1].copy_(w)
            else:
                layer.w2.data[slot].copy_(w)


def weights(experts: int = EXPERTS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        out[f"layers.{layer}.gate"] = torch.randn(experts, 4, generator=g)
        for e in range(experts):
            out[f"layers.{layer}.experts.{e}.w1"] = torch.randn(2, 4, generator=g)
            out[f"layers.{layer}.experts.{e}.w3"] = torch.randn(2, 4, generator=g)
            out[f"layers.{layer}.experts.{e}.w2"] = torch.randn(4, 2, generator=g)
    return out


def write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return Checkpoint.open(tmp_path / "model.safetensors")


def specs(ckpt: Checkpoint) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(n, i.dtype, i.shape) for n, i in ckpt.tensors.items()]


def by_tensor(captured: Capture) -> dict[str, list[tuple[int, int, str, int]]]:
    """Each tensor's runs, with destinations by name: two recordings compared as data."""
    out: dict[str, list[tuple[int, int, str, int]]] = {}
    for r in captured.runs:
        out.setdefault(r.tensor, []).append((r.src, r.nbytes, captured.targets[r.target][0], r.dst))
    return out


def same_recording(a: Capture, b: Capture) -> None:
    assert by_tensor(a) == by_tensor(b)
    assert a.untouched == b.untouched
    assert dict(a.transformed) == dict(b.transformed)
    assert a.yielded == b.yielded


class Counting:
    """The loader, counting the tensors it is given."""

    def __init__(self, model: Moe) -> None:
        self.model = model
        self.given: list[str] = []

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def seen() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                self.given.append(name)
                yield name, w

        self.model.load_weights(seen())


def test_a_layer_is_derived_from_the_reference_layer_as_a_full_recording_says(
    tmp_path: Path,
) -> None:
    ckpt = write(tmp_path, weights())
    model = Moe()
    loader = Counting(model)
    derived, how = capture_derived(loader, specs(ckpt), list(model.named_parameters()))
    full = capture(model.load_weights, specs(ckpt), list(model.named_parameters()))
    same_recording(derived, full)
    assert not how.fallbacks
    # Layer 0 whole (3 x 16 experts), each other layer's sampled experts, every router.
    assert how.recorded == len(set(loader.given)) == len(loader.given)
    assert how.recorded + how.derived == len(ckpt.tensors)
    assert all(f"layers.0.experts.{e}.w2" in loader.given for e in range(EXPERTS))
    # Each other layer: at most 6 experts recorded (first, second, last, 3 picked).
    assert how.derived >= (LAYERS - 1) * 3 * (EXPERTS - 6)
    # The samples of a layer are the same experts for its three projections.
    for layer in range(1, LAYERS):
        picked = [
            {
                int(n.split(".")[3])
                for n in loader.given
                if n.startswith(f"layers.{layer}.") and n.endswith(f".{p}")
            }
            for p in ("w1", "w3", "w2")
        ]
        assert picked[0] == picked[1] == picked[2]
        assert {0, 1, EXPERTS - 1} <= picked[0]


@pytest.mark.asyncio
async def test_the_derived_plan_writes_what_the_engines_loader_writes(tmp_path: Path) -> None:
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Moe()
    derived, _ = capture_derived(model.load_weights, specs(ckpt), list(model.named_parameters()))
    into = plan_into(ckpt, derived, model.named_parameters())
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    expected = Moe()
    expected.load_weights(tensors.items())
    for (name, got), (_, want) in zip(
        model.named_parameters(), expected.named_parameters(), strict=True
    ):
        assert torch.equal(got, want), name


def test_an_expert_index_the_loader_singles_out_in_every_layer_is_derived_from_the_reference(
    tmp_path: Path,
) -> None:
    ckpt = write(tmp_path, weights())
    model = Moe("swap 5 and 6")
    derived, how = capture_derived(model.load_weights, specs(ckpt), list(model.named_parameters()))
    full = capture(model.load_weights, specs(ckpt), list(model.named_parameters()))
    same_recording(derived, full)
    assert not how.fallbacks
    runs = by_tensor(derived)
    # Layer 3's expert 5 (derived, not sampled there) lands in slot 6, as the loader says.
    assert runs["layers.3.experts.5.w2"] == [(0, 32, "layers.3.w2", 6 * 32)]


@pytest.mark.parametrize(
    ("odd", "layer", "projections", "why"),
    [
        ("last expert of layer 2", "2", ("w1", "w3", "w2"), "lands elsewhere in its parameter"),
        ("transpose layer 3", "3", ("w2",), "otherwise than the reference layer's"),
    ],
)
def test_a_layer_the_loader_treats_otherwise_is_recorded_whole(
    tmp_path: Path, odd: str, layer: str, projections: tuple[str, ...], why: str
) -> None:
    """The fallback: the sampled experts of one layer disagree with the reference layer's,
    so that layer's tensors of those projections all go through the loader; the recording
    is the full one."""
    ckpt = write(tmp_path, weights())
    model = Moe(odd)
    loader = Counting(model)
    derived, how = capture_derived(loader, specs(ckpt), list(model.named_parameters()))
    full = capture(model.load_weights, specs(ckpt), list(model.named_parameters()))
    same_recording(derived, full)
    assert [m for m, _ in how.fallbacks] == [layer] * len(projections)
    assert all(why in w for _, w in how.fallbacks)
    given = set(loader.given)
    for e in range(EXPERTS):
        for p in projections:
            assert f"layers.{layer}.experts.{e}.{p}" in given
    assert how.derived > 0


def test_a_model_served_in_another_dtype_is_derived_as_transformed(tmp_path: Path) -> None:
    """Every copy casts (a bfloat16 checkpoint into float32 parameters): the reference
    layer's tensors are transformed, and so are the derived ones, with their writes."""
    ckpt = write(tmp_path, {n: t.bfloat16() for n, t in weights().items()})
    model = Moe()
    loader = Counting(model)
    derived, how = capture_derived(loader, specs(ckpt), list(model.named_parameters()))
    full = capture(model.load_weights, specs(ckpt), list(model.named_parameters()))
    same_recording(derived, full)
    assert set(derived.writes) == set(full.writes)
    assert not how.fallbacks
    assert how.derived >= (LAYERS - 1) * 3 * (EXPERTS - 6)
    assert len(derived.transformed) == len(ckpt.tensors)


def test_experts_another_rank_holds_are_derived_as_untouched(tmp_path: Path) -> None:
    """Expert parallelism's shape: the loader takes only this rank's experts (4..11) and
    skips the others; derived from the reference layer, the same."""
    ckpt = write(tmp_path, weights())
    model = Moe("local experts")
    derived, how = capture_derived(model.load_weights, specs(ckpt), list(model.named_parameters()))
    full = capture(model.load_weights, specs(ckpt), list(model.named_parameters()))
    same_recording(derived, full)
    assert not how.fallbacks
    assert how.derived
    assert "layers.3.experts.13.w1" in derived.untouched


def test_a_missing_expert_is_refused_naming_it(tmp_path: Path) -> None:
    tensors = weights()
    del tensors["layers.2.experts.9.w3"]
    ckpt = write(tmp_path, tensors)
    model = Moe()
    derived, how = capture_derived(model.load_weights, specs(ckpt), list(model.named_parameters()))
    with pytest.raises(CoverageError, match=r"layers\.2\.experts\.9\.w3"):
        plan_into(ckpt, derived, model.named_parameters())


def test_a_duplicated_expert_is_refused_naming_both(tmp_path: Path) -> None:
    """A checkpoint whose layer 1 holds expert 3 twice, as ``3`` and ``03``: no family is
    derived from such numbers, and the loader writes one slot from two tensors."""
    tensors = weights()
    tensors["layers.1.experts.03.w1"] = tensors["layers.1.experts.3.w1"].clone()
    ckpt = write(tmp_path, tensors)
    model = Moe()
    derived, _ = capture_derived(model.load_weights, specs(ckpt), list(model.named_parameters()))
    with pytest.raises(CoverageError, match=r"experts\.0?3\.w1.*experts\.0?3\.w1"):
        plan_into(ckpt, derived, model.named_parameters())


def test_few_experts_are_recorded_whole(tmp_path: Path) -> None:
    ckpt = write(tmp_path, weights(experts=MIN_EXPERTS - 1))
    model = Moe(experts=MIN_EXPERTS - 1)
    loader = Counting(model)
    _, how = capture_derived(loader, specs(ckpt), list(model.named_parameters()))
    assert how.derived == 0
    assert len(loader.given) == len(ckpt.tensors)


def test_a_tensor_the_loader_refuses_fails_the_recording_naming_it(tmp_path: Path) -> None:
    """A tensor of no family the loader knows (here one expert's stray bias) is always
    among those the loader is given."""
    tensors = weights()
    tensors["layers.2.experts.7.bias"] = torch.zeros(2)
    ckpt = write(tmp_path, tensors)
    model = Moe()

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def known() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if name.endswith(".bias"):
                    raise KeyError(name)
                yield name, w

        model.load_weights(known())

    with pytest.raises(CaptureError, match=r"layers\.2\.experts\.7\.bias"):
        capture_derived(load, specs(ckpt), list(model.named_parameters()))

"""Recording where an engine's own loader puts each tensor (``_capture``), and planning into
the engine's parameters from that (``_into``), on a toy engine that fuses, pads, stacks
experts and slices columns as vLLM's loaders do. The property that matters: loading the
plan writes exactly the bytes the engine's loader writes given the real tensors."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from asyncslab import Checkpoint, SlabSet
from asyncslab._os import proc_status
from asyncslab.engines._coverage import plan_into
from asyncslab.engines._recording import capture
from asyncslab.engines._stream import stream_tensors
from asyncslab.errors import CaptureError, CoverageError

LAYERS, EXPERTS = 2, 3


class Toy(nn.Module):
    """Per layer: ``q`` and ``k`` fused into ``qkv`` (narrow), ``EXPERTS`` experts stacked
    in one parameter (select), a row-parallel ``o`` whose rank keeps columns 8..15 of each
    row. An embedding of 8 rows padded to 10, the padding zero-filled after the copy, and
    a rotary ``inv_freq`` the loader skips."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Parameter(torch.full((10, 4), 9.0, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(nn.Module() for _ in range(LAYERS))
        for layer in self.layers:
            layer.qkv = nn.Parameter(torch.full((6, 4), 9.0, dtype=dtype), requires_grad=False)
            layer.experts = nn.Parameter(
                torch.full((EXPERTS, 2, 4), 9.0, dtype=dtype), requires_grad=False
            )
            layer.o = nn.Parameter(torch.full((4, 8), 9.0, dtype=dtype), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            parts = name.split(".")
            if name == "emb":
                self.emb.data[: w.shape[0]].copy_(w)
                self.emb.data[w.shape[0] :].fill_(0)
                continue
            if name == "inv_freq":
                continue
            if parts[0] != "layers":
                raise KeyError(f"no parameter for {name!r}")
            layer = self.layers[int(parts[1])]
            kind = parts[2]
            if kind == "q":
                if self.variant == "transpose":
                    layer.qkv.data[0:4].copy_(w.t())
                elif self.variant == "compute":
                    layer.qkv.data[0:4].copy_(w * 2)
                elif self.variant == "to device":
                    # As vLLM's loaders do on a GPU: the tensor moved to the parameter's
                    # device first, then copied there.
                    layer.qkv.data[0:4].copy_(w.to(layer.qkv.device))
                elif self.variant == "in place":
                    layer.qkv.data[0:4].copy_(w.mul_(2))
                elif self.variant == "item":
                    # Reads a value (of garbage, while recording), then copies whatever it
                    # was: a branch on it would make this test depend on the garbage.
                    float(w[0, 0].item())
                    layer.qkv.data[0:4].copy_(w)
                elif self.variant == "item, then fill":
                    # Reads a value and writes none of the tensor's bytes: transformed, and
                    # taken without a copy.
                    float(w[0, 0].item())
                    layer.qkv.data[0:4].zero_()
                else:
                    layer.qkv.data[0:4].copy_(w)
            elif kind == "k":
                layer.qkv.data.narrow(0, 4, 2).copy_(w)
                if self.variant == "overwrite":
                    layer.qkv.data[5].fill_(1)
            elif kind == "e":
                layer.experts.data[int(parts[3])].copy_(w)
            elif kind == "o":
                layer.o.data.copy_(w[:, 8:16])
            else:
                raise KeyError(name)


def weights(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"emb": torch.randn(8, 4, generator=g), "inv_freq": torch.randn(2, generator=g)}
    for layer in range(LAYERS):
        out[f"layers.{layer}.q"] = torch.randn(4, 4, generator=g)
        out[f"layers.{layer}.k"] = torch.randn(2, 4, generator=g)
        for e in range(EXPERTS):
            out[f"layers.{layer}.e.{e}"] = torch.randn(2, 4, generator=g)
        out[f"layers.{layer}.o"] = torch.randn(4, 16, generator=g)
    return {n: t.to(dtype) for n, t in out.items()}


def write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "b.safetensors"))
    return Checkpoint.open_files([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


def record(model: Toy, ckpt: Checkpoint):  # type: ignore[no-untyped-def]
    specs = [(n, i.dtype, i.shape) for n, i in ckpt.tensors.items()]
    return capture(model.load_weights, specs, model.named_parameters())


def reference(tensors: dict[str, torch.Tensor], **kw: object) -> Toy:
    model = Toy(**kw)  # type: ignore[arg-type]
    model.load_weights(tensors.items())
    return model


def same_bytes(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.asyncio
async def test_the_plan_writes_what_the_engines_loader_writes(tmp_path: Path) -> None:
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Toy()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    captured = record(model, ckpt)
    assert captured.untouched == ("inv_freq",)
    assert not captured.transformed
    # Fused shards at their offsets; the embedding's padding filled while recording.
    qkv = {r.tensor: (r.dst, r.nbytes) for r in captured.runs if r.tensor.startswith("layers.0.")}
    assert qkv["layers.0.q"] == (0, 32)
    assert qkv["layers.0.k"] == (32, 16)
    assert qkv["layers.0.e.2"] == (32, 16)  # its own parameter, expert 2's slot
    # The rank's columns of o: one run of 8 elements per row, from byte 16 of each row.
    o_runs = [(r.src, r.dst, r.nbytes) for r in captured.runs if r.tensor == "layers.0.o"]
    assert o_runs == [(32 * row + 16, 16 * row, 16) for row in range(4)]
    assert [f.op for f in captured.fills] == ["fill_.Scalar"]
    into = plan_into(ckpt, captured, model.named_parameters())
    assert into.skipped == ("inv_freq",)
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}
    same_bytes(model, reference(tensors))


@pytest.mark.parametrize(
    ("variant", "dtype", "why"),
    [
        ("", torch.float32, "converts torch.bfloat16 to torch.float32"),
        ("transpose", torch.bfloat16, "not contiguous enough"),
        ("compute", torch.bfloat16, "computes from it"),
        ("in place", torch.bfloat16, r"changes it in place \(mul_"),
        ("item", torch.bfloat16, r"reads its values \(_local_scalar_dense"),
        ("item, then fill", torch.bfloat16, r"reads its values \(_local_scalar_dense"),
        ("overwrite", torch.bfloat16, r"overwrites part of it \(fill_"),
    ],
)
@pytest.mark.asyncio
async def test_what_is_not_a_byte_copy_goes_through_the_engines_loader(
    tmp_path: Path, variant: str, dtype: torch.dtype, why: str
) -> None:
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Toy(dtype, variant)
    into = plan_into(ckpt, record(model, ckpt), model.named_parameters())
    assert into.transformed
    assert all(n.endswith((".q", ".k")) or dtype != torch.bfloat16 for n in into.transformed)
    assert any(re.search(why, w) for w in into.transformed.values())
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    # As the vLLM format hands them over: streamed, after the main load.
    model.load_weights(stream_tensors(ckpt, list(into.transformed)))
    same_bytes(model, reference(tensors, dtype=dtype, variant=variant))


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("variant", "dtype"),
    [("", torch.bfloat16), ("to device", torch.bfloat16), ("", torch.float32)],
)
@pytest.mark.asyncio
async def test_into_cuda_parameters_the_plan_writes_what_the_engines_loader_writes(
    tmp_path: Path, variant: str, dtype: torch.dtype
) -> None:
    """As in vLLM on a GPU: the stand-ins are host tensors, the parameters device ones; the
    bytes are staged onto the device, what is transformed goes through the loader."""
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Toy(dtype, variant).to("cuda")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    into = plan_into(ckpt, record(model, ckpt), model.named_parameters())
    assert bool(into.transformed) == (dtype != torch.bfloat16)
    slabs = SlabSet(into.plan, "cuda", tensors=into.tensors)
    await slabs.load(ckpt)
    if into.transformed:
        model.load_weights(stream_tensors(ckpt, list(into.transformed)))
    torch.cuda.synchronize()
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}
    same_bytes(model.cpu(), reference(tensors, dtype=dtype, variant=variant))


def test_a_missing_tensor_is_named_with_its_parameter_before_any_read(tmp_path: Path) -> None:
    tensors = weights()
    del tensors["layers.0.e.1"]
    ckpt = write(tmp_path, tensors)
    model = Toy()
    with pytest.raises(CoverageError) as info:
        plan_into(ckpt, record(model, ckpt), model.named_parameters())
    message = str(info.value)
    assert "indices [1, 0, 0]..[1, 1, 3] of 'layers.0.experts'" in message
    assert "expected 'layers.0.e.1'" in message
    assert info.value.tensor == "layers.0.e.1"


def test_two_tensors_into_one_byte_are_refused(tmp_path: Path) -> None:
    class Twice(Toy):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(
                (("layers.0.k", w) if n == "layers.1.k" else (n, w)) for n, w in weights
            )

    ckpt = write(tmp_path, weights())
    model = Twice()
    with pytest.raises(CoverageError, match="'layers.1.k' and 'layers.0.k' both write"):
        plan_into(ckpt, record(model, ckpt), model.named_parameters())


def test_the_engines_own_refusal_names_the_tensor(tmp_path: Path) -> None:
    ckpt = write(tmp_path, {**weights(), "stray": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(CaptureError, match="no parameter for 'stray'") as info:
        record(Toy(), ckpt)
    assert info.value.tensor == "stray"


def test_a_loader_that_replaces_a_parameter_is_refused(tmp_path: Path) -> None:
    class Replacing(Toy):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(weights)
            self.emb.data = torch.zeros(10, 4, dtype=torch.bfloat16)

    ckpt = write(tmp_path, weights())
    with pytest.raises(CaptureError, match="replaced the memory of 'emb'"):
        record(Replacing(), ckpt)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS")
def test_stand_ins_are_apart_and_take_no_memory() -> None:
    """Each stand-in is a storage of its own (the recorder tells them apart by it), of the
    shape and dtype asked, scalars and empty ones included; none is backed: a 1 GiB one
    takes no memory while the loader holds it."""
    seen: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
    growth: list[int] = []
    before = proc_status()["VmRSS"]

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            seen[name] = (tuple(w.shape), w.dtype, w.untyped_storage().data_ptr())
            if name == "big":
                growth.append(proc_status()["VmRSS"] - before)

    specs = [
        ("big", torch.bfloat16, (1 << 29,)),
        ("scalar", torch.float32, ()),
        ("empty", torch.int8, (0, 4)),
        ("small", torch.float8_e4m3fn, (3, 5)),
        ("small2", torch.float8_e4m3fn, (3, 5)),
    ]
    captured = capture(load, specs, [])
    assert {n: (s, d) for n, (s, d, _) in seen.items()} == {n: (s, d) for n, d, s in specs}
    nonempty = [ptr for n, (_, _, ptr) in seen.items() if n != "empty"]
    assert len(set(nonempty)) == len(nonempty)
    assert growth[0] < 256 << 20, growth
    assert captured.untouched == tuple(n for n, _, _ in specs)


def test_stand_ins_are_never_filled(tmp_path: Path) -> None:
    """Recording reads no payload and writes nothing into the parameters but the loader's
    own fills: every byte a tensor would write still holds its initial value."""
    ckpt = write(tmp_path, weights())
    model = Toy()
    record(model, ckpt)
    assert (model.layers[0].qkv == 9).all()
    assert (model.layers[1].o == 9).all()
    assert (model.emb[:8] == 9).all()
    assert (model.emb[8:] == 0).all()


class WithScales(Toy):
    """Per layer a ``scale`` the engine sets itself (vLLM's KV-cache scales start at a
    default) and overwrites only from a checkpoint that holds one: two elements, so that a
    checkpoint can also hold half of one."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.scale = nn.Parameter(torch.full((2,), -1.0), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rest = []
        for name, w in weights:
            parts = name.split(".")
            if parts[-1] == "scale":
                self.layers[int(parts[1])].scale.data[: w.shape[0]].copy_(w)
            else:
                rest.append((name, w))
        super().load_weights(rest)


SCALES = ("layers.0.scale", "layers.1.scale")


@pytest.mark.asyncio
async def test_an_optional_parameter_the_checkpoint_lacks_keeps_its_value(
    tmp_path: Path,
) -> None:
    ckpt = write(tmp_path, weights())
    model = WithScales()
    with pytest.raises(CoverageError, match="'layers.0.scale'"):
        plan_into(ckpt, record(model, ckpt), model.named_parameters())
    into = plan_into(ckpt, record(model, ckpt), model.named_parameters(), optional=SCALES)
    assert into.defaulted == SCALES
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    assert all((layer.scale == -1).all() for layer in model.layers)
    engine = WithScales()
    engine.load_weights(weights().items())
    same_bytes(model, engine)


@pytest.mark.asyncio
async def test_an_optional_parameter_the_checkpoint_holds_is_loaded(tmp_path: Path) -> None:
    scales = {n: torch.tensor([0.5, 0.25]) for n in SCALES}
    ckpt = write(tmp_path, {**weights(), **scales})
    model = WithScales()
    into = plan_into(ckpt, record(model, ckpt), model.named_parameters(), optional=SCALES)
    assert into.defaulted == ()
    assert not into.transformed
    await SlabSet(into.plan, tensors=into.tensors).load(ckpt)
    assert [layer.scale.tolist() for layer in model.layers] == [[0.5, 0.25]] * 2


def test_an_optional_parameter_half_written_is_refused(tmp_path: Path) -> None:
    """Optional means all or nothing: a scale the checkpoint fills in part would serve a
    mix of the checkpoint's value and the engine's default."""
    scales = {n: torch.tensor([0.5]) for n in SCALES}
    ckpt = write(tmp_path, {**weights(), **scales})
    model = WithScales()
    with pytest.raises(CoverageError, match=r"elements 1\.\.1 of 'layers.0.scale'"):
        plan_into(ckpt, record(model, ckpt), model.named_parameters(), optional=SCALES)

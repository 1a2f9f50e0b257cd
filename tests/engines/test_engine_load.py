"""The engine-neutral load (``_engine_load``), driven by a toy engine that is not vLLM: a
plain torch module whose own loader fuses q, k and v into one parameter, casts the norms it
is given in float32 to its bfloat16, writes a buffer, skips the rotary table, and knows
every tensor by a prefix the checkpoint lacks. The property: the engine's tensors hold
exactly what its loader writes given the tensors safetensors reads, in the memory they had."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from asyncslab import Checkpoint
from asyncslab.engines._engine_load import Engine, load_into_engine
from asyncslab.engines._placement import Placement, Placer
from asyncslab.engines._stream import stream_tensors
from asyncslab.errors import CoverageError

LAYERS = 2
PREFIX = "model."


class Fused(nn.Module):
    """Per layer ``qkv`` (q, k, v stacked by rows), a ``norm`` and a ``bias`` buffer; an
    optional ``scale`` the engine sets itself and takes from a checkpoint only if there."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.full((8, 4), 9.0, dtype=dtype), False)
        self.layers = nn.ModuleList(nn.Module() for _ in range(LAYERS))
        for layer in self.layers:
            layer.qkv = nn.Parameter(torch.full((12, 4), 9.0, dtype=dtype), False)
            layer.norm = nn.Parameter(torch.full((4,), 9.0, dtype=dtype), False)
            layer.register_buffer("bias", torch.full((4,), 9.0, dtype=dtype))
        self.scale = nn.Parameter(torch.ones(1), False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for full, w in weights:
            name = full.removeprefix(PREFIX)
            parts = name.split(".")
            if name == "embed":
                self.embed.data.copy_(w)
            elif name == "inv_freq":
                continue
            elif name == "scale":
                self.scale.data.copy_(w)
            elif name == "norms":  # every layer's norm from one tensor, a row each
                for row, layer in zip(w, self.layers, strict=True):
                    layer.norm.data.copy_(row)
            elif parts[0] == "layers":
                layer = self.layers[int(parts[1])]
                kind = parts[2]
                if kind in ("q", "k", "v"):
                    row = 4 * "qkv".index(kind)
                    layer.qkv.data.narrow(0, row, 4).copy_(w)
                elif kind == "norm":
                    layer.norm.data.copy_(w)  # float32 into bfloat16: a cast
                elif kind == "bias":
                    layer.bias.copy_(w)
                else:
                    raise KeyError(f"no parameter for {full!r}")
            else:
                raise KeyError(f"no parameter for {full!r}")


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {
        "embed": torch.randn(8, 4, generator=g).bfloat16(),
        "inv_freq": torch.randn(2, generator=g),
    }
    for layer in range(LAYERS):
        for kind in "qkv":
            out[f"layers.{layer}.{kind}"] = torch.randn(4, 4, generator=g).bfloat16()
        out[f"layers.{layer}.norm"] = torch.randn(4, generator=g)  # float32 on disk
        out[f"layers.{layer}.bias"] = torch.randn(4, generator=g).bfloat16()
    return out


def write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    names = sorted(tensors)
    half = len(names) // 2
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    save_file({n: tensors[n] for n in names[:half]}, str(paths[0]))
    save_file({n: tensors[n] for n in names[half:]}, str(paths[1]))
    return Checkpoint.open_files(paths)


def engine_of(model: Fused, ckpt: Checkpoint) -> Engine:
    return Engine(
        load=model.load_weights,
        parameters=tuple(model.named_parameters()),
        buffers=tuple(model.named_buffers()),
        names={PREFIX + n: n for n in ckpt.tensors},
        optional=frozenset({"scale"}),
    )


def by_its_own_loader(ckpt: Checkpoint, model: Fused | None = None) -> Fused:
    """The engine loaded the engine's way: every tensor as safetensors reads it."""
    model = model or Fused()
    for f in ckpt.files:
        with safe_open(str(f.path), "pt") as reader:
            model.load_weights((PREFIX + n, reader.get_tensor(n)) for n in reader.keys())
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.uint8) for n, t in model.state_dict(keep_vars=True).items()}


def pointers(model: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}


def test_the_engines_tensors_hold_what_its_own_loader_writes_in_their_own_memory(
    tmp_path: Path,
) -> None:
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Fused()
    before = pointers(model)
    report = load_into_engine(ckpt, engine_of(model, ckpt))
    assert pointers(model) == before
    expected = state(by_its_own_loader(ckpt))
    got = state(model)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # The norms went through the engine's loader (a cast); the rest was read in place.
    assert report.transformed == ("layers.0.norm", "layers.1.norm")
    assert report.transformed_bytes == 2 * 4 * 4
    assert report.skipped == ("inv_freq",)
    assert report.defaulted == ("scale",)
    in_place = ("inv_freq", "layers.0.norm", "layers.1.norm")
    assert report.bytes == sum(t.nbytes for n, t in tensors.items() if n not in in_place)
    assert (report.files, report.tensors) == (2, len(tensors))
    assert report.parameters == 1 + 2 * LAYERS + 1


@pytest.mark.asyncio
async def test_from_a_thread_that_runs_an_event_loop(tmp_path: Path) -> None:
    """An engine may call its loader from inside a running loop: the load runs in a loop
    of its own on another thread."""
    ckpt = write(tmp_path, weights())
    model = Fused()
    load_into_engine(ckpt, engine_of(model, ckpt))
    expected = state(by_its_own_loader(ckpt))
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())


def test_a_missing_tensor_is_refused_naming_it_before_any_read(tmp_path: Path) -> None:
    tensors = weights()
    del tensors["layers.1.v"]
    ckpt = write(tmp_path, tensors)
    model = Fused()
    with pytest.raises(CoverageError, match=r"of 'layers\.1\.qkv'") as info:
        load_into_engine(ckpt, engine_of(model, ckpt))
    # Named as the engine's loader would have been given it, by analogy with layer 0.
    assert "expected 'model.layers.1.v'" in str(info.value)
    assert info.value.tensor == "model.layers.1.v"
    # Nothing was read: every byte still holds the value the engine gave it.
    assert all((layer.qkv == 9).all() and (layer.norm == 9).all() for layer in model.layers)
    assert (model.embed == 9).all()


def test_a_model_served_in_another_dtype_is_all_transformed_and_read_by_nothing_else(
    tmp_path: Path,
) -> None:
    """Kept in float16, every tensor is cast by the loader: all go to it, checked first
    (a missing one is refused before any read), and no read stage runs for none."""
    tensors = weights()
    ckpt = write(tmp_path, tensors)
    model = Fused(torch.float16)
    report = load_into_engine(ckpt, engine_of(model, ckpt))
    expected = state(by_its_own_loader(ckpt, Fused(torch.float16)))
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())
    # The rotary table is skipped, and the float32 scale has no tensor (it is optional).
    assert sorted(report.transformed) == sorted(n for n in tensors if n != "inv_freq")
    assert (report.runs, report.bytes, report.load_s) == (0, 0, 0.0)
    del tensors["layers.1.v"]
    (tmp_path / "missing").mkdir()
    ckpt = write(tmp_path / "missing", tensors)
    model = Fused(torch.float16)
    with pytest.raises(CoverageError, match=r"of 'layers\.1\.qkv'"):
        load_into_engine(ckpt, engine_of(model, ckpt))
    assert (model.layers[1].qkv == 9).all()


def _numpy_backed(model: Fused) -> list[weakref.ref[np.ndarray]]:
    """Each layer's ``qkv`` moved onto memory whose end can be seen: a numpy array, which
    only that parameter's storage keeps alive."""
    arrays = [np.full((12, 4), 9.0, dtype=np.float32) for _ in model.layers]
    for layer, array in zip(model.layers, arrays, strict=True):
        layer.qkv = nn.Parameter(torch.from_numpy(array), False)
    return [weakref.ref(array) for array in arrays]


def test_each_layer_is_handed_over_once_landed_and_weights_it_replaces_are_freed(
    tmp_path: Path,
) -> None:
    """As an engine that repacks a layer's weights once they land: each layer is handed
    over in the engine's thread with its bytes complete, and a weight it replaces is
    freed there and then, with the load still holding every other layer."""
    ckpt = write(tmp_path, {n: t.float() for n, t in weights().items()})  # nothing cast
    expected = state(by_its_own_loader(ckpt, Fused(torch.float32)))
    model = Fused(torch.float32)
    alive = _numpy_backed(model)
    engine = dataclasses.replace(engine_of(model, ckpt), parameters=list(model.named_parameters()))
    threads: set[int] = set()
    freed: dict[str, bool] = {}

    def processed(unit: str) -> None:
        threads.add(threading.get_ident())
        layer = model.layers[int(unit.removeprefix("layers."))]
        assert torch.equal(state(layer)["qkv"], expected[f"{unit}.qkv"])
        assert torch.equal(state(layer)["norm"], expected[f"{unit}.norm"])
        layer.qkv = nn.Parameter(layer.qkv.detach() * 2, False)
        freed[unit] = alive[int(unit.removeprefix("layers."))]() is None

    report = load_into_engine(ckpt, engine, on_unit=processed)
    assert sorted(report.handed) == ["layers.0", "layers.1"]  # not the globals
    assert threads == {threading.get_ident()}
    assert freed == {"layers.0": True, "layers.1": True}
    assert engine.parameters == []  # let go of once planned
    assert report.parameters == 1 + 2 * LAYERS + 1
    for name, tensor in state(model).items():
        want = expected[name]
        if name.endswith(".qkv"):
            want = (want.view(torch.float32) * 2).view(torch.uint8)
        assert torch.equal(tensor, want), name


def test_a_layer_is_handed_over_once_the_tensors_the_loader_casts_into_it_are_loaded(
    tmp_path: Path,
) -> None:
    """A layer's float32 norm goes through the engine's loader (a cast): it is handed to
    the loader once the layer's reads have landed, before the layer is handed over."""
    ckpt = write(tmp_path, weights())
    expected = state(by_its_own_loader(ckpt))
    model = Fused()
    handed: list[str] = []

    def processed(unit: str) -> None:
        layer = state(model.layers[int(unit.removeprefix("layers."))])
        assert torch.equal(layer["norm"], expected[f"{unit}.norm"])
        assert torch.equal(layer["qkv"], expected[f"{unit}.qkv"])
        handed.append(unit)

    report = load_into_engine(ckpt, engine_of(model, ckpt), on_unit=processed)
    assert sorted(handed) == ["layers.0", "layers.1"]
    assert list(report.handed) == handed
    assert report.transformed == ("layers.0.norm", "layers.1.norm")
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())


def test_layers_a_cast_tensor_writes_together_are_left_to_the_end(tmp_path: Path) -> None:
    """One float32 tensor cast into both layers' norms: neither layer is complete before
    the loader is handed it, after the reads, so neither is handed over early."""
    tensors = weights()
    tensors["norms"] = torch.stack([tensors.pop(f"layers.{i}.norm") for i in range(LAYERS)])
    ckpt = write(tmp_path, tensors)
    model = Fused()
    handed: list[str] = []
    report = load_into_engine(ckpt, engine_of(model, ckpt), on_unit=handed.append)
    assert (handed, report.handed, report.transformed) == ([], (), ("norms",))
    expected = state(by_its_own_loader(ckpt))
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())


def test_an_error_handing_a_layer_over_stops_the_load_and_is_raised(tmp_path: Path) -> None:
    ckpt = write(tmp_path, {n: t.float() for n, t in weights().items()})
    model = Fused(torch.float32)

    def broken(unit: str) -> None:
        raise RuntimeError(f"cannot repack {unit}")

    with pytest.raises(RuntimeError, match=r"cannot repack layers\.\d"):
        load_into_engine(ckpt, engine_of(model, ckpt), on_unit=broken)
    # The engine can load again: nothing of the failed load is left running.
    load_into_engine(ckpt, engine_of(model, ckpt))
    expected = state(by_its_own_loader(ckpt, Fused(torch.float32)))
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())


def _reload(model: Fused, ckpt: Checkpoint, placement: Placement) -> Placer:
    """``model``'s loader run again on ``ckpt``'s tensors, those the first load placed read
    straight into the model's tensors (found by name, as an engine's adapter would)."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = {PREFIX + n: n for n in ckpt.tensors}
    placer = Placer(placement, ckpt, names, own.get)
    handed: dict[str, int] = {}

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in stream_tensors(ckpt, window_bytes=64, place=placer):
            handed[name] = tensor.untyped_storage().data_ptr()
            yield PREFIX + name, tensor

    model.load_weights(tensors())
    storages = {t.untyped_storage().data_ptr() for t in own.values()}
    placer.declined["(test) handed as the model's own memory"] = sum(
        1 for ptr in handed.values() if ptr in storages
    )
    return placer


def test_a_reload_reads_each_whole_copied_tensor_straight_into_its_first_place(
    tmp_path: Path,
) -> None:
    """The first load's placement, by name: at a reload from another checkpoint of the same
    layout, q, k, v, the embedding and the buffer are read into the model's own bytes and
    handed to its loader as views of them (its copy is of the bytes onto themselves); the
    cast norms and the skipped table go through the stream. The model ends as its own
    loader leaves it given the new checkpoint."""
    first = write(tmp_path, weights())
    model = Fused()
    kept: list[Placement] = []
    load_into_engine(first, engine_of(model, first), placed=kept.append)
    (placement,) = kept
    assert sorted(placement.places) == sorted(
        PREFIX + n for n in weights() if n not in ("inv_freq", "layers.0.norm", "layers.1.norm")
    )
    other = {n: t * 3 if t.is_floating_point() else t for n, t in weights().items()}
    (tmp_path / "other").mkdir()
    second = write(tmp_path / "other", other)
    before = pointers(model)
    placer = _reload(model, second, placement)
    assert pointers(model) == before
    expected = state(by_its_own_loader(second))
    assert all(torch.equal(t, expected[n]) for n, t in state(model).items())
    assert placer.placed == len(placement.places) == 1 + 2 * 3 + 2
    assert placer.placed_bytes == sum(
        other[p.removeprefix(PREFIX)].nbytes for p in placement.places
    )
    assert placer.declined["(test) handed as the model's own memory"] == placer.placed
    assert placer.declined["not recorded whole in one place"] == 3


def test_a_reload_streams_a_tensor_whose_dtype_or_destination_changed(tmp_path: Path) -> None:
    """A tensor now of another dtype than at the first load, or whose destination is no
    longer as recorded (replaced by a transposed one), goes to the loader as read."""
    first = write(tmp_path, weights())
    model = Fused()
    kept: list[Placement] = []
    load_into_engine(first, engine_of(model, first), placed=kept.append)
    other = weights()
    other["embed"] = other["embed"].float()  # the loader casts it now
    (tmp_path / "other").mkdir()
    second = write(tmp_path / "other", other)
    model.layers[1].qkv = nn.Parameter(torch.zeros(4, 12, dtype=torch.bfloat16).t(), False)
    placer = _reload(model, second, kept[0])
    assert placer.declined["another dtype or shape than at the first load"] == 1
    assert placer.declined["its destination changed since the first load"] == 3  # q, k, v
    assert placer.placed == 1 + 2 * 3 + 2 - 4
    assert torch.equal(model.embed, other["embed"].bfloat16())
    assert torch.equal(model.layers[1].qkv.data.narrow(0, 4, 4), other["layers.1.k"])

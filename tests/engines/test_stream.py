"""A checkpoint's tensors as an iterator (``_stream``, behind vLLM's ``get_all_weights``):
every tensor as safetensors reads it, in file order, at most two windows held, errors raised
from the iterator, and an early close that stops and waits for the reads."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab.engines import _stream
from tests.helpers import open_fds, raw_bytes


def _write(root: Path, shards: int = 3, per_shard: int = 6) -> asyncslab.Checkpoint:
    """Shards of mixed dtypes and sizes (one tensor larger than the tests' windows)."""
    root.mkdir()
    g = torch.Generator().manual_seed(7)
    for s in range(shards):
        tensors: dict[str, torch.Tensor] = {}
        for i in range(per_shard):
            n = 64 * (1 + (s * per_shard + i) % 5)
            dtype = (torch.float32, torch.bfloat16, torch.int8)[i % 3]
            t = torch.randn(n, generator=g).mul(50)
            tensors[f"model.layers.{s}.t{i}.weight"] = t.to(dtype)
        if s == 1:
            tensors["model.layers.1.big.weight"] = torch.randn(4096, generator=g)
        save_file(tensors, str(root / f"model-{s:05d}-of-{shards:05d}.safetensors"))
    return asyncslab.Checkpoint.open(root)


def _reference(ckpt: asyncslab.Checkpoint) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in ckpt.files:
        with safe_open(str(f.path), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118
                out[name] = st.get_tensor(name)
    return out


def test_every_tensor_as_safetensors_reads_it_in_file_order(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt")
    reference = _reference(ckpt)
    got = list(_stream.stream_tensors(ckpt, window_bytes=3000))
    assert [n for n, _ in got] == list(ckpt.tensors)  # file order, then payload order
    for name, tensor in got:
        want = reference[name]
        assert (tensor.dtype, tensor.shape, tensor.device.type) == (want.dtype, want.shape, "cpu")
        assert torch.equal(raw_bytes(tensor), raw_bytes(want)), name


def test_only_the_tensors_asked_for(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt")
    names = list(ckpt.tensors)[::4]
    got = dict(_stream.stream_tensors(ckpt, list(reversed(names)), window_bytes=1000))
    assert list(got) == names  # still in file order
    with pytest.raises(asyncslab.LoadError, match="no tensor 'nope'"):
        _stream.stream_tensors(ckpt, ["nope"])


def test_windows_cut_in_order_within_the_bound() -> None:
    class Info:
        def __init__(self, nbytes: int) -> None:
            self.nbytes = nbytes

    infos: list[Any] = [Info(n) for n in (400, 500, 200, 2000, 100, 100, 900)]
    runs = _stream.windows(infos, 1000)
    cut = [[i.nbytes for i in run] for run in runs]
    assert cut == [[400, 500], [200], [2000], [100, 100], [900]]
    assert _stream.windows([], 1000) == []


def test_the_reads_stay_at_most_one_window_ahead_of_the_consumer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _write(tmp_path / "ckpt", shards=4)
    started: list[int] = []
    lock = threading.Lock()
    real = _stream.SlabSet

    class Counting(real):  # type: ignore[misc, valid-type]
        async def load(self, *args: Any, **kwargs: Any) -> Any:
            with lock:
                started.append(len(started))
            return await super().load(*args, **kwargs)

    monkeypatch.setattr(_stream, "SlabSet", Counting)
    window = 1500
    infos = sorted(ckpt.tensors.values(), key=lambda t: (t.file.name, t.offset))
    runs = _stream.windows(infos, window)
    assert len(runs) >= 6
    first_of = {run[0].name: k for k, run in enumerate(runs)}
    taken = 0
    for name, _ in _stream.stream_tensors(ckpt, window_bytes=window):
        taken = first_of.get(name, taken)
        # Consuming window k: windows up to k + 1 may have started, never k + 2.
        with lock:
            assert len(started) <= taken + 2, (taken, len(started))
    assert len(started) == len(runs)


def test_a_window_is_read_into_memory_the_consumer_let_go_of(tmp_path: Path) -> None:
    """A consumer that copies each tensor and lets it go: the windows take turns in the
    same memory (new memory costs a page fault per page), every tensor still exact when
    taken."""
    ckpt = _write(tmp_path / "ckpt", shards=4)
    reference = _reference(ckpt)
    window = 1500
    runs = _stream.windows(
        sorted(ckpt.tensors.values(), key=lambda t: (t.file.name, t.offset)), window
    )
    assert len(runs) >= 8
    storages = set()
    for name, tensor in _stream.stream_tensors(ckpt, window_bytes=window):
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name
        storages.add(tensor.untyped_storage().data_ptr())
    # Two windows in turn, and one more for the tensor larger than a window.
    assert len(storages) <= 3, len(storages)


def test_memory_the_consumer_keeps_a_tensor_of_is_never_read_into_again(tmp_path: Path) -> None:
    """A consumer that keeps one tensor of each window (as a loader that collects tensors
    to fuse later would): no later window is read into the memory under it."""
    ckpt = _write(tmp_path / "ckpt", shards=4)
    reference = _reference(ckpt)
    window = 1500
    runs = _stream.windows(
        sorted(ckpt.tensors.values(), key=lambda t: (t.file.name, t.offset)), window
    )
    firsts = {run[0].name for run in runs}
    kept = [
        (name, tensor)
        for name, tensor in _stream.stream_tensors(ckpt, window_bytes=window)
        if name in firsts
    ]
    assert len(kept) == len(runs)
    for name, tensor in kept:
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name
    assert len({t.untyped_storage().data_ptr() for _, t in kept}) == len(runs)


def test_a_tensor_given_a_place_is_read_into_it_and_handed_over_as_it(tmp_path: Path) -> None:
    """``place`` gives destinations (a reload: the engine's own tensors) for some tensors:
    those are read into them and handed over as views of them; the rest come from the
    windows as before, and windows whose tensors are all placed take no memory."""
    ckpt = _write(tmp_path / "ckpt", shards=4)
    reference = _reference(ckpt)
    placed = {
        n: torch.empty_like(t)
        for n, t in reference.items()
        if "layers.0" in n or n.endswith("t1.weight")
    }
    asked: list[str] = []

    def place(name: str) -> torch.Tensor | None:
        asked.append(name)
        return placed.get(name)

    window = 1500
    runs = _stream.windows(
        sorted(ckpt.tensors.values(), key=lambda t: (t.file.name, t.offset)), window
    )
    empty_windows = sum(all(i.name in placed for i in run) for run in runs)
    assert empty_windows >= 1
    storages = set()
    got = 0
    for name, tensor in _stream.stream_tensors(ckpt, window_bytes=window, place=place):
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name
        if name in placed:
            assert tensor.data_ptr() == placed[name].data_ptr()  # its memory, not a copy
        else:
            storages.add(tensor.untyped_storage().data_ptr())
        got += 1
    assert got == len(reference)
    assert sorted(asked) == sorted(reference)
    assert all(torch.equal(raw_bytes(t), raw_bytes(reference[n])) for n, t in placed.items())
    assert len(storages) <= 3, len(storages)


def test_an_early_close_stops_the_reads_and_waits_for_them(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt")
    fds = open_fds()
    stream = _stream.stream_tensors(ckpt, window_bytes=1000)
    name, tensor = next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-stream"]
    assert open_fds() == fds
    # A tensor taken before the close stays valid: it holds its window's memory.
    assert torch.equal(raw_bytes(tensor), raw_bytes(_reference(ckpt)[name]))


def test_a_file_changed_after_opening_raises_from_the_iterator(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt")
    victim = ckpt.files[1].path
    stream = _stream.stream_tensors(ckpt, window_bytes=1000)
    next(stream)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    tmp = victim.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, victim)
    with pytest.raises(asyncslab.errors.FileChangedError, match=victim.name):
        for _ in stream:
            pass
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-stream"]


def test_a_window_bytes_that_is_not_a_positive_int_is_refused(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt", shards=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="window_bytes"):
            _stream.stream_tensors(ckpt, window_bytes=bad)  # type: ignore[arg-type]

"""A checkpoint's tensors as an iterator (``_stream``, behind vLLM's ``get_all_weights``):
every tensor as safetensors reads it, in file order, at most two windows held, local files'
tensors as views of a private mapping, errors raised from the iterator, and an early close
that stops and waits for the reads.

The window tests pass ``mapped=False``: windows are what objects in a store and placed
tensors go through, and local files without the mapping the same code."""

from __future__ import annotations

import gc
import json
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import asyncslab
from asyncslab.engines import _stream
from asyncslab.testing import SyntheticCheckpoint
from support.faults import raw_bytes
from support.s3server import SeaweedServer
from tests.helpers import open_fds


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


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "windows"])
def test_every_tensor_as_safetensors_reads_it_in_file_order(tmp_path: Path, mapped: bool) -> None:
    ckpt = _write(tmp_path / "ckpt")
    reference = _reference(ckpt)
    got = list(_stream.stream_tensors(ckpt, window_bytes=3000, mapped=mapped))
    assert [n for n, _ in got] == list(ckpt.tensors)  # file order, then payload order
    for name, tensor in got:
        want = reference[name]
        assert (tensor.dtype, tensor.shape, tensor.device.type) == (want.dtype, want.shape, "cpu")
        assert torch.equal(raw_bytes(tensor), raw_bytes(want)), name


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "windows"])
def test_only_the_tensors_asked_for(tmp_path: Path, mapped: bool) -> None:
    ckpt = _write(tmp_path / "ckpt")
    names = list(ckpt.tensors)[::4]
    asked = list(reversed(names))
    got = dict(_stream.stream_tensors(ckpt, asked, window_bytes=1000, mapped=mapped))
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
    for name, _ in _stream.stream_tensors(ckpt, window_bytes=window, mapped=False):
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
    for name, tensor in _stream.stream_tensors(ckpt, window_bytes=window, mapped=False):
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
        for name, tensor in _stream.stream_tensors(ckpt, window_bytes=window, mapped=False)
        if name in firsts
    ]
    assert len(kept) == len(runs)
    for name, tensor in kept:
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name
    assert len({t.untyped_storage().data_ptr() for _, t in kept}) == len(runs)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "windows"])
def test_a_tensor_given_a_place_is_read_into_it_and_handed_over_as_it(
    tmp_path: Path, mapped: bool
) -> None:
    """``place`` gives destinations (a reload: the engine's own tensors) for some tensors:
    those are read into them and handed over as views of them; the rest come from their
    files' mappings, or from the windows, and windows whose tensors are all placed take no
    memory."""
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
    stream = _stream.stream_tensors(ckpt, window_bytes=window, place=place, mapped=mapped)
    for name, tensor in stream:
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name
        if name in placed:
            assert tensor.data_ptr() == placed[name].data_ptr()  # its memory, not a copy
        else:
            storages.add(tensor.untyped_storage().data_ptr())
        got += 1
    assert got == len(reference)
    assert sorted(asked) == sorted(reference)
    assert all(torch.equal(raw_bytes(t), raw_bytes(reference[n])) for n, t in placed.items())
    if mapped:  # one storage per file an unplaced tensor lies in: its mapping
        files = {ckpt.tensors[n].file for n in reference if n not in placed}
        assert len(storages) == len(files) == 3, (storages, files)
    else:
        assert len(storages) <= 3, len(storages)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "windows"])
def test_an_early_close_stops_the_reads_and_waits_for_them(tmp_path: Path, mapped: bool) -> None:
    ckpt = _write(tmp_path / "ckpt")
    fds = open_fds()
    stream = _stream.stream_tensors(ckpt, window_bytes=1000, mapped=mapped)
    name, tensor = next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-stream"]
    # A tensor taken before the close stays valid: it holds its window's memory, or its
    # file's mapping (and the descriptor a mapping keeps), until it goes.
    assert torch.equal(raw_bytes(tensor), raw_bytes(_reference(ckpt)[name]))
    assert (open_fds() == fds) is not mapped
    del tensor
    gc.collect()
    assert open_fds() == fds


def test_a_mapped_tensor_is_the_file_s_bytes_and_writing_it_changes_nothing_else(
    tmp_path: Path,
) -> None:
    """A view of the page cache, not a copy; private: a consumer that writes into it (an
    in-place transform) changes neither the file nor what a later stream hands over."""
    ckpt = _write(tmp_path / "ckpt")
    reference = _reference(ckpt)
    before = {f.path: f.path.read_bytes() for f in ckpt.files}
    with pytest.MonkeyPatch.context() as patch:
        # Nothing is read into a window: no window is ever loaded.
        patch.setattr(_stream.SlabSet, "load", None)
        first = dict(_stream.stream_tensors(ckpt, window_bytes=1000))
    by_file: dict[Path, set[int]] = {}
    for name, tensor in first.items():
        by_file.setdefault(ckpt.tensors[name].file, set()).add(tensor.untyped_storage().data_ptr())
        tensor.view(torch.uint8).fill_(0xA5)
    assert all(len(storages) == 1 for storages in by_file.values()), by_file  # one mapping
    assert {f.path: f.path.read_bytes() for f in ckpt.files} == before
    for name, tensor in _stream.stream_tensors(ckpt, window_bytes=1000):
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name


def test_a_mapped_tensor_at_an_offset_no_view_can_start_at_is_copied(tmp_path: Path) -> None:
    """The safetensors library aligns every tensor; a file written by hand need not. A
    float32 tensor 1 byte into the payload cannot be a view of the mapping: it is a copy of
    its bytes, still exact."""
    root = tmp_path / "ckpt"
    root.mkdir()
    header = json.dumps(
        {
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "b": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    values = torch.tensor([1.5, -2.0, 3.25])
    payload = b"\x07" + values.numpy().tobytes()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    ckpt = asyncslab.Checkpoint.open(root)
    assert ckpt.tensors["b"].offset % 4 == 1
    got = dict(_stream.stream_tensors(ckpt))
    assert got["a"].tolist() == [7]
    assert torch.equal(got["b"], values)


def test_a_mapped_file_truncated_under_the_stream_is_a_read_error_not_a_crash(
    tmp_path: Path,
) -> None:
    """A file cut short after it was mapped: the window's bytes are faulted in on the
    reading thread before any view of them is handed over, so the stream raises a
    ``ReadError`` naming the file, where touching the view would have killed the process
    (SIGBUS)."""
    ckpt = _write(tmp_path / "ckpt")
    victim = ckpt.files[1].path
    window = 500
    infos = sorted(ckpt.tensors.values(), key=lambda t: (t.file.name, t.offset))
    runs = [run for run in _stream.windows(infos, window) if run[0].file == victim]
    # A later window of the file starting a page or more in: cut the file at that page, so
    # that none of the window's bytes lie within it (the rest of a file's last page reads
    # as zeros, no fault).
    page = mmap.PAGESIZE
    cut_run = next(run for run in runs[1:] if run[0].offset >= page)
    cut = cut_run[0].offset - cut_run[0].offset % page
    assert cut > runs[0][-1].offset  # the file's first window lies within what is kept

    # ``place`` is asked on the reading thread before a window's views are made: the hook
    # to cut the file after its first window mapped it.
    def place(name: str) -> None:
        if name == cut_run[0].name:
            os.truncate(victim, cut)
        return None

    handed: list[str] = []
    with pytest.raises(asyncslab.errors.ReadError, match=victim.name) as info:  # noqa: PT012
        for name, _ in _stream.stream_tensors(ckpt, window_bytes=window, place=place):
            handed.append(name)
    assert "cannot read" in str(info.value)
    assert runs[0][0].name in handed
    assert not {t.name for t in cut_run} & set(handed)  # nothing of the cut window
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-stream"]


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "windows"])
def test_a_file_changed_after_opening_raises_from_the_iterator(
    tmp_path: Path, mapped: bool
) -> None:
    ckpt = _write(tmp_path / "ckpt")
    victim = ckpt.files[1].path
    stream = _stream.stream_tensors(ckpt, window_bytes=1000, mapped=mapped)
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


def test_an_object_store_checkpoint_goes_through_windows(
    s3_server: SeaweedServer, s3_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    """Objects have no mapping: their tensors are read into windows whatever ``mapped``
    says, each exact."""
    remote = asyncslab.Checkpoint.open(s3_small, storage_options=s3_server.options())
    reference = _reference(asyncslab.Checkpoint.open(small_checkpoint.root))
    got = list(_stream.stream_tensors(remote, window_bytes=4096))
    assert [n for n, _ in got] == list(remote.tensors)
    for name, tensor in got:
        assert torch.equal(raw_bytes(tensor), raw_bytes(reference[name])), name

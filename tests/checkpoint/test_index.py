"""Opening a checkpoint directory: ``model.safetensors.index.json``, or every ``*.safetensors``.

Each malformed or hostile layout must be refused with its own error, naming the index or the
file (and the tensor, where one is to blame), and must never hang (FIFOs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncslab import Checkpoint, CheckpointError
from asyncslab.errors import (
    DuplicateTensorError,
    HeaderError,
    IndexFileError,
    IndexMismatchError,
    MissingFileError,
    SizeMismatchError,
    UnsafePathError,
)
from tests import malformed

INDEX = "model.safetensors.index.json"


def shard(directory: Path, name: str, names: list[str], dtype: torch.dtype = torch.float32) -> Path:
    """A shard written by the reference, one small tensor per name (values tell them apart)."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        n: (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * i).to(dtype)
        for i, n in enumerate(names)
    }
    save_file(tensors, str(path))
    return path


def index(directory: Path, weight_map: Any, **extra: Any) -> Path:
    path = directory / INDEX
    path.write_text(json.dumps({"metadata": {"total_size": 0}, **extra, "weight_map": weight_map}))
    return path


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    """``a.safetensors`` holds x and y, ``b.safetensors`` holds z."""
    shard(tmp_path, "a.safetensors", ["x", "y"])
    shard(tmp_path, "b.safetensors", ["z"], torch.bfloat16)
    return tmp_path


# --- a valid index -------------------------------------------------------------------------


def test_index_multi_file_opens(two_shards: Path) -> None:
    root = two_shards
    shard(root, "sub/c.safetensors", ["w"], torch.int16)
    idx = index(
        root,
        {
            "z": "b.safetensors",
            "x": "a.safetensors",
            "w": "sub/c.safetensors",
            "y": "a.safetensors",
        },
    )
    ck = Checkpoint.open(root)
    assert ck.index == idx
    assert ck.root == root
    # Files in order of first mention in the index; tensors in file, then payload, order.
    assert [f.path for f in ck.files] == [
        root / "b.safetensors",
        root / "a.safetensors",
        root / "sub" / "c.safetensors",
    ]
    assert list(ck.tensors) == ["z", "x", "y", "w"]
    assert {n: t.file.name for n, t in ck.tensors.items()} == {
        "x": "a.safetensors",
        "y": "a.safetensors",
        "z": "b.safetensors",
        "w": "c.safetensors",
    }
    assert ck.tensors["z"].dtype == torch.bfloat16
    assert ck.tensors["w"].dtype == torch.int16
    assert all(t.shape == (2, 3) for t in ck)
    # Offsets are absolute within each file: the bytes there are the tensor's.
    with open(root / "a.safetensors", "rb") as f:
        f.seek(ck.tensors["y"].offset)
        y = torch.frombuffer(bytearray(f.read(ck.tensors["y"].nbytes)), dtype=torch.float32)
    assert y.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert ck.total_bytes == sum(f.size - f.data_start for f in ck.files)
    assert len(ck) == 4
    assert "files=3" in repr(ck)
    assert "tensors=4" in repr(ck)


def test_index_opens_through_str_and_symlinked_root(
    two_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert len(Checkpoint.open(str(two_shards))) == 3
    link = tmp_path_factory.mktemp("links") / "ckpt"
    link.symlink_to(two_shards, target_is_directory=True)
    assert len(Checkpoint.open(link)) == 3


def test_index_ignores_unreferenced_files(two_shards: Path) -> None:
    """Stale shards the index does not name are not even read."""
    (two_shards / "stale.safetensors").write_bytes(b"garbage")
    os.mkfifo(two_shards / "fifo.safetensors")
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert sorted(Checkpoint.open(two_shards).tensors) == ["x", "y", "z"]


def test_index_allows_symlink_inside_directory(two_shards: Path) -> None:
    (two_shards / "blobs").mkdir()
    (two_shards / "b.safetensors").rename(two_shards / "blobs" / "b-real")
    (two_shards / "b.safetensors").symlink_to(Path("blobs") / "b-real")
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    ck = Checkpoint.open(two_shards)
    assert ck.tensors["z"].file == two_shards / "b.safetensors"


# --- a malformed index ---------------------------------------------------------------------

BAD_INDEXES = [
    ("not-json", b"{", r"index is not valid JSON", None),
    ("empty", b"", r"index is not valid JSON", None),
    ("not-utf8", b'{"weight_map": {"x": "\xff"}}', r"cannot read index", None),
    ("top-level-array", b"[]", r"index must be a JSON object, got list", None),
    ("no-weight_map", b'{"metadata": {}}', r"index has no 'weight_map' object", None),
    ("weight_map-list", b'{"weight_map": ["a.safetensors"]}', r"no 'weight_map' object", None),
    ("weight_map-string", b'{"weight_map": "a.safetensors"}', r"no 'weight_map' object", None),
    ("weight_map-null", b'{"weight_map": null}', r"no 'weight_map' object", None),
    ("file-name-number", b'{"weight_map": {"x": 5}}', r"maps to 5, expected a file name", "x"),
    ("file-name-null", b'{"weight_map": {"x": null}}', r"maps to None, expected a file", "x"),
    ("file-name-list", b'{"weight_map": {"x": ["a.safetensors"]}}', r"expected a file", "x"),
    ("file-name-object", b'{"weight_map": {"x": {"f": "a"}}}', r"expected a file name", "x"),
    (
        "duplicate-tensor-in-weight_map",
        b'{"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}}',
        r"weight_map names key 'x' twice",
        None,
    ),
    (
        "duplicate-weight_map",
        b'{"weight_map": {}, "weight_map": {"x": "a.safetensors"}}',
        r"index names key 'weight_map' twice",
        None,
    ),
    (
        "nan-in-metadata",
        b'{"metadata": {"total_size": NaN}, "weight_map": {"x": "a.safetensors"}}',
        r"index is not valid JSON",
        None,
    ),
    (
        "int-over-4300-digits",
        b'{"metadata": {"total_size": ' + b"7" * 5000 + b'}, "weight_map": {}}',
        r"index is not valid JSON",
        None,
    ),
    (
        "same-file-two-spellings",
        b'{"weight_map": {"x": "a.safetensors", "y": "./a.safetensors", "z": "b.safetensors"}}',
        r"'a.safetensors' and './a.safetensors' name the same file",
        None,
    ),
    (
        "same-file-trailing-slash",
        b'{"weight_map": {"x": "a.safetensors", "y": ".//a.safetensors/", "z": "b.safetensors"}}',
        r"name the same file",
        None,
    ),
]


@pytest.mark.parametrize(
    ("text", "match", "tensor"),
    [pytest.param(t, m, n, id=i) for i, t, m, n in BAD_INDEXES],
)
def test_malformed_index(two_shards: Path, text: bytes, match: str, tensor: str | None) -> None:
    path = two_shards / INDEX
    path.write_bytes(text)
    with pytest.raises(IndexFileError, match=match) as info:
        Checkpoint.open(two_shards)
    err = info.value
    assert type(err) is IndexFileError
    assert err.file == str(path)
    assert err.tensor == tensor
    assert str(err).startswith(f"{path}: ")


def test_same_file_via_symlink_alias(two_shards: Path) -> None:
    (two_shards / "alias.safetensors").symlink_to("a.safetensors")
    idx = index(two_shards, {"x": "a.safetensors", "y": "alias.safetensors", "z": "b.safetensors"})
    with pytest.raises(IndexFileError, match="'a.safetensors' and 'alias.safetensors' name the"):
        Checkpoint.open(two_shards)
    assert idx.exists()


# --- files the index names -----------------------------------------------------------------


def test_referenced_file_missing(two_shards: Path) -> None:
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "gone.safetensors"})
    missing = two_shards / "gone.safetensors"
    with pytest.raises(MissingFileError, match=f"^{missing}: file does not exist$") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(missing)


@pytest.mark.parametrize(
    "name",
    [
        "/abs/a.safetensors",
        "../a.safetensors",
        "sub/../../a.safetensors",
        "sub/../a.safetensors",  # stays inside, but '..' is refused outright
        "",
    ],
    ids=["absolute", "parent", "nested-parent", "parent-inside", "empty"],
)
def test_unsafe_path_in_index(two_shards: Path, name: str) -> None:
    (two_shards / "sub").mkdir()
    idx = index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": name})
    with pytest.raises(UnsafePathError, match=r"must be relative and stay inside") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(idx)
    assert repr(name) in str(info.value)


def test_absolute_path_to_real_file_is_unsafe(two_shards: Path) -> None:
    target = two_shards / "a.safetensors"  # even when it points into the directory itself
    index(two_shards, {"x": str(target), "y": str(target), "z": "b.safetensors"})
    with pytest.raises(UnsafePathError, match="must be relative"):
        Checkpoint.open(two_shards)


def test_symlink_pointing_outside(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    outside = tmp_path / "elsewhere"
    shard(root, "a.safetensors", ["x"])
    shard(outside, "secret.safetensors", ["s"])
    (root / "link.safetensors").symlink_to(outside / "secret.safetensors")
    idx = index(root, {"x": "a.safetensors", "s": "link.safetensors"})
    with pytest.raises(UnsafePathError, match=r"'link.safetensors' resolves to .*outside") as info:
        Checkpoint.open(root)
    assert info.value.file == str(idx)
    # Through a symlinked subdirectory, likewise.
    (root / "sub").symlink_to(outside, target_is_directory=True)
    index(root, {"x": "a.safetensors", "s": "sub/secret.safetensors"})
    with pytest.raises(UnsafePathError, match=r"'sub/secret.safetensors' resolves to"):
        Checkpoint.open(root)


def test_symlink_outside_without_index(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shard(root, "a.safetensors", ["x"])
    shard(tmp_path / "elsewhere", "secret.safetensors", ["s"])
    (root / "b.safetensors").symlink_to(tmp_path / "elsewhere" / "secret.safetensors")
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory") as info:
        Checkpoint.open(root)
    assert info.value.file == str(root / "b.safetensors")


@pytest.mark.timeout(60)
def test_symlink_loop(two_shards: Path) -> None:
    (two_shards / "loop.safetensors").symlink_to("loop.safetensors")
    # Without an index, the loop is one of the *.safetensors files.
    with pytest.raises(MissingFileError, match=r"loop\.safetensors") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "loop.safetensors")
    # Named by the index.
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "loop.safetensors"})
    with pytest.raises(MissingFileError, match=r"loop\.safetensors"):
        Checkpoint.open(two_shards)
    # Opened directly.
    with pytest.raises(MissingFileError):
        Checkpoint.open(two_shards / "loop.safetensors")


def test_index_names_a_directory(two_shards: Path) -> None:
    (two_shards / "dir.safetensors").mkdir()
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "dir.safetensors"})
    with pytest.raises(MissingFileError, match="not a regular file") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "dir.safetensors")


@pytest.mark.timeout(60)
def test_index_names_a_fifo(two_shards: Path) -> None:
    os.mkfifo(two_shards / "fifo.safetensors")
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "fifo.safetensors"})
    with pytest.raises(MissingFileError, match="not a regular file") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "fifo.safetensors")


@pytest.mark.timeout(60)
def test_fifo_without_index_and_opened_directly(two_shards: Path) -> None:
    fifo = two_shards / "c.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(MissingFileError, match="not a regular file"):
        Checkpoint.open(two_shards)
    with pytest.raises(MissingFileError, match="not a regular file"):
        Checkpoint.open(fifo)


@pytest.mark.timeout(60)
def test_index_itself_a_fifo_or_directory(tmp_path: Path) -> None:
    fifo_root = tmp_path / "fifo"
    shard(fifo_root, "a.safetensors", ["x"])
    os.mkfifo(fifo_root / INDEX)
    with pytest.raises(IndexFileError, match="not a regular file"):
        Checkpoint.open(fifo_root)
    dir_root = tmp_path / "dir"
    shard(dir_root, "a.safetensors", ["x"])
    (dir_root / INDEX).mkdir()
    with pytest.raises(IndexFileError):
        Checkpoint.open(dir_root)


def test_malformed_shard_under_index(two_shards: Path) -> None:
    bad = two_shards / "b.safetensors"
    bad.write_bytes(malformed.one(malformed.E("F32", (2,), (0, 4))))
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "t": "b.safetensors"})
    with pytest.raises(SizeMismatchError) as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(bad)
    assert info.value.tensor == "t"
    assert isinstance(info.value, HeaderError)


# --- the index and the headers disagree ----------------------------------------------------


def test_tensor_in_index_absent_from_file(two_shards: Path) -> None:
    idx = index(
        two_shards,
        {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors", "q": "b.safetensors"},
    )
    with pytest.raises(
        IndexMismatchError, match=r"index places it in 'b.safetensors', but no file has it"
    ) as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(idx)
    assert info.value.tensor == "q"
    assert f"{idx}: tensor 'q': " in str(info.value)


def test_tensor_in_wrong_file(two_shards: Path) -> None:
    index(two_shards, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"})
    with pytest.raises(
        IndexMismatchError,
        match=rf"index places it in 'b.safetensors', but it is in {two_shards / 'a.safetensors'}",
    ) as info:
        Checkpoint.open(two_shards)
    assert info.value.tensor == "y"


def test_tensor_in_file_absent_from_index(two_shards: Path) -> None:
    index(two_shards, {"x": "a.safetensors", "z": "b.safetensors"})
    with pytest.raises(
        IndexMismatchError, match=r"present in the file but absent from the index \(1 such"
    ) as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "a.safetensors")
    assert info.value.tensor == "y"


def test_duplicate_tensor_with_index(two_shards: Path) -> None:
    shard(two_shards, "c.safetensors", ["z"])
    index(
        two_shards,
        {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors", "w": "c.safetensors"},
    )
    with pytest.raises(
        DuplicateTensorError,
        match=rf"tensor 'z': also present in {two_shards / 'b.safetensors'}; a tensor must live",
    ) as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "c.safetensors")
    assert info.value.tensor == "z"


def test_duplicate_tensor_without_index(two_shards: Path) -> None:
    shard(two_shards, "c.safetensors", ["q", "x"])
    with pytest.raises(
        DuplicateTensorError, match=rf"also present in {two_shards / 'a.safetensors'}"
    ) as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(two_shards / "c.safetensors")
    assert info.value.tensor == "x"


# --- without an index ----------------------------------------------------------------------


def test_directory_without_index_sorted(tmp_path: Path) -> None:
    for name, names in [
        ("c.safetensors", ["c"]),
        ("a.safetensors", ["a1", "a0"]),
        ("b.safetensors", ["b"]),
    ]:
        shard(tmp_path, name, names)
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "model.bin").write_bytes(b"ignored")
    (tmp_path / "x.safetensors.tmp").write_bytes(b"ignored")
    shard(tmp_path, "nested/d.safetensors", ["d"])  # not recursive
    ck = Checkpoint.open(tmp_path)
    assert ck.index is None
    assert ck.root == tmp_path
    assert [f.path.name for f in ck.files] == ["a.safetensors", "b.safetensors", "c.safetensors"]
    assert list(ck.tensors) == ["a0", "a1", "b", "c"]


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="no \\*.safetensors files and no index") as info:
        Checkpoint.open(tmp_path)
    assert info.value.file == str(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(MissingFileError, match="no \\*.safetensors files"):
        Checkpoint.open(tmp_path)


def test_single_file_path(two_shards: Path) -> None:
    # A file path opens that file alone, even beside an index that names others.
    index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    ck = Checkpoint.open(two_shards / "b.safetensors")
    assert ck.index is None
    assert ck.root == two_shards
    assert list(ck.tensors) == ["z"]
    assert [f.path for f in ck.files] == [two_shards / "b.safetensors"]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="file does not exist"):
        Checkpoint.open(tmp_path / "nothing-here")


def _hub_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A Hugging Face hub cache repository: files are blobs named by hash, and a
    snapshot directory of links to ``../../blobs/<hash>`` (index included)."""
    repo = tmp_path / "models--org--name"
    staging = tmp_path / "staging"
    shard(staging, "model-00001-of-00002.safetensors", ["x", "y"])
    shard(staging, "model-00002-of-00002.safetensors", ["z"], torch.bfloat16)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index(staging, {"x": first, "y": first, "z": second})
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(staging.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return repo, snapshot


def test_a_hub_cache_snapshot_opens_and_loads(tmp_path: Path) -> None:
    # Its shards link into the repository's blobs, outside the snapshot directory: refused
    # before, though it is how most downloaded checkpoints lie on disk.
    import asyncio

    import asyncslab

    _, snapshot = _hub_cache(tmp_path)
    ckpt = Checkpoint.open(snapshot)
    assert sorted(ckpt.tensors) == ["x", "y", "z"]
    slabs = asyncio.run(asyncslab.load(ckpt, asyncslab.plan(ckpt)))
    assert torch.equal(slabs.view("y"), torch.arange(6.0).reshape(2, 3) + 10)
    assert torch.equal(slabs.view("z"), torch.arange(6).reshape(2, 3).to(torch.bfloat16))
    asyncio.run(slabs.aclose())


def test_a_hub_cache_snapshot_may_not_link_anywhere_else(tmp_path: Path) -> None:
    repo, snapshot = _hub_cache(tmp_path)
    elsewhere = shard(tmp_path / "elsewhere", "secret.safetensors", ["z"], torch.bfloat16)
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    (snapshot / "model-00002-of-00002.safetensors").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        Checkpoint.open(snapshot)
    # Nor into the repository beyond its blobs, nor into another snapshot's directory.
    (repo / "refs").mkdir()
    moved = elsewhere.rename(repo / "refs" / "secret.safetensors")
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    (snapshot / "model-00002-of-00002.safetensors").symlink_to(moved)
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        Checkpoint.open(snapshot)


def test_an_index_opens_the_checkpoint_it_lists(two_shards: Path) -> None:
    # It was read as a shard ("header length 8388068008349082235 exceeds the limit"), then
    # refused with "open the checkpoint directory" (which cannot pick one of several).
    idx = index(two_shards, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    by_index, by_directory = Checkpoint.open(idx), Checkpoint.open(two_shards)
    assert sorted(by_index.tensors) == ["x", "y", "z"]
    assert by_index.index == by_directory.index == idx
    assert by_index.root == by_directory.root == two_shards
    assert by_index.tensors == by_directory.tensors
    # Another JSON file (a tier map, a config) is no index: it said it was one.
    tiers = two_shards / "tier_map.json"
    tiers.write_text('{"1": [3, 4]}')
    with pytest.raises(CheckpointError, match="is a JSON file, not a safetensors file") as info:
        Checkpoint.open(tiers)
    assert not isinstance(info.value, IndexFileError)
    assert info.value.file == str(tiers)


def test_a_directory_whose_only_index_has_another_name_opens_through_it(
    two_shards: Path,
) -> None:
    # diffusers names its index after the model: it was ignored, every *.safetensors
    # globbed instead (c.safetensors, listed nowhere, with them).
    weights = {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    idx = two_shards / "diffusion_pytorch_model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    shard(two_shards, "c.safetensors", ["w"])
    ck = Checkpoint.open(two_shards)
    assert ck.index == idx
    assert sorted(ck.tensors) == ["x", "y", "z"]
    # Two such indexes (variants of one model): refused, naming them, not mixed.
    (two_shards / "diffusion_pytorch_model.fp16.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "c.safetensors"}})
    )
    with pytest.raises(IndexFileError, match=r"2 indexes and no model\.safetensors\.index\.json"):
        Checkpoint.open(two_shards)
    assert sorted(Checkpoint.open(idx).tensors) == ["x", "y", "z"]
    # model.safetensors.index.json, where there is one, is the index, as before.
    index(two_shards, {"w": "c.safetensors"})
    assert sorted(Checkpoint.open(two_shards).tensors) == ["w"]


def test_hidden_files_and_non_files_named_like_an_index_are_not_indexes(
    two_shards: Path,
) -> None:
    weights = {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    idx = two_shards / "diffusion_pytorch_model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    # macOS's AppleDouble twin, a directory and a FIFO of index-like names: not counted.
    (two_shards / ("._" + idx.name)).write_bytes(b"\x00\x05\x16\x07")
    (two_shards / "sub.safetensors.index.json").mkdir()
    os.mkfifo(two_shards / "pipe.safetensors.index.json")
    assert Checkpoint.open(two_shards).index == idx
    idx.unlink()
    assert Checkpoint.open(two_shards).index is None  # globbed, as without an index


def test_a_missing_index_is_a_missing_file(tmp_path: Path) -> None:
    # It said "index is not a regular file", where a missing shard says it does not exist.
    with pytest.raises(MissingFileError, match="file does not exist"):
        Checkpoint.open(tmp_path / "model.safetensors.index.json")


# --- found by a mutation audit: refusals only a hostile or broken index reaches --------------


def test_blobs_two_levels_up_are_outside_unless_the_parent_is_snapshots(tmp_path: Path) -> None:
    """The hub-cache exception (links into ``../../blobs``) holds only for a directory under
    ``snapshots``: a checkpoint at ``repo/revisions/ckpt`` may not link into ``repo/blobs``,
    or a link there would read a file from outside the checkpoint."""
    root = tmp_path / "repo" / "revisions" / "ckpt"
    shard(root, "a.safetensors", ["x"])
    secret = shard(tmp_path / "repo" / "blobs", "secret.safetensors", ["s"])
    (root / "b.safetensors").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"'b.safetensors' resolves to .* outside the"):
        Checkpoint.open(root)
    idx = index(root, {"x": "a.safetensors", "s": "b.safetensors"})
    with pytest.raises(UnsafePathError, match=r"outside the checkpoint directory") as info:
        Checkpoint.open(root)
    assert info.value.file == str(idx)


def test_an_index_naming_a_tensor_twice_is_refused_even_when_the_count_matches(
    two_shards: Path,
) -> None:
    """``x`` listed twice and ``y`` not at all: as many names as the headers hold, each found
    in the file the index says. A repeated key is ambiguous (parsers disagree which entry
    wins) and ``y`` is missing from the index, so it is refused, naming the repeated key."""
    idx = two_shards / INDEX
    idx.write_text(
        '{"metadata": {}, "weight_map": {"x": "a.safetensors", "x": "a.safetensors", '
        '"z": "b.safetensors"}}'
    )
    with pytest.raises(IndexFileError) as info:
        Checkpoint.open(two_shards)
    assert info.value.message == "weight_map names key 'x' twice"
    assert info.value.file == str(idx)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            '{"weight_map": {"x": "a.safetensors", "y", "a.safetensors", "z": "b.safetensors"}}',
            "index is not valid JSON: Expecting ':' delimiter",
            id="comma-for-colon",
        ),
        pytest.param(
            '{"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}, '
            '"weight_map": {}}',
            "index names key 'weight_map' twice",
            id="weight_map-twice",
        ),
        pytest.param(
            '{"weight_map": {"x": "a.safetensors", "y": "a.safetensors", '
            '"z": "b\x01.safetensors"}}',
            "index is not valid JSON: Invalid control character",
            id="control-character-in-file-name",
        ),
    ],
)
def test_an_index_that_is_not_valid_json_is_refused_though_it_lists_every_tensor(
    two_shards: Path, text: str, message: str
) -> None:
    """The fast index reader checks only the syntax around the map it slices out; an index
    that is not JSON (or names weight_map twice, which JSON parsers resolve differently)
    must still be refused rather than read as the map it seems to hold."""
    idx = two_shards / INDEX
    idx.write_text(text)
    with pytest.raises(IndexFileError) as info:
        Checkpoint.open(two_shards)
    assert info.value.message.startswith(message)
    assert info.value.file == str(idx)
    assert info.value.tensor is None


def test_a_nul_in_an_index_file_name_is_an_unsafe_path(two_shards: Path) -> None:
    """``\\u0000`` in a file name: refused as an unsafe path, naming the index, where
    resolving it would raise a bare ValueError ("embedded null byte") from the OS layer."""
    idx = two_shards / INDEX
    idx.write_text(
        '{"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b\\u0000.safetensors"}}'
    )
    with pytest.raises(UnsafePathError, match=r"must be relative and stay inside") as info:
        Checkpoint.open(two_shards)
    assert info.value.file == str(idx)
    assert repr("b\x00.safetensors") in info.value.message


def test_open_files_opens_exactly_the_files_given(tmp_path: Path) -> None:
    """An engine chooses the shard files itself (vLLM filters them through the index, or by
    patterns): ``open_files`` takes that list, in its order, and reads no index."""
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "two.safetensors"))
    save_file({"c": torch.ones(1)}, str(tmp_path / "stale.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    ckpt = Checkpoint.open_files([tmp_path / "two.safetensors", str(tmp_path / "one.safetensors")])
    assert list(ckpt.tensors) == ["b", "a"]
    assert ckpt.index is None
    save_file({"a": torch.ones(1)}, str(tmp_path / "again.safetensors"))
    with pytest.raises(DuplicateTensorError):
        Checkpoint.open_files([tmp_path / "one.safetensors", tmp_path / "again.safetensors"])
    with pytest.raises(MissingFileError):
        Checkpoint.open_files([])
    with pytest.raises(MissingFileError):
        Checkpoint.open_files([tmp_path / "gone.safetensors"])

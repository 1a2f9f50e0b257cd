"""Fast and general implementations of one thing give the same results on the same inputs,
malformed ones included. Pairs with tests of their own elsewhere are listed, each with its
test, in docs/architecture.md ("Fast and general pairs"); these are the pairs that had none.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from asyncslab.engines._recording import _leaves
from asyncslab.loading import _copy as copy_module
from asyncslab.loading import _read as read_module

# --- preadv: libc's through ctypes, and os.preadv -------------------------------------------

_FILE = bytes(random.Random(0).randrange(256) for _ in range(1000))


def _outcome(preadv: Any, fd: int, sizes: list[int], at: int) -> tuple[Any, list[bytes]]:
    """What one call did: bytes read (or the errno it raised) and each buffer's content."""
    buffers = [ctypes.create_string_buffer(b"\xee" * n, n) for n in sizes]
    pairs = [v for b, n in zip(buffers, sizes, strict=True) for v in (ctypes.addressof(b), n)]
    iov = array.array(read_module._IOV_CODE, pairs)
    try:
        got: Any = preadv(fd, iov.buffer_info()[0], len(sizes), at)
    except OSError as err:
        got = errno.errorcode.get(err.errno or 0, err.errno)
    return got, [b.raw for b in buffers]


@pytest.mark.skipif(
    read_module._preadv_raw is read_module._preadv_via_os,
    reason="libc's preadv is not reachable here: os.preadv is the only one",
)
@pytest.mark.parametrize(
    ("sizes", "at"),
    [
        ([10, 0, 300, 1], 0),  # a zero-length entry among others
        ([1000], 0),  # the whole file
        ([600, 600], 0),  # past the end: a short read
        ([7, 9], 995),  # from inside the last bytes
        ([5], 1000),  # at the end: nothing
        ([5], 5000),  # past the end: nothing
        # No negative offset: a plan's offsets are checked non-negative (OffsetError), and
        # there the two differ (libc's preadv refuses it, EINVAL; os.preadv reads at the
        # file's position, as preadv2 does).
    ],
)
def test_libc_and_os_preadv_agree(tmp_path: Path, sizes: list[int], at: int) -> None:
    path = tmp_path / "data"
    path.write_bytes(_FILE)
    fd = os.open(path, os.O_RDONLY)
    try:
        fast = _outcome(read_module._preadv_raw, fd, sizes, at)
        general = _outcome(read_module._preadv_via_os, fd, sizes, at)
    finally:
        os.close(fd)
    assert fast == general
    if isinstance(fast[0], int):
        assert b"".join(fast[1])[: fast[0]] == _FILE[at : at + fast[0]]


@pytest.mark.skipif(
    read_module._preadv_raw is read_module._preadv_via_os,
    reason="libc's preadv is not reachable here: os.preadv is the only one",
)
@pytest.mark.parametrize("fd_kind", ["closed", "directory", "write-only"])
def test_libc_and_os_preadv_fail_alike_on_a_bad_descriptor(tmp_path: Path, fd_kind: str) -> None:
    path = tmp_path / "data"
    path.write_bytes(_FILE)
    if fd_kind == "closed":
        fd = os.open(path, os.O_RDONLY)
        os.close(fd)
    elif fd_kind == "directory":
        fd = os.open(tmp_path, os.O_RDONLY)
    else:
        fd = os.open(path, os.O_WRONLY)
    try:
        fast = _outcome(read_module._preadv_raw, fd, [8], 0)
        general = _outcome(read_module._preadv_via_os, fd, [8], 0)
    finally:
        if fd_kind != "closed":
            os.close(fd)
    assert fast == general
    assert isinstance(fast[0], str)  # an errno, raised as OSError by both


# --- the staged copies: torch's list copy, and a copy per piece ------------------------------


def _pieces(seed: int) -> list[tuple[int, int, int]]:
    """Non-overlapping ``(source offset, destination offset, bytes)`` pieces, some empty."""
    rng = random.Random(seed)
    pieces, src, dst = [], 0, 0
    while src < 3000 and dst < 3000:
        n = rng.choice([0, 1, 3, 64, 257])
        pieces.append((src, dst, n))
        src += n + rng.randrange(3)
        dst += n + rng.randrange(5)
    rng.shuffle(pieces)
    return pieces


@pytest.mark.parametrize("seed", range(5))
def test_list_copy_and_copy_per_piece_agree(seed: int) -> None:
    source = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    results = []
    for copy_all in (copy_module._copy_all, copy_module._copy_each):
        slab = torch.zeros(4096, dtype=torch.uint8)
        dst = [slab[d : d + n] for _, d, n in _pieces(seed)]
        src = [source[s : s + n] for s, _, n in _pieces(seed)]
        copy_all(dst, src, non_blocking=False)
        results.append(slab)
    assert torch.equal(results[0], results[1])
    assert int(results[0].count_nonzero()) > 0


def test_list_copy_and_copy_per_piece_refuse_pieces_of_other_sizes() -> None:
    for copy_all in (copy_module._copy_all, copy_module._copy_each):
        slab = torch.zeros(16, dtype=torch.uint8)
        with pytest.raises(RuntimeError):
            copy_all([slab[0:4]], [torch.ones(5, dtype=torch.uint8)], non_blocking=False)
        assert int(slab.count_nonzero()) == 0


# --- an op's tensors: the recording's one-level walk, and tree_flatten ----------------------


def test_leaves_finds_the_tensors_tree_flatten_finds() -> None:
    """Arguments nested as aten schemas nest them (tensors, lists or tuples of tensors,
    numbers, strings, None; keyword arguments after), in the same order."""
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}),
        ((a,), {}),
        ((a, 1, 2.0, None, "x"), {}),
        ((a, [b, c], (d,)), {}),
        (([a, a],), {"out": b}),
        ((a, []), {"dim": (0, 1), "keepdim": True, "dtype": torch.float32}),
        ((1, [2, 3]), {"x": None}),
        ((a,), {"weight": b, "bias": None, "out": (c, d)}),
    ]
    for args, kwargs in cases:
        flat, _ = tree_flatten((args, kwargs))
        general = [x for x in flat if isinstance(x, torch.Tensor)]
        fast = _leaves(args, kwargs)
        assert [id(x) for x in fast] == [id(x) for x in general], (args, kwargs)

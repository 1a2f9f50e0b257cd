"""Parameter memory faulted in ahead of a load (``engines/_prefault``): every page of each
storage made present without a byte changed, storages it cannot fault skipped, and a thread
that ends when the block does."""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from asyncslab._os import MADV_POPULATE_WRITE, libc_madvise
from asyncslab.engines._prefault import Prefault
from support.faults import HANG_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, Linux")

PAGE = mmap.PAGESIZE


def _faults_writing(t: torch.Tensor) -> int:
    """Minor faults this thread takes to write every byte of ``t``."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.fill_(7)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _kernel_populates() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE``, asked of a page of its own."""
    madvise = libc_madvise()
    page = mmap.mmap(-1, PAGE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        return madvise is not None and madvise(address, PAGE, MADV_POPULATE_WRITE) == 0
    finally:
        page.close()


def _populated_all(prefault: Prefault, nbytes: int) -> None:
    assert prefault.finished.wait(HANG_S)
    if not _kernel_populates():
        pytest.skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
    assert prefault.populated >= nbytes - 2 * PAGE  # the storage's whole pages


def test_memory_is_faulted_in_and_not_a_byte_changes() -> None:
    """Half the memory written before, half never touched: afterwards the written half is
    as written, the rest zeros, and writing all of it faults (almost) nothing."""
    nbytes = 32 << 20
    anonymous = mmap.mmap(-1, nbytes)  # memory no one has touched, whatever ran before
    memory = torch.frombuffer(anonymous, dtype=torch.uint8)
    half = nbytes // 2
    pattern = torch.arange(half, dtype=torch.int64).remainder(251).to(torch.uint8)
    memory[:half].copy_(pattern)
    with Prefault([memory.view(torch.float32)]) as prefault:
        _populated_all(prefault, nbytes)
    assert torch.equal(memory[:half], pattern)
    assert not memory[half:].any()
    # Without the prefault this is one fault per page (4,096 here); allow a few for the
    # thread's own stack and allocator pages.
    assert _faults_writing(memory) < 64


def test_a_storage_it_cannot_fault_is_skipped_and_the_next_still_is(tmp_path: Path) -> None:
    """A read-only file mapping refuses ``MADV_POPULATE_WRITE``: skipped, unchanged, and
    the other storages are faulted in still; meta tensors are not memory."""
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        read_only = torch.frombuffer(mapping, dtype=torch.uint8)
    anonymous = mmap.mmap(-1, 8 << 20)
    fresh = torch.frombuffer(anonymous, dtype=torch.uint8)
    # Walked last to first: the read-only mapping comes first.
    meta = torch.empty(1 << 20, device="meta")
    with Prefault([fresh, meta, read_only]) as prefault:
        _populated_all(prefault, fresh.numel())
    assert prefault.populated < fresh.numel() + 2 * PAGE  # not the mapping's pages
    assert read_only.tolist()[:256] == list(range(256))
    assert _faults_writing(fresh) < 64
    del read_only
    mapping.close()


def test_nothing_to_fault_starts_no_thread() -> None:
    with Prefault([torch.empty(16, device="meta"), torch.empty(0)]) as prefault:
        assert prefault.finished.is_set()
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-prefault"]


def test_leaving_the_block_stops_and_joins_the_thread_whatever_ended_it() -> None:
    """A failure inside the block (a recording that raised) stops the thread and waits for
    it: none is left faulting memory the caller may be about to free."""
    memory = torch.empty(256 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="the load failed"), Prefault([memory]):  # noqa: PT012
        raise RuntimeError("the load failed")
    assert not [t for t in threading.enumerate() if t.name == "asyncslab-prefault"]

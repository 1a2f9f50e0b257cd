"""Positional scatter reads and the I/O pool: a read of thousands of small pieces stays
within the kernel's iovec limit per syscall and lands every byte exactly, and draining the
pool drops reads still queued instead of running them after the load gave up."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncslab import Checkpoint, Dense, LoadOptions, SlabSet, plan
from asyncslab.loading import _read as read_module
from asyncslab.loading._read import IoPool, pread_scatter, scatter
from support.faults import HANG_S
from tests.helpers import assert_bit_identical

PIECES = 2500


def _scattered_read(tmp_path: Path, pieces: int, offset: int) -> tuple[bytes, torch.Tensor]:
    """Reads ``pieces`` bytes at ``offset`` of a file, one byte per iovec entry, into every
    other byte of a buffer in reverse order; returns the file's bytes and the buffer."""
    data = bytes((i * 7 + 3) % 251 for i in range(offset + pieces))
    path = tmp_path / "bytes"
    path.write_bytes(data)
    buffer = torch.zeros(2 * pieces, dtype=torch.uint8)
    base = buffer.data_ptr()
    target = scatter((base + 2 * (pieces - 1 - i), 1) for i in range(pieces))
    assert target.nbytes == pieces
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_scatter(fd, target, offset, path=str(path)) == pieces
    finally:
        os.close(fd)
    return data, buffer


def _expected(data: bytes, pieces: int, offset: int) -> torch.Tensor:
    want = torch.zeros(2 * pieces, dtype=torch.uint8)
    got = torch.tensor(list(data[offset : offset + pieces]), dtype=torch.uint8)
    want[0::2] = got.flip(0)
    return want


def test_a_read_of_thousands_of_pieces_lands_every_byte(tmp_path: Path) -> None:
    """Guards against a failed read (EINVAL) of many small tensors: one syscall's bytes
    (the default SYSCALL_BYTES) may hold more pieces than the kernel's iovec limit, so a
    read must be cut at that limit too, and every byte still land in its place."""
    assert PIECES < read_module.SYSCALL_BYTES  # all within one syscall's bytes
    data, buffer = _scattered_read(tmp_path, PIECES, offset=5)
    assert torch.equal(buffer, _expected(data, PIECES, 5))


def test_no_syscall_gets_more_entries_than_the_iovec_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards against the same EINVAL on a kernel with a small iovec limit: every syscall
    of a scatter read carries at most the limit's entries, and the bytes are exact."""
    limit = 7
    monkeypatch.setattr(read_module, "_IOV_MAX", limit)
    entries: list[int] = []
    real = read_module._preadv_raw

    def counted(fd: int, iov_address: int, n: int, at: int) -> int:
        entries.append(n)
        return real(fd, iov_address, n, at)

    monkeypatch.setattr(read_module, "_preadv_raw", counted)
    pieces = 100
    data, buffer = _scattered_read(tmp_path, pieces, offset=0)
    assert torch.equal(buffer, _expected(data, pieces, 0))
    assert max(entries) <= limit
    assert sum(entries) == pieces  # no resumed syscalls: each piece read once


@pytest.mark.asyncio
async def test_thousands_of_tiny_tensors_in_one_file_load_exactly(tmp_path: Path) -> None:
    """Guards against a load of a checkpoint of many tiny tensors failing with EINVAL (or
    landing wrong bytes): thousands of them fall into one read of one syscall's bytes."""
    count = 3000
    tensors = {
        f"t.{i:05d}": torch.tensor([i % 256, (i * 31) % 256], dtype=torch.uint8)
        for i in range(count)
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    p = plan(ckpt, [Dense()])
    async with SlabSet(p) as slabs:
        await asyncio.wait_for(slabs.load(ckpt, options=LoadOptions(io_workers=1)), HANG_S)
        stats = slabs.statistics()
        assert stats.reads == 1  # one read: every tensor's piece in it
        assert assert_bit_identical(slabs, ckpt) == count


@pytest.mark.asyncio
async def test_drain_drops_queued_calls() -> None:
    """Guards against reads running after a load was cancelled or timed out: draining the
    pool waits for the call in a thread but cancels those still queued, which never run."""
    pool = IoPool(1)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocking() -> str:
        started.set()
        assert release.wait(HANG_S)
        return "first"

    def queued() -> str:
        ran.append("queued")
        return "second"

    first = asyncio.ensure_future(pool.run(blocking))
    second = asyncio.ensure_future(pool.run(queued))
    try:
        assert await asyncio.to_thread(started.wait, HANG_S)  # the one thread is busy
        drain = asyncio.ensure_future(pool.drain(HANG_S))
        await asyncio.sleep(0)  # drain has cancelled what it could and now waits
        assert not drain.done()
        release.set()
        assert await asyncio.wait_for(drain, HANG_S) is True
        assert await first == "first"
        with pytest.raises(asyncio.CancelledError):
            await second
    finally:
        release.set()
        # The thread takes queued items in order: once it has exited, the queued call's
        # turn has come and gone.
        await asyncio.wait_for(pool.close(wait=True), HANG_S)
    assert ran == []

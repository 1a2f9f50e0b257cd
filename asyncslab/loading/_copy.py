"""Loading, the copies: getting a read's bytes into their slots. Runs on I/O worker threads.

CPU target: no staging and no copy — :func:`read_direct` scatters the read straight into
the slots' memory (the gaps between tensors go to a scratch buffer), so each byte is
written once; :func:`direct_scatters` works out those destinations once per plan.

CPU target, from object storage: :class:`HostCopier` copies each piece of a response with
one ``memmove`` on the I/O thread, never with torch (see :func:`host_copy`).

CUDA target: :class:`CudaCopier` copies from a pinned staging buffer into the slots on one
of several streams, bytes as bytes (a ``uint8`` view on both sides, so no dtype conversion
can ever happen), then waits on the event recorded after the copies — on the worker
thread, never on the event loop — before the buffer may be reused. A mapped read
(see ``_strategy_mapped``) goes through the same copier, its source the registered pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from ._read import Scatter, pread_scatter, scatter
from ._schedule import ReadOp

__all__ = [
    "direct_scatters",
    "read_direct",
    "read_staged",
    "Copier",
    "CpuCopier",
    "CudaCopier",
    "HostCopier",
    "host_copy",
]


def direct_scatters(
    ops: Sequence[ReadOp], route_address: Sequence[int], scratch: int
) -> tuple[Scatter, ...]:
    """Per read in ``ops``, where its bytes go: slots of slabs (route ``r``'s slab starts
    at address ``route_address[r]``), gaps between tensors to the scratch buffer at
    ``scratch`` (as large as the largest gap)."""

    def regions(op: ReadOp) -> Iterator[tuple[int, int]]:
        position = 0
        for route, read_offset, dst_offset, nbytes in op.pieces:
            if read_offset != position:
                yield scratch, read_offset - position
            yield route_address[route] + dst_offset, nbytes
            position = read_offset + nbytes

    return tuple(scatter(regions(op)) for op in ops)


def read_direct(fd: int, op: ReadOp, target: Scatter, path: str) -> int:
    """Read ``op`` into its slots (``target``, from :func:`direct_scatters`); returns bytes
    read (slots plus discarded gaps)."""
    return pread_scatter(fd, target, op.offset, path=path)


# A staged read fills its buffer in one syscall where the kernel allows. Every syscall ends
# by retaking the GIL, and staging threads feeding a GPU queue for it behind the threads
# issuing copies, so fewer syscalls per read load a GPU faster (figures in
# docs/performance.md). Direct reads keep SYSCALL_BYTES for the event loop's sake on small
# machines (see _read); a staged read is bounded by its buffer anyway. Pinned by
# test_staged_reads_take_one_syscall_and_one_copy_call_each.
STAGED_SYSCALL_BYTES = 1 << 30


def read_staged(fd: int, op: ReadOp, buffer: torch.Tensor, path: str) -> int:
    """Read ``op`` whole into the front of a (pinned) staging buffer."""
    if op.nbytes > buffer.numel():  # the read writes through a raw pointer: never past it
        raise ValueError(f"a read of {op.nbytes} bytes into a {buffer.numel()}-byte buffer")
    target = scatter([(buffer.data_ptr(), op.nbytes)], limit=STAGED_SYSCALL_BYTES)
    return pread_scatter(fd, target, op.offset, path=path)


class Copier(Protocol):
    """Moves a staged read into its slots; returns once the buffer may be reused."""

    def copy(
        self,
        op: ReadOp,
        buffer: torch.Tensor,
        route_bytes: Sequence[torch.Tensor],
        route_base: Sequence[int],
        stream_index: int,
    ) -> None: ...


class CpuCopier:
    """Staged copies into host slabs: the CPU twin of :class:`CudaCopier`, for targets that
    must not be read into directly, and to exercise the staged path without a GPU."""

    def copy(
        self,
        op: ReadOp,
        buffer: torch.Tensor,
        route_bytes: Sequence[torch.Tensor],
        route_base: Sequence[int],
        stream_index: int,
    ) -> None:
        _copy_pieces(op, buffer, route_bytes, route_base, non_blocking=False)


class HostCopier:
    """Copies out of a response or a staging buffer into host slabs, each piece by
    :func:`host_copy` on the calling I/O thread: a load from object storage onto the CPU,
    whose I/O threads (``request_concurrency``, 16 by default, not capped at the cores)
    copy side by side."""

    def copy(
        self,
        op: ReadOp,
        buffer: torch.Tensor,
        route_bytes: Sequence[torch.Tensor],
        route_base: Sequence[int],
        stream_index: int,
    ) -> None:
        source, available = buffer.data_ptr(), buffer.numel()
        for route, read_offset, dst_offset, nbytes in op.pieces:
            target = route_bytes[route]
            start = route_base[route] + dst_offset
            # Raw pointers from here on: a piece outside either tensor is refused, not written.
            if read_offset + nbytes > available or start + nbytes > target.numel():
                raise ValueError(
                    f"a piece of {nbytes} bytes from offset {read_offset} of a {available}-byte "
                    f"buffer into offset {start} of a {target.numel()}-byte slab"
                )
            host_copy(target.data_ptr() + start, source + read_offset, nbytes)


class CudaCopier:
    """Host-to-device copies on ``streams`` CUDA streams, one event per staging buffer use."""

    def __init__(self, device: torch.device, streams: int) -> None:
        self.device = device
        self.streams = [
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            for _ in range(max(1, streams))
        ]
        # torch's pool streams do not wait for the current (default) stream, and the
        # allocator tracks a block only on the stream that allocated it: without this, a
        # copy into the slabs could land before kernels already queued on that stream (a
        # model swap freeing a block, inference still reading the slabs before a reload)
        # are done with that memory (test_cuda_copies_wait_for_work_queued_on_the_current_stream).
        current = torch.cuda.current_stream(device)
        for stream in self.streams:
            stream.wait_stream(current)

    def copy(
        self,
        op: ReadOp,
        buffer: torch.Tensor,
        route_bytes: Sequence[torch.Tensor],
        route_base: Sequence[int],
        stream_index: int,
    ) -> None:
        """Enqueue the copies of ``op`` out of ``buffer`` and wait until they completed.

        Blocking here is deliberate: this runs on an I/O worker thread, and returning means
        the buffer is free to be overwritten by the next read.
        """
        stream = self.streams[stream_index % len(self.streams)]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            try:
                _copy_pieces(op, buffer, route_bytes, route_base, non_blocking=True)
                # In the try: if recording failed, the copies enqueued must still finish
                # before the caller reuses the buffer.
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            except BaseException:
                # Copies enqueued before the failing one may still read the buffer (or the
                # registered pages of a mapped read), which the caller reuses or releases
                # once this returns: let them finish first, if the device still can.
                try:
                    stream.synchronize()
                except Exception:  # noqa: BLE001, S110 - the first error is the one to report
                    pass
                raise
        event.synchronize()


def _copy_pieces(
    op: ReadOp,
    buffer: torch.Tensor,
    route_bytes: Sequence[torch.Tensor],
    route_base: Sequence[int],
    *,
    non_blocking: bool,
) -> None:
    # uint8 on both sides: bytes are copied as bytes, no dtype conversion can happen.
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for route, read_offset, dst_offset, nbytes in op.pieces:
        start = route_base[route] + dst_offset
        dst.append(route_bytes[route][start : start + nbytes])
        src.append(buffer[read_offset : read_offset + nbytes])
    # One call for all pieces: each torch call releases and retakes the GIL, and a copy per
    # piece (a read holds dozens) would make staging threads queue for it, as per-syscall
    # retakes do (see STAGED_SYSCALL_BYTES).
    _copy_all(dst, src, non_blocking=non_blocking)


def _copy_each(dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=non_blocking)


# torch's list copy: one call, the loop over pieces in C++; private, hence the fallback.
_copy_all: Callable[..., None] = getattr(torch, "_foreach_copy_", _copy_each)


def host_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` in host memory, on this thread alone,
    the GIL released.

    Not ``Tensor.copy_``: torch splits a copy larger than its grain (32 KiB) over its
    intra-op OpenMP threads, and every I/O thread that does so gets a team of its own. With
    torch's default of a thread per core, 16 I/O threads on a 16-core server would start 15
    more each, hundreds of threads for copies the I/O threads already run side by side
    (figures in docs/performance.md; test_host_copies_start_no_thread).
    """
    _memmove(dst, src, nbytes)


# ctypes' memmove is a foreign call: the GIL is released for its duration.
_memmove = ctypes.memmove

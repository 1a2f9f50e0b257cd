"""Loading, the mapped transfer (``LoadOptions(transfer="mapped")``): copies straight out of
the page cache, with no staging copy. Runs on I/O worker threads.

A staged load copies every byte on the host (page cache -> pinned buffer) before the GPU
copies it, so it is bounded by that host copy, which can be slower than what the GPU takes
from pinned memory (as on the H200 host measured in docs/performance.md): there no staged
load can reach the GPU's bandwidth. Here each shard is mapped read-only, and each read's
pages are registered with CUDA (``cudaHostRegisterReadOnly``: pinned where they lie in the
page cache), copied from by DMA, and unregistered once the copies completed. Pinned at any
moment: one read's window per I/O thread, and no byte of it copied on the host.

CUDA refuses to register a page twice, so a mapped load's reads are ``_schedule.windows``:
no two share a page (``test_property_windows_read_every_byte_once_one_read_per_window``).
Registering faults in pages not yet cached, so a cold read happens inside the registration,
on the I/O thread, and counts against ``read_timeout`` like any read.

On a CPU target the same path copies out of the mappings (to test it without a GPU; direct
reads are the way to fill host slabs). There "registering" faults the window in with
``MADV_POPULATE_READ``, which reports a page past the end of a truncated file as an error.
A file truncated in the instant between that and the copy still ends the process with
SIGBUS, as it does any reader of a mapped file (safetensors' own loading included); on a
GPU the pages are pinned and the copy cannot fault.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .._failures import first_line
from .._os import MADV_POPULATE_READ, MAP_FAILED, PAGE, libc_madvise, libc_mmap
from ..errors import CudaError, ReadError
from ._copy import Copier
from ._options import LoadOptions
from ._pinned import StagingStatistics
from ._schedule import ReadOp, windows
from ._sink import Files, ReadOne, Reads, Sink, named_copy

__all__ = [
    "CudaRegistry",
    "Mapped",
    "Mappings",
    "PopulateRegistry",
    "Registry",
    "page_span",
    "transfer",
]


def page_span(op: ReadOp) -> tuple[int, int]:
    """``(start, length)``: the whole pages under ``op``, as file offsets."""
    start = op.offset - op.offset % PAGE
    end = -(-(op.offset + op.nbytes) // PAGE) * PAGE
    return start, end - start


class Registry(Protocol):
    """Makes a page-aligned range of a mapping ready for copies out of it, then releases
    it. ``register`` raises ``OSError`` or ``RuntimeError`` (a failed CUDA call's
    :class:`CudaError` is one) saying why it could not."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


#: ``cudaHostRegisterReadOnly`` (8): the device only reads the pages, which lets CUDA pin a
#: read-only mapping (CUDA 11.1+); ``cudaHostRegisterPortable`` (1): pinned for every CUDA
#: context, not only the current one of the I/O thread that registers them.
_CUDA_HOST_REGISTER_FLAGS = 8 | 1


class CudaRegistry:
    """``cudaHostRegister(..., ReadOnly | Portable)``: pins the range's pages where they
    are, so a copy from it is a DMA with no host copy. torch's binding releases the GIL for
    the call."""

    def __init__(self, device: torch.device) -> None:
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._device = device

    def register(self, address: int, nbytes: int) -> None:
        with torch.cuda.device(self._device):  # the target's context, not device 0's
            result = self._cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS)
        self._check(result, "cudaHostRegister(read-only)")

    def unregister(self, address: int) -> None:
        with torch.cuda.device(self._device):
            result = self._cudart.cudaHostUnregister(address)
        self._check(result, "cudaHostUnregister")

    def _check(self, result: object, call: str) -> None:
        # A failed call is also kept as the calling thread's last CUDA error: an I/O
        # thread's, which ends with the load, so no later launch of the server reports it.
        code = int(result)  # type: ignore[call-overload]
        if code == 0:
            return
        try:
            text = str(self._cudart.cudaGetErrorString(result))
        except Exception:  # noqa: BLE001 - the code alone still says it
            text = "unknown error"
        raise CudaError(f"{call} failed: {text} (CUDA error {code})", call=call, code=code)


class PopulateRegistry:
    """The CPU twin: faults the range in (``MADV_POPULATE_READ``), so that a file truncated
    since planning is an error here rather than SIGBUS in the copy. Where the kernel lacks
    it, nothing (the copy faults the pages in)."""

    def __init__(self) -> None:
        self._madvise = libc_madvise()

    def register(self, address: int, nbytes: int) -> None:
        madvise = self._madvise
        if madvise is None or madvise(address, nbytes, MADV_POPULATE_READ) == 0:
            return
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS):  # an older kernel: let the copy fault
            self._madvise = None
            return
        if code == errno.EFAULT:
            raise OSError(code, "pages past the end of the file (truncated after planning?)")
        raise OSError(code, os.strerror(code))

    def unregister(self, address: int) -> None:
        pass


class Mappings:
    """Shards mapped whole, read-only and shared, for the life of one load; ``source(f)``
    is file ``f`` as a ``uint8`` tensor over its mapping (never written: the pages are
    read-only, a write would fault)."""

    def __init__(self, fds: Sequence[int], sizes: Sequence[int], paths: Sequence[str]) -> None:
        mapper = libc_mmap()
        self._maps: list[tuple[int, int]] = []
        self._sources: list[torch.Tensor | None] = []
        self._kept: set[int] = set()
        try:
            for fd, size, path in zip(fds, sizes, paths, strict=True):
                if size == 0:  # nothing to read, and mmap refuses a zero length
                    self._maps.append((0, 0))
                    self._sources.append(None)
                    continue
                address = mapper.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address is None or address == MAP_FAILED:
                    code = ctypes.get_errno()
                    raise OSError(code, f"cannot map {path}: {os.strerror(code)}")
                self._maps.append((address, size))
                array = (ctypes.c_ubyte * size).from_address(address)
                self._sources.append(torch.frombuffer(array, dtype=torch.uint8))
        except BaseException:
            self.close()
            raise

    def address(self, file: int) -> int:
        return self._maps[file][0]

    def source(self, file: int) -> torch.Tensor:
        source = self._sources[file]
        assert source is not None, "no reads from an empty file"
        return source

    def keep(self, file: int) -> None:
        """Never unmap file ``file``: a range of it stayed registered (its unregistration
        failed). Unmapped, its addresses could go to a later mapping, which CUDA would then
        refuse to register ("already registered") or, worse, take for the old pages
        (``test_a_range_left_registered_keeps_its_shard_mapped``)."""
        self._kept.add(file)

    def close(self) -> None:
        """Unmap every shard. Only once nothing copies from them any more: the tensors
        over the mappings would point at nothing."""
        maps, self._maps = self._maps, []
        self._sources = []
        for file, (address, size) in enumerate(maps):
            if size and file not in self._kept:
                libc_mmap().munmap(address, size)


def transfer(
    op: ReadOp,
    mappings: Mappings,
    registry: Registry,
    copy: Callable[[ReadOp, torch.Tensor], None],
    path: str,
) -> int:
    """Register the pages under ``op``, copy its pieces out of them (``copy`` returns once
    the copies completed), release the pages; returns the bytes the read spans. A failing
    registration is a :class:`ReadError` naming ``path`` and the range."""
    start, length = page_span(op)
    address = mappings.address(op.file) + start
    _registering(registry.register, (address, length), "register", start, length, path)
    try:
        copy(op, mappings.source(op.file)[op.offset : op.offset + op.nbytes])
    except BaseException:
        try:
            registry.unregister(address)
        except (OSError, RuntimeError):  # the copy's error is the one to report
            mappings.keep(op.file)
        raise
    try:
        _registering(registry.unregister, (address,), "unregister", start, length, path)
    except ReadError:
        mappings.keep(op.file)
        raise
    return op.nbytes


def _registering(
    call: Callable[..., None], args: tuple[int, ...], what: str, start: int, length: int, path: str
) -> None:
    try:
        call(*args)
    except (OSError, RuntimeError) as err:
        raise ReadError(
            f"cannot {what} the {length} bytes at offset {start} for copies: {first_line(err)}",
            file=path,
            offset=start,
        ) from err


class Mapped:
    """The mapped transfer (``LoadOptions(transfer="mapped")``): copies out of the mapped
    shards, each read's pages registered for the time of its copies. Reads are page
    windows of ``staging_bytes // staging_buffers`` (at least a page), on
    ``staging_buffers`` threads; no buffer is made."""

    name = "mapped"
    staging_budget = 0

    def __init__(self, options: LoadOptions, device: torch.device, copier: Copier) -> None:
        self.read_size = options.staging_bytes // options.staging_buffers
        self.workers = options.staging_buffers
        self._cuda = device if device.type == "cuda" else None
        self._copier = copier
        self._mappings: Mappings | None = None

    def plan(self, sink: Sink, gap: int) -> Reads:
        return Reads(windows(sink.plan, window=max(PAGE, self.read_size - self.read_size % PAGE)))

    def open(self, reads: Reads, files: Files, sink: Sink) -> ReadOne:
        paths = files.paths
        try:
            mappings = self._mappings = Mappings(
                [files.fds[i] for i in range(len(paths))], files.sizes, paths
            )
        except OSError as err:
            raise ReadError(f"cannot map the shards: {err.strerror or err}") from err
        registry: Registry = (
            CudaRegistry(self._cuda) if self._cuda is not None else PopulateRegistry()
        )
        ops = reads.schedule.ops
        copy = named_copy(self._copier.copy, sink, paths)

        def read_one(worker: int, index: int) -> int:
            op = ops[index]
            return transfer(
                op, mappings, registry, lambda o, src: copy(o, src, worker), paths[op.file]
            )

        return read_one

    def staging(self) -> StagingStatistics | None:
        return None

    def close(self) -> None:
        if self._mappings is not None:
            self._mappings.close()

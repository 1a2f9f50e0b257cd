"""An engine's parameter memory faulted in on a thread of its own while its loader is
recorded and the checkpoint read.

Memory a process has never touched costs a page fault per 4 KiB page at its first write,
and on a first load that is most of the time: the reads stop for each fault. Recording
the engine's loader takes one core and leaves the other idle. ``MADV_POPULATE_WRITE``
(Linux 5.14) faults a range in without changing a byte, so a thread can fault the
parameters in meanwhile, and go on beside the reads: it walks the parameters from the last
to the first while the reads go roughly from the first on (a checkpoint lists its tensors
in the model's order, as the engine lists its parameters), so the two meet in the middle
rather than fault the same pages. A kernel without the call refuses it and the reads fault
as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from .._os import MADV_POPULATE_WRITE, PAGE, libc_madvise

__all__ = ["Prefault"]

#: Bytes per call: small enough that a stop is seen soon, large beside a call's cost.
_STEP = 32 << 20


class Prefault:
    """Faults in the storages under ``tensors`` (CPU ones, each once), on a thread started
    on entering, until done or :meth:`stop`. Leaving the ``with`` block stops and joins the
    thread, whatever ended the block."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: dict[int, int] = {}
        for tensor in tensors:
            if tensor.device.type != "cpu" or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes():
                spans.setdefault(storage.data_ptr(), storage.nbytes())
        page = PAGE
        # Whole pages inside each storage only: a page it shares with other memory may lie
        # in a mapping this call must not touch.
        self._spans = [
            (start, end)
            for ptr, nbytes in reversed(spans.items())
            if (end := (ptr + nbytes) // page * page) > (start := -(-ptr // page) * page)
        ]
        self._stopped = threading.Event()
        #: Set once the thread has ended (done, stopped, or refused by the kernel).
        self.finished = threading.Event()
        #: Bytes faulted in so far.
        self.populated = 0
        self._madvise = libc_madvise()
        self._thread = threading.Thread(target=self._run, name="asyncslab-prefault", daemon=True)

    def __enter__(self) -> Prefault:
        if self._madvise is not None and self._spans:
            self._thread.start()
        else:
            self.finished.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop faulting (within one step of 32 MiB) and wait for the thread to end."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            self._populate()
        finally:
            self.finished.set()

    def _populate(self) -> None:
        madvise = self._madvise
        assert madvise is not None
        for start, end in self._spans:
            at = end
            while at > start:
                if self._stopped.is_set():
                    return
                step = min(_STEP, at - start)
                if madvise(at - step, step, MADV_POPULATE_WRITE) != 0:
                    # Refused: a kernel without the call (EINVAL, as for any advice it does
                    # not know) or memory it cannot fault so (a read-only mapping: EINVAL
                    # too). The reads fault this storage as before; on to the next.
                    break
                self.populated += step
                at -= step

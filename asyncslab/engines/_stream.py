"""A checkpoint's tensors as an iterator, read by asyncslab a window at a time.

For consumers that take ``(name, tensor)`` pairs and copy each where it belongs (vLLM's
in-place ``reload_weights``): tensors are read in file order into host slabs of their own,
``window_bytes`` at a time, on a thread that runs its own event loop, the next window read
while the consumer takes the current one. At most two windows are held by the iterator
(``tests/engines/test_stream.py`` pins it); a tensor the consumer keeps keeps its window's memory,
as any tensor keeps its storage.

A window's memory is read into again for a later window once the consumer holds nothing of
it: memory a process has never touched costs a page fault per page, which on a VM is most
of what reading a window into fresh memory costs.

With ``place`` (a reload: :class:`~asyncslab.engines._placement.Placer`), a tensor it
gives a destination for is read straight into that destination and handed over as a view
of it; the window holds only the rest.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

import torch

from ..checkpoint._format import Checkpoint, TensorInfo
from ..errors import LoadError
from ..loading._options import LoadOptions
from ..loading._slabs import SlabSet
from ..planning._plan import Plan, plan
from ..planning._rules import Dense

__all__ = ["DEFAULT_WINDOW", "runner", "stream_tensors", "windows"]

T = TypeVar("T")

#: Bytes read ahead of the consumer: large enough to keep the I/O threads busy, small
#: beside a checkpoint (and the memory the stream holds: two windows).
DEFAULT_WINDOW = 256 << 20


def runner() -> Callable[[Coroutine[Any, Any, T]], T]:
    """``asyncio.run``, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run

    def run(work: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(work)

    return run


def windows(infos: Sequence[TensorInfo], window_bytes: int) -> list[list[TensorInfo]]:
    """``infos`` in order, cut into runs of at most ``window_bytes`` (a larger tensor is a
    run of its own)."""
    out: list[list[TensorInfo]] = []
    used = window_bytes
    for info in infos:
        if used + info.nbytes > window_bytes or not out:
            out.append([])
            used = 0
        out[-1].append(info)
        used += info.nbytes
    return out


def stream_tensors(
    checkpoint: Checkpoint,
    names: Sequence[str] | None = None,
    *,
    window_bytes: int = DEFAULT_WINDOW,
    options: LoadOptions | None = None,
    place: Place | None = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Every tensor of ``checkpoint`` (or those ``names``), in file order, as it is stored:
    its own dtype and shape, in host memory. A failed read raises from the iterator, naming
    what failed; closing the iterator early stops the reads and waits for them to end.
    ``place(name)`` may give a tensor of that dtype and shape to read it into instead (asked
    on the reading thread, a window ahead of the consumer)."""
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes <= 0:
        raise ValueError(f"window_bytes must be a positive int, got {window_bytes!r}")
    wanted = checkpoint.tensors if names is None else {n: _info(checkpoint, n) for n in names}
    order = {f.path: i for i, f in enumerate(checkpoint.files)}
    infos = sorted(wanted.values(), key=lambda t: (order[t.file], t.offset))
    runs = windows(infos, window_bytes)
    return _Stream(checkpoint, runs, options or LoadOptions(), window_bytes, place).run()


def _info(checkpoint: Checkpoint, name: str) -> TensorInfo:
    try:
        return checkpoint.tensors[name]
    except KeyError:
        raise LoadError(f"no tensor {name!r} in {checkpoint.root}", tensor=name) from None


#: A destination of a tensor's own dtype and shape for it, or None (read into a window).
Place = Callable[[str], "torch.Tensor | None"]

# What the producer hands over: a loaded window (its tensors' names, its slabs, the memory
# they lie in), the error that ended it, or its end.
_Item = tuple[list[str], SlabSet, torch.Tensor] | BaseException | None


class _Stream:
    """The producer (a thread with its own loop, loading windows) and the consumer (the
    generator) of one iteration. The producer starts a window's load only with one of
    ``depth`` tokens; the consumer gives a token back, with the window's memory, one tensor
    into the next window (so ``depth`` must be at least 2: the next window is read with
    the other token)."""

    depth = 2

    def __init__(
        self,
        checkpoint: Checkpoint,
        runs: list[list[TensorInfo]],
        options: LoadOptions,
        window_bytes: int,
        place: Place | None = None,
    ) -> None:
        self._checkpoint = checkpoint
        self._place = place
        self._runs = runs
        self._options = options
        self._window_bytes = window_bytes
        self._items: queue.Queue[_Item] = queue.Queue()
        # Window memory the consumer has moved past (put by the consumer before it gives
        # the token back), and the producer's own list of it, to read later windows into.
        self._returned: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._free: list[torch.Tensor] = []
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._tokens: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self._produce, name="asyncslab-stream", daemon=True)

    def run(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        if not self._runs:
            return
        self._thread.start()
        self._started.wait()
        done: torch.Tensor | None = None
        try:
            for _ in self._runs:
                item = self._items.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:  # cannot happen before the last window: the producer ends
                    break
                names, slabs, memory = item
                del item
                for name in names:
                    yield name, slabs.view(name)
                    if done is not None:
                        # The last window's memory goes back one tensor into this one: until
                        # the consumer asked for a second tensor here, its loop variable
                        # still held the last window's last tensor.
                        self._returned.put(done)
                        done = None
                        self._give_back()
                del slabs  # the window goes once the consumer lets go of its tensors
                done = memory
                del memory
        finally:
            self._stop()

    def _give_back(self) -> None:
        assert self._loop is not None
        assert self._tokens is not None
        try:
            self._loop.call_soon_threadsafe(self._tokens.release)
        except RuntimeError:  # the producer's loop has closed: it is done
            pass

    def _memory(self, window: Plan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Memory for ``window``'s slabs, and the slabs: a destination ``place`` gives, else
        a view of memory a window before this one lay in, if the consumer holds nothing of
        it any more, else of new memory."""
        placed: dict[str, torch.Tensor] = {}
        if self._place is not None:
            for name in window.slabs:
                destination = self._place(name)
                if destination is not None:
                    placed[name] = destination
        offsets, need = _layout(
            [(name, spec.nbytes) for name, spec in window.slabs.items() if name not in placed]
        )
        while not self._returned.empty():
            self._free.append(self._returned.get())
        memory = None
        for i, candidate in enumerate(self._free):
            if candidate.numel() >= need and _only_here(candidate):
                memory = self._free.pop(i)
                break
        # What the consumer still holds is its own now; the rest waits for a later window.
        self._free = [m for m in self._free if _only_here(m)][-self.depth :]
        if memory is None:
            # A window with everything placed needs none: none is made, nor kept.
            size = max(need, self._window_bytes) if need else 0
            memory = torch.empty(size, dtype=torch.uint8)
        slabs = {
            name: memory[offsets[name] : offsets[name] + spec.nbytes]
            .view(spec.dtype)
            .view(spec.shape)
            for name, spec in window.slabs.items()
            if name not in placed
        }
        slabs.update(placed)
        return memory, slabs

    def _stop(self) -> None:
        if self._loop is not None and self._task is not None:
            try:
                self._loop.call_soon_threadsafe(self._task.cancel)
            except RuntimeError:
                pass
        self._thread.join()
        # Windows loaded ahead and never taken are dropped here (dropping frees them).
        while not self._items.empty():
            self._items.get_nowait()

    def _produce(self) -> None:
        try:
            runner()(self._windows())
        except BaseException as err:  # handed to the consumer
            self._items.put(err)
        finally:
            self._started.set()  # also where the loop never started

    async def _windows(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._tokens = tokens = asyncio.Semaphore(self.depth)
        self._started.set()
        checkpoint = self._checkpoint
        try:
            for run in self._runs:
                await tokens.acquire()
                part = Checkpoint(
                    checkpoint.root,
                    checkpoint.files,
                    {t.name: t for t in run},
                    checkpoint.index,
                )
                window = plan(part, [Dense()])
                memory, given = self._memory(window)
                slabs = SlabSet(window, "cpu", tensors=given)
                del given
                try:
                    await slabs.load(part, options=self._options)
                except BaseException:
                    await slabs.aclose()
                    raise
                self._items.put(([t.name for t in run], slabs, memory))
                del slabs, memory
            self._items.put(None)
        except asyncio.CancelledError:
            pass  # the consumer stopped: nobody waits for an item


def _layout(sizes: Sequence[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Each slab's offset in one window's memory, 64-byte aligned as
    :func:`~asyncslab.loading._slabs.slab_layout` lays slabs out, and the bytes needed."""
    offsets: dict[str, int] = {}
    total = 0
    for name, nbytes in sizes:
        total = -(-total // 64) * 64
        offsets[name] = total
        total += nbytes
    return offsets, total


def _only_here(memory: torch.Tensor) -> bool:
    """Whether ``memory`` is the only tensor on its storage: nobody else can read it, so a
    later window may be read into it."""
    # torch counts a storage's users only privately (its CUDA-graph trees ask the same
    # question this way). The count includes the storage object made for asking.
    return torch._C._storage_Use_Count(memory.untyped_storage()._cdata) == 2

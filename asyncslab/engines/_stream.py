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

A tensor of a local file that is not placed is handed over as a view of a private mapping
of its file, as vLLM's own safetensors reader hands it: the consumer transforms it (a cast
into another dtype) straight from the page cache, one copy, where reading it into a window
first would be two, and the second into memory as fresh as the first. The file is opened
with the load's checks (one changed since planning is refused), and each tensor's bytes
are faulted into the mapping just before it is handed over (``MADV_POPULATE_READ``: a
file truncated since is then a ``ReadError``, not a SIGBUS in the consumer), on the
consumer's thread: a window ahead on the reading thread would only compete for the cores
the consumer's transforms already use, and would hold a window's pages more. A file's
mapping goes once the reader has moved past it and the consumer holds none of its
tensors. Objects in a store always go through windows.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import torch

from .._os import PAGE, run
from ..checkpoint import Checkpoint, TensorInfo
from ..errors import LoadError, ReadError
from ..loading import LoadOptions, PopulateRegistry, SlabSet, map_checked
from ..planning import Dense, Plan, plan

__all__ = ["DEFAULT_WINDOW", "stream_tensors", "windows"]

#: Bytes read ahead of the consumer: large enough to keep the I/O threads busy, small
#: beside a checkpoint (and the memory the stream holds: two windows).
DEFAULT_WINDOW = 256 << 20


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
    mapped: bool = True,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Every tensor of ``checkpoint`` (or those ``names``), in file order, as it is stored:
    its own dtype and shape, in host memory. A failed read raises from the iterator, naming
    what failed; closing the iterator early stops the reads and waits for them to end.
    ``place(name)`` may give a tensor of that dtype and shape to read it into instead (asked
    on the reading thread, a window ahead of the consumer). ``mapped``: a local file's
    tensors that are not placed are views of a private mapping of the file (writing into
    one changes neither the file nor a later view); False reads them into windows too."""
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes <= 0:
        raise ValueError(f"window_bytes must be a positive int, got {window_bytes!r}")
    wanted = checkpoint.tensors if names is None else {n: _info(checkpoint, n) for n in names}
    order = {f.path: i for i, f in enumerate(checkpoint.files)}
    infos = sorted(wanted.values(), key=lambda t: (order[t.file], t.offset))
    runs = windows(infos, window_bytes)
    stream = _Stream(checkpoint, runs, options or LoadOptions(), window_bytes, place, mapped)
    return stream.run()


def _info(checkpoint: Checkpoint, name: str) -> TensorInfo:
    try:
        return checkpoint.tensors[name]
    except KeyError:
        raise LoadError(f"no tensor {name!r} in {checkpoint.root}", tensor=name) from None


#: A destination of a tensor's own dtype and shape for it, or None (read into a window).
Place = Callable[[str], "torch.Tensor | None"]

# A tensor of a mapped file: its view, the whole file's mapping, where it lies in it.
_Mapped = tuple[torch.Tensor, torch.Tensor, TensorInfo]

# What the producer hands over: a loaded window (its tensors' names, its slabs or None where
# it read nothing, the memory they lie in, its tensors of mapped files), the error that
# ended it, or its end.
_Item = tuple[list[str], SlabSet | None, torch.Tensor, dict[str, _Mapped]] | BaseException | None


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
        mapped: bool = True,
    ) -> None:
        self._checkpoint = checkpoint
        self._place = place
        self._shards = {f.path: f for f in checkpoint.files}
        # Each local file's private mapping, opened at its first tensor (producer only).
        # None: nothing mapped (a load's files are all local or all objects).
        local = all(f.source is None for f in checkpoint.files)
        self._maps: dict[Path, torch.Tensor] | None = {} if mapped and local else None
        self._populate = PopulateRegistry()
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
                names, slabs, memory, mapped = item
                del item
                for name in names:
                    if name in mapped:
                        view, whole, info = mapped.pop(name)
                        self._populated(whole, info)
                        del whole
                    else:
                        assert slabs is not None
                        view = slabs.view(name)
                    yield name, view
                    del view
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

    def _memory(
        self, window: Plan, placed: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Memory for ``window``'s slabs, and the slabs: the destination ``placed`` gives,
        else a view of memory a window before this one lay in, if the consumer holds nothing
        of it any more, else of new memory."""
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
            run(self._windows())
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
                placed: dict[str, torch.Tensor] = {}
                if self._place is not None:
                    for info in run:
                        destination = self._place(info.name)
                        if destination is not None:
                            placed[info.name] = destination
                mapped = self._views([t for t in run if t.name not in placed])
                reads = [t for t in run if t.name not in mapped]
                slabs: SlabSet | None = None
                memory = torch.empty(0, dtype=torch.uint8)
                if reads:
                    part = Checkpoint(
                        checkpoint.root,
                        checkpoint.files,
                        {t.name: t for t in reads},
                        checkpoint.index,
                    )
                    window = plan(part, [Dense()])
                    memory, given = self._memory(window, placed)
                    slabs = SlabSet(window, "cpu", tensors=given)
                    del given
                    try:
                        await slabs.load(part, options=self._options)
                    except BaseException:
                        await slabs.aclose()
                        raise
                del placed
                self._items.put(([t.name for t in run], slabs, memory, mapped))
                del slabs, memory, mapped
            self._items.put(None)
        except asyncio.CancelledError:
            pass  # the consumer stopped: nobody waits for an item

    def _views(self, infos: Sequence[TensorInfo]) -> dict[str, _Mapped]:
        """``infos`` as views of their files' mappings (none where nothing is mapped)."""
        if self._maps is None:
            return {}
        mapped: dict[str, _Mapped] = {}
        for info in infos:
            whole = self._map(info.file)
            mapped[info.name] = (_view(whole, info), whole, info)
        return mapped

    def _populated(self, whole: torch.Tensor, info: TensorInfo) -> None:
        """Fault ``info``'s bytes into ``whole``, its file's mapping."""
        path, start, end = info.file, info.offset, info.offset + info.nbytes
        start -= start % PAGE
        if end <= start:
            return
        try:
            self._populate.register(whole.data_ptr() + start, end - start)
        except OSError as err:
            raise ReadError(
                f"cannot read the {end - start} bytes at offset {start}: {err.strerror or err}",
                file=path,
                offset=start,
            ) from err

    def _map(self, path: Path) -> torch.Tensor:
        assert self._maps is not None
        found = self._maps.get(path)
        if found is None:
            # Files are read in order: an earlier one's mapping now lives only in the
            # consumer's tensors of it, and goes with them.
            self._maps.clear()
            shard = self._shards[path]
            found = self._maps[path] = map_checked(
                path, shard.size, shard.inode, shard.mtime_ns, shards=len(self._shards)
            )
        return found


def _view(whole: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """``info``'s tensor in ``whole``, its file's bytes: a view, or a copy where its offset
    is not a multiple of its element size (a file the safetensors library did not write),
    which no view can be."""
    raw = whole[info.offset : info.offset + info.nbytes]
    if info.offset % info.dtype.itemsize:
        raw = raw.clone()
    return raw.view(info.dtype).view(info.shape)


def _layout(sizes: Sequence[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Each slab's offset in one window's memory, 64-byte aligned as
    :func:`~asyncslab.loading._memory.slab_layout` lays slabs out, and the bytes needed."""
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

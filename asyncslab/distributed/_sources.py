"""Where a rank's shared reads come from: its shards' files (positional reads) or objects
in a bucket (ranged GETs).

``share_reads=True`` has each rank read the chunks it owns (``_chunks.ChunkReader``) through
a :class:`SegmentSource`, opened before the pre-flight so that a failure to open travels in
it. A local checkpoint's source holds the shards' file descriptors; an object checkpoint's
(``s3://``, ``gs://``, ``az://``) holds the clients of its buckets and fetches each chunk's
segments by the GETs the single-process loader makes (``_objects.ObjectReads``): pinned to
the ETag recorded at open, retried after a transient failure within ``read_timeout``, cut at
``request_size``, ``request_concurrency`` in flight; presigned where the store signs, each
body read straight into the chunk's buffer, else through obstore.
Either way a rank requests only the byte ranges of the chunks it owns.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._objects import ObjectLocation, ObjectReads, Retries
from ..checkpoint import Checkpoint, ShardFile
from ..errors import LoadError
from ..loading import (
    LoadOptions,
    host_copy,
    open_checked,
    pread_scatter,
    reads_objects,
    response_tensor,
    scatter,
)
from ..planning import Plan
from ._chunks import Done, Segment, SegmentSource

__all__ = [
    "FileSegments",
    "ObjectSegments",
    "open_source",
    "version_problems",
    "versions",
]


def open_source(plan: Plan, options: LoadOptions) -> SegmentSource:
    """The source of ``plan``'s shards: objects when they are (a plan mixing files and
    objects is refused), else its files, opened and checked unchanged since planning."""
    if reads_objects(plan):
        return ObjectSegments(plan.files, options)
    fds: dict[int, int] = {}
    try:
        for i, shard in enumerate(plan.files):
            fds[i] = open_checked(
                shard.path, shard.size, shard.inode, shard.mtime_ns, shards=len(plan.files)
            )
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return FileSegments(fds, [str(f.path) for f in plan.files])


def versions(checkpoint: Checkpoint) -> dict[str, str]:
    """The ETag each object of ``checkpoint`` had when this rank opened it, by URI (none for
    local files: each rank's own files are checked by its own open)."""
    return {
        f.source.uri: f.source.etag
        for f in checkpoint.files
        if f.source is not None and f.source.etag is not None
    }


def version_problems(hellos: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Ranks that opened another version of an object than rank 0 did (one replaced between
    their opens, its layout unchanged): each rank would read the version it opened, every
    GET pinned to it, and the group would load two versions. Compared where both ranks
    opened the same URI; by rank."""
    first = hellos[0]["versions"]
    problems: dict[int, str] = {}
    for hello in hellos[1:]:
        for uri, etag in hello["versions"].items():
            theirs = first.get(uri)
            if theirs is not None and theirs != etag:
                problems[hello["rank"]] = (
                    f"opened another version of {uri} than rank 0 (ETag {etag}; rank 0: "
                    f"{theirs}): it was replaced between their opens; open it again on every "
                    "rank"
                )
                break
    return problems


class FileSegments:
    """A local checkpoint's shards, open: one positional read per segment."""

    def __init__(self, fds: dict[int, int], paths: Sequence[str]) -> None:
        self._fds = fds
        self._paths = paths

    def read(self, segments: Sequence[Segment], address: int, done: Done) -> None:
        for seg in segments:
            pread_scatter(
                self._fds[seg.file],
                scatter([(address + seg.at, seg.nbytes)]),
                seg.offset,
                path=self._paths[seg.file],
            )
            done(seg.nbytes)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class ObjectSegments:
    """An object checkpoint's shards: a chunk's segments cut into GETs of at most
    ``request_size`` bytes, fetched ``request_concurrency`` at a time, each body read into
    its place in the chunk's buffer (presigned), or its response copied there once."""

    def __init__(self, shards: Sequence[ShardFile], options: LoadOptions) -> None:
        retries = Retries.within(options.request_retries, options.read_timeout)
        # Made now, so that a client that cannot be configured fails this rank's set-up.
        self._objects = ObjectReads(
            [_location(shard) for shard in shards],
            retries,
            options.request_concurrency,  # a connection per GET thread
            options.presigned_gets,
        )
        self._size = options.request_size
        self._gets = _Workers(options.request_concurrency)

    def read(self, segments: Sequence[Segment], address: int, done: Done) -> None:
        pieces = [
            (seg.file, seg.offset + at, min(self._size, seg.nbytes - at), address + seg.at + at)
            for seg in segments
            for at in range(0, seg.nbytes, self._size)
        ]
        futures = [self._gets.submit(self._get, *piece) for piece in pieces]
        # Every GET ends before this returns, also after a failure: one still running would
        # write into a buffer the protocol reuses.
        concurrent.futures.wait(futures)
        for future, piece in zip(futures, pieces, strict=True):
            future.result()  # the first failure, in request order
            done(piece[2])

    def _get(self, worker: int, file: int, offset: int, nbytes: int, address: int) -> None:
        if self._objects.signs(file):
            self._objects.fetch_into(worker, file, offset, ((address, nbytes),))
            return
        data = self._objects.fetch(file, offset, nbytes)
        host_copy(address, response_tensor(data, nbytes).data_ptr(), nbytes)  # ``data`` lives

    def close(self) -> None:
        self._gets.close()
        self._objects.close()  # the threads are gone: no GET is using a connection


def _location(shard: ShardFile) -> ObjectLocation:
    if shard.source is None:
        raise LoadError("not an object", file=shard.path)
    return shard.source


class _Workers:
    """``n`` daemon threads running submitted calls, each given its thread's index first (a
    GET's connection is its thread's): a GET that never returns (no ``read_timeout``) must
    not keep the process from exiting, as a ``ThreadPoolExecutor``'s threads would."""

    def __init__(self, n: int) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._n = n
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if len(self._threads) < self._n:  # started as the work asks for them
                index = len(self._threads)
                thread = threading.Thread(
                    target=self._work,
                    args=(index,),
                    name=f"asyncslab-dist-get_{index}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        self._jobs.put((future, fn, args))
        return future

    def _work(self, index: int) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(index, *args))
            except BaseException as err:
                future.set_exception(err)

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()

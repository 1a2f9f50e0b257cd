"""The checkpoint stage: a whole checkpoint's headers, validated, payload untouched.

:class:`Checkpoint` opens a local file, an index or a directory, or an object-store URI
(``s3://bucket/prefix``: see ``_object_store``); the header rules (``_header``) and the index
rules (``_index``) are the same for both, and only the source of the bytes differs.
"""

from __future__ import annotations

import array
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from .._heap import gc_paused
from ..errors import (
    CheckpointError,
    DuplicateTensorError,
    HeaderBoundsError,
    MissingFileError,
)
from ._header import (
    INDEX_NAME,
    INDEX_SUFFIX,
    MAX_HEADER_BYTES,
    ShardFile,
    ShardTensors,
    TensorInfo,
    TensorTable,
    kind_of,
    parse_header,
    shard_columns,
)
from ._header_parse import DTYPES, Kind, safetensors_dtype
from ._index import Index, check_index_matches, check_inside, files_of_index, find_index, read_index
from ._source import SCHEMES

__all__ = [
    "Checkpoint",
    "DTYPES",
    "INDEX_NAME",
    "INDEX_SUFFIX",
    "MAX_HEADER_BYTES",
    "ShardFile",
    "TensorInfo",
    "TensorTable",
    "parse_header",
    "read_header",
    "safetensors_dtype",
]


def read_header(path: str | os.PathLike[str]) -> tuple[ShardFile, list[TensorInfo]]:
    """Read and validate one file's header; the payload is never read."""
    shard, tensors = _read_header(path if isinstance(path, Path) else Path(path))
    return shard, tensors.infos(shard.path, shard.tensors)


def _read_header(path: Path) -> tuple[ShardFile, ShardTensors]:
    fd = _open_regular(path)
    try:
        st = os.fstat(fd)
        source = _LocalFile(fd, path, st.st_size)
        return shard_columns(source, inode=st.st_ino, mtime_ns=st.st_mtime_ns)
    finally:
        os.close(fd)


class _LocalFile:
    """A local file's bytes, for :func:`~._header.shard_of` (a :class:`~._source.ByteSource`)."""

    def __init__(self, fd: int, path: Path, size: int) -> None:
        self.fd, self.path, self.size = fd, path, size

    def read(self, offset: int, nbytes: int) -> bytes:
        chunks = []
        while nbytes:
            chunk = os.pread(self.fd, nbytes, offset)
            if not chunk:
                raise HeaderBoundsError("file shrank while its header was read", file=self.path)
            chunks.append(chunk)
            nbytes -= len(chunk)
            offset += len(chunk)
        return b"".join(chunks)


def _open_regular(path: Path) -> int:
    # Check before opening: opening a FIFO named by a hostile index would block forever
    # (test_index_names_a_fifo).
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingFileError("file does not exist", file=path) from None
    except OSError as err:
        raise MissingFileError(f"cannot stat file: {err.strerror}", file=path) from err
    if not stat.S_ISREG(st.st_mode):
        raise MissingFileError("not a regular file", file=path)
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise MissingFileError(f"cannot open file: {err.strerror}", file=path) from err


class Checkpoint:
    """The headers of a whole checkpoint: one file, or a directory of shard files.

    Opening reads every header and no payload. ``tensors`` maps each name to its
    :class:`TensorInfo`, in file order, then payload order.
    """

    __slots__ = ("root", "files", "tensors", "index", "_table")

    root: Path
    files: tuple[ShardFile, ...]
    tensors: Mapping[str, TensorInfo]
    index: Path | None

    def __init__(
        self,
        root: Path,
        files: tuple[ShardFile, ...],
        tensors: Mapping[str, TensorInfo],
        index: Path | None,
    ) -> None:
        self.root = root
        self.files = files
        self.tensors = tensors
        self.index = index
        self._table: TensorTable | None = tensors if isinstance(tensors, TensorTable) else None

    @property
    def table(self) -> TensorTable:
        """The tensors as columns (see :class:`TensorTable`); what the planner reads."""
        if self._table is None:
            self._table = TensorTable.of_mapping(self.tensors)
        return self._table

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, str | bool | int | float] | None = None,
    ) -> Checkpoint:
        """Accepts a ``.safetensors`` file, an index (``*.safetensors.index.json``), a
        directory with ``model.safetensors.index.json`` (or with one other index, as
        ``diffusion_pytorch_model.safetensors.index.json``), or a directory of
        ``*.safetensors`` files.

        Or the same in object storage, as a URI: ``s3://bucket/prefix`` (a prefix, an index
        or one object; also ``gs://`` and ``az://``), read with ranged GETs of the headers
        alone; credentials and endpoint come from the environment (``AWS_ENDPOINT_URL``,
        ``AWS_ACCESS_KEY_ID``, ...), ``storage_options`` overriding it (docs/object-storage.md)."""
        if isinstance(path, str) and path.partition("://")[0] in SCHEMES and "://" in path:
            from ._object_store import open_objects  # the client library only when used

            with gc_paused():
                found = open_objects(path, storage_options or {})
                return cls._of_shards(
                    found.root, found.shards, found.index_path, found.index, found.index_files
                )
        if storage_options is not None:
            raise TypeError("storage_options applies to object-store URIs (s3://...), not files")
        with gc_paused():
            return cls._open(Path(path))

    @classmethod
    def open_files(cls, paths: Iterable[str | os.PathLike[str]]) -> Checkpoint:
        """The checkpoint made of exactly these ``.safetensors`` files (as an engine chose
        them), in this order; no index is read. A tensor in two of them is an error."""
        files = [Path(p) for p in paths]
        if not files:
            raise MissingFileError("no .safetensors files given", file=Path("."))
        with gc_paused():
            return cls._of_files(files[0].parent, files, None, None, {})

    @classmethod
    def _open(cls, path: Path) -> Checkpoint:
        index: Index | None = None
        index_files: dict[str, Path] = {}
        index_path: Path | None = None
        paths: list[Path] = []
        if path.is_dir():
            root, index_path = path, find_index(path)
            if index_path is None:
                found = sorted(root.glob("*.safetensors"))
                paths = [check_inside(root, p.name, None) for p in found]
                if not paths:
                    raise MissingFileError("no *.safetensors files and no index", file=root)
        elif path.name.endswith(INDEX_SUFFIX):
            if not path.exists():
                raise MissingFileError("file does not exist", file=path)
            root, index_path = path.parent, path
        elif path.name.endswith(".json") and path.is_file():
            # A tier map or config passed by mistake: read as a shard, its first bytes would
            # make an absurd header length, and the error would not say what was passed.
            raise CheckpointError(
                f"{path} is a JSON file, not a safetensors file: open a .safetensors file, an "
                "index (*.safetensors.index.json) or the checkpoint directory",
                file=path,
            )
        else:
            root = path.parent
            paths = [path]
        if index_path is not None:
            index = read_index(index_path)
            index_files = files_of_index(root, index)
            paths = list(index_files.values())
        return cls._of_files(root, paths, index_path, index, index_files)

    @classmethod
    def _of_files(
        cls,
        root: Path,
        paths: Sequence[Path],
        index_path: Path | None,
        index: Index | None,
        index_files: dict[str, Path],
    ) -> Checkpoint:
        shards = [_read_header(file_path) for file_path in paths]
        return cls._of_shards(root, shards, index_path, index, index_files)

    @classmethod
    def _of_shards(
        cls,
        root: Path,
        shards: Sequence[tuple[ShardFile, ShardTensors | Sequence[TensorInfo]]],
        index_path: Path | None,
        index: Index | None,
        index_files: Mapping[str, Path],
    ) -> Checkpoint:
        files = tuple(shard for shard, _ in shards)
        columns = [
            tensors if isinstance(tensors, ShardTensors) else _columns_of(tensors)
            for _, tensors in shards
        ]
        names = [f.tensors for f in files]
        # One dict built at C speed; a name in two files shows as a shorter dict.
        table = TensorTable.of_shards(tuple(f.path for f in files), names, columns)
        if table is None:
            _raise_duplicate(files)
            raise AssertionError("unreachable: a repeated name was not found")
        if index is not None:
            check_index_matches(index, index_files, table)
        return cls(root, files, table, index_path)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __repr__(self) -> str:
        root = str(self.root)
        return f"Checkpoint({root!r}, files={len(self.files)}, tensors={len(self.tensors)})"

    @property
    def total_bytes(self) -> int:
        """Payload bytes over all files."""
        return sum(f.size - f.data_start for f in self.files)


def _columns_of(infos: Sequence[TensorInfo]) -> ShardTensors:
    """A file's tensors given as objects (as an object store's headers come), as columns."""
    kinds: dict[Kind, int] = {}
    ids = array.array("I", [kinds.setdefault(kind_of(i), len(kinds)) for i in infos])
    offsets = array.array("q", [info.offset for info in infos])
    return ShardTensors(list(kinds), ids, offsets)


def _raise_duplicate(files: Sequence[ShardFile]) -> None:
    first: dict[str, ShardFile] = {}
    for shard in files:
        seen_here: set[str] = set()
        for name in shard.tensors:
            seen = first.setdefault(name, shard)
            if seen is not shard or name in seen_here:
                raise DuplicateTensorError(
                    f"also present in {seen.path}; a tensor must live in one file",
                    file=shard.path,
                    tensor=name,
                )
            seen_here.add(name)

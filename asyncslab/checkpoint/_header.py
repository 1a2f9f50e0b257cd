"""The checkpoint stage: safetensors headers, read and validated, payload untouched.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON,
then the payload. Everything a plan needs (names, dtypes, shapes, byte ranges) is in the
headers, so a checkpoint of hundreds of GB is understood — and rejected, if malformed — after
reading a few MB. The rules follow the reference implementation, plus duplicate-key
rejection: a JSON object that names a tensor twice is ambiguous, and parsers disagree about
which entry wins. The rules are the same whatever source the bytes come from
(:class:`~._source.ByteSource`: a local file, an object). The JSON text itself is parsed in
:mod:`._header_parse`; here the header is read, and the payload checked against it.
"""

from __future__ import annotations

import array
import itertools
import math
import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .._heap import frozen_columns
from ..errors import (
    FileTooShortError,
    HeaderBoundsError,
    HeaderEncodingError,
    HeaderTooLargeError,
    PayloadSizeError,
)
from ._header_parse import Kind, parse_compact, parse_general
from ._source import ByteSource, ObjectLocation

__all__ = [
    "INDEX_NAME",
    "INDEX_SUFFIX",
    "MAX_HEADER_BYTES",
    "ShardFile",
    "ShardTensors",
    "TensorInfo",
    "TensorTable",
    "kind_of",
    "parse_header",
    "shard_columns",
    "shard_of",
]

MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as its file's header declares it.

    ``offset`` is absolute within ``file`` (header included), so a read needs nothing else.
    """

    name: str
    file: Path
    dtype: torch.dtype
    st_dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One ``.safetensors`` file: where its payload starts, and what it was when planned.

    ``size``, ``inode`` and ``mtime_ns`` let the loader notice a file replaced or truncated
    between planning and reading, instead of reading garbage into a slab. ``source`` is
    ``None`` for a local file; for an object (``path`` is then an
    :class:`~._source.ObjectPath`, ``s3://bucket/key``) it names the object and the ETag
    every payload request is pinned to (``inode`` is 0, ``mtime_ns`` its last change).
    """

    path: Path
    size: int
    header_len: int
    metadata: Mapping[str, str]
    tensors: tuple[str, ...]
    inode: int
    mtime_ns: int
    source: ObjectLocation | None = None

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def parse_header(
    header: bytes, *, file_size: int, file: str | os.PathLike[str] = "<memory>"
) -> tuple[dict[str, str], list[TensorInfo]]:
    """Validate the JSON header of a file of ``file_size`` bytes.

    Returns the ``__metadata__`` map and the tensors in payload order. Pure: no I/O, so the
    rules are property-tested on bytes alone.
    """
    path = file if isinstance(file, Path) else Path(file)
    metadata, names, tensors = _parse(header, file_size, path)
    return metadata, tensors.infos(path, names)


def _parse(
    header: bytes, file_size: int, path: Path
) -> tuple[dict[str, str], list[str], ShardTensors]:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HeaderEncodingError(f"header is not UTF-8: {err}", file=path) from None
    data_start = 8 + len(header)
    columns = parse_compact(text)
    if columns is None:
        columns = parse_general(text, path)
    c = columns
    payload_end = data_start + (c.begins[-1] + c.kinds[c.ids[-1]][3] if c.names else 0)
    if payload_end != file_size:
        what = "truncated" if payload_end > file_size else "has trailing bytes"
        raise PayloadSizeError(
            f"file {what}: payload should end at byte {payload_end}, file has {file_size}",
            file=path,
            expected=payload_end,
            got=file_size,
        )
    offsets = array.array("q", map(operator.add, c.begins, itertools.repeat(data_start)))
    return c.metadata, c.names, ShardTensors(c.kinds, array.array("I", c.ids), offsets)


@dataclass(frozen=True, slots=True)
class ShardTensors:
    """One file's tensors as columns, in payload order: the kinds they have, each tensor's
    number among them (``ids``) and its absolute offset. Names are the file's
    (:attr:`ShardFile.tensors`)."""

    kinds: list[Kind]
    ids: array.array[int]
    offsets: array.array[int]

    def infos(self, path: Path, names: Sequence[str]) -> list[TensorInfo]:
        """The tensors as :class:`TensorInfo` objects (``names`` in payload order)."""
        kinds = list(map(self.kinds.__getitem__, self.ids))
        columns: dict[str, Sequence[Any]] = {
            "name": names,
            "st_dtype": list(map(operator.itemgetter(0), kinds)),
            "dtype": list(map(operator.itemgetter(1), kinds)),
            "shape": list(map(operator.itemgetter(2), kinds)),
            "offset": self.offsets,
            "nbytes": list(map(operator.itemgetter(3), kinds)),
        }
        return frozen_columns(TensorInfo, len(names), columns, {"file": path})


class TensorTable(Mapping[str, TensorInfo]):
    """A checkpoint's tensors, name -> :class:`TensorInfo`, held as columns: each tensor is
    a number (its position in file order, then payload order), and the table keeps per
    number a file number, an offset and a kind number (a few kinds serve a whole file).

    A checkpoint of 300,000 tensors would otherwise hold 300,000 ``TensorInfo`` objects and
    their offsets, several hundred bytes a tensor; the planner reads the columns, and an
    object is built only when one is asked for (so two lookups give equal, not identical,
    objects). A table made from a hand-built mapping (:meth:`of_mapping`) keeps its objects
    and hands out exactly those.
    """

    __slots__ = ("names", "paths", "files", "offsets", "ids", "kinds", "_at", "_objects")

    names: Sequence[str]
    paths: tuple[Path, ...]
    files: array.array[int]
    offsets: array.array[int]
    ids: array.array[int]
    kinds: list[Kind]

    def __init__(
        self,
        names: Sequence[str],
        paths: tuple[Path, ...],
        files: array.array[int],
        offsets: array.array[int],
        ids: array.array[int],
        kinds: list[Kind],
        at: dict[str, int],
        objects: list[TensorInfo] | None = None,
    ) -> None:
        self.names, self.paths, self.files, self.offsets = names, paths, files, offsets
        self.ids, self.kinds, self._at, self._objects = ids, kinds, at, objects

    @classmethod
    def of_shards(
        cls, paths: tuple[Path, ...], names: Sequence[Sequence[str]], shards: Sequence[ShardTensors]
    ) -> TensorTable | None:
        """The table of files ``paths`` holding ``names`` as ``shards`` say; ``None`` when a
        name is in two files (or twice in one)."""
        flat = tuple(itertools.chain.from_iterable(names))
        at = dict(zip(flat, range(len(flat)), strict=True))
        if len(at) != len(flat):
            return None
        kinds: dict[Kind, int] = {}
        files, ids, offsets = array.array("I"), array.array("I"), array.array("q")
        for number, shard in enumerate(shards):
            renumber = [kinds.setdefault(kind, len(kinds)) for kind in shard.kinds]
            ids.extend(map(renumber.__getitem__, shard.ids))
            files.extend(array.array("I", [number]) * len(shard.ids))
            offsets.extend(shard.offsets)
        return cls(flat, paths, files, offsets, ids, list(kinds), at)

    @classmethod
    def of_mapping(cls, tensors: Mapping[str, TensorInfo]) -> TensorTable:
        """The columns of a mapping built by hand (an engine's part of a checkpoint, a
        test's); its objects stay what the table hands out."""
        if isinstance(tensors, TensorTable):
            return tensors
        names = tuple(tensors)
        objects = list(tensors.values())
        by_path: dict[int, int] = {}
        paths: list[Path] = []
        files = array.array("I")
        kinds: dict[Kind, int] = {}
        ids = array.array("I")
        for info in objects:
            number = by_path.setdefault(id(info.file), len(paths))
            if number == len(paths):
                paths.append(info.file)
            files.append(number)
            ids.append(kinds.setdefault(kind_of(info), len(kinds)))
        offsets = array.array("q", map(operator.attrgetter("offset"), objects))
        at = dict(zip(names, range(len(names)), strict=True))
        return cls(names, tuple(paths), files, offsets, ids, list(kinds), at, objects)

    def info(self, number: int) -> TensorInfo:
        """Tensor ``number``'s :class:`TensorInfo`."""
        if self._objects is not None:
            return self._objects[number]
        st, dtype, shape, nbytes = self.kinds[self.ids[number]]
        return TensorInfo(
            self.names[number],
            self.paths[self.files[number]],
            dtype,
            st,
            shape,
            self.offsets[number],
            nbytes,
        )

    def number(self, name: str) -> int:
        """The number of tensor ``name`` (``KeyError`` if absent)."""
        return self._at[name]

    def numbers(self) -> Mapping[str, int]:
        """Name -> number, read-only."""
        return MappingProxyType(self._at)

    def numbers_of(self, names: Iterable[str]) -> list[int | None]:
        """The number of each of ``names`` (``None`` for a name not in the table)."""
        return list(map(self._at.get, names))

    def numbers_copy(self) -> dict[str, int]:
        """Name -> number, a dict of the caller's own."""
        return self._at.copy()

    def nbytes(self) -> list[int]:
        """Every tensor's size, in number order."""
        sizes = [kind[3] for kind in self.kinds]
        return list(map(sizes.__getitem__, self.ids))

    def __getitem__(self, name: str) -> TensorInfo:
        return self.info(self._at[name])

    def get(self, name: str, default: Any = None) -> Any:
        number = self._at.get(name)
        return default if number is None else self.info(number)

    def __contains__(self, name: object) -> bool:
        return name in self._at

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors in {len(self.paths)} files)"


def kind_of(info: TensorInfo) -> Kind:
    """``info``'s kind, as a :class:`TensorTable` numbers it."""
    return (info.st_dtype, info.dtype, info.shape, info.nbytes)


def header_bytes(source: ByteSource) -> tuple[int, bytes]:
    """The header length and header bytes of ``source``, checked against its size and the
    reference's limit before the header itself is read."""
    size, path = source.size, source.path
    if size < 8:
        raise FileTooShortError(
            f"file has {size} bytes, fewer than the 8-byte header length", file=path
        )
    header_len = int.from_bytes(source.read(0, 8), "little")
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(
            f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES}",
            file=path,
            got=header_len,
        )
    if 8 + header_len > size:
        raise HeaderBoundsError(
            f"header length {header_len} runs past the end of the file ({size} bytes)",
            file=path,
            got=header_len,
        )
    return header_len, source.read(8, header_len)


def shard_of(
    source: ByteSource, *, inode: int, mtime_ns: int, location: ObjectLocation | None = None
) -> tuple[ShardFile, list[TensorInfo]]:
    """Read and validate the header of ``source``; its payload is never read."""
    shard, tensors = shard_columns(source, inode=inode, mtime_ns=mtime_ns, location=location)
    return shard, tensors.infos(shard.path, shard.tensors)


def shard_columns(
    source: ByteSource, *, inode: int, mtime_ns: int, location: ObjectLocation | None = None
) -> tuple[ShardFile, ShardTensors]:
    """:func:`shard_of`, the tensors as columns."""
    header_len, header = header_bytes(source)
    metadata, names, tensors = _parse(header, source.size, source.path)
    shard = ShardFile(
        path=source.path,
        size=source.size,
        header_len=header_len,
        metadata=MappingProxyType(metadata),
        tensors=tuple(names),
        inode=inode,
        mtime_ns=mtime_ns,
        source=location,
    )
    return shard, tensors

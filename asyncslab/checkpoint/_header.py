"""The checkpoint stage: safetensors headers, read and validated, payload untouched.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON,
then the payload. Everything a plan needs (names, dtypes, shapes, byte ranges) is in the
headers, so a checkpoint of hundreds of GB is understood — and rejected, if malformed — after
reading a few MB. The rules follow the reference implementation, plus duplicate-key
rejection: a JSON object that names a tensor twice is ambiguous, and parsers disagree about
which entry wins. The rules are the same whatever source the bytes come from
(:class:`~._source.ByteSource`: a local file, an object).
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, cast

import torch

from ..errors import (
    DuplicateKeyError,
    FileTooShortError,
    HeaderBoundsError,
    HeaderEncodingError,
    HeaderJSONError,
    HeaderTooLargeError,
    InvalidShapeError,
    OffsetError,
    PayloadSizeError,
    SizeMismatchError,
    UnknownDtypeError,
)
from ._source import ByteSource, ObjectLocation

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "INDEX_SUFFIX",
    "MAX_HEADER_BYTES",
    "ShardFile",
    "ShardTensors",
    "TensorInfo",
    "TensorTable",
    "as_dict",
    "frozen_columns",
    "gc_paused",
    "is_object",
    "kind_of",
    "loads_object",
    "parse_header",
    "reject_constant",
    "safetensors_dtype",
    "shard_columns",
    "shard_of",
]

MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
_U64 = 1 << 64


def _dtype_table() -> dict[str, torch.dtype]:
    table = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "F32": torch.float32,
        "I64": torch.int64,
        "F64": torch.float64,
        "C64": torch.complex64,
    }
    # Newer dtypes exist only in newer torch builds; the range we support spans both.
    optional = {
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    for st, attr in optional.items():
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            table[st] = dt
    return table


#: safetensors dtype string -> torch dtype.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(_dtype_table())
_ITEMSIZE: dict[str, int] = {st: dt.itemsize for st, dt in DTYPES.items()}
# Packed sub-byte formats: the header counts 4- or 6-bit elements, while torch's packed
# dtypes (float4_e2m1fn_x2: two values a byte) count bytes, so the shapes disagree and a
# route into a slab would have to reinterpret them; refused by name, for now.
_SUB_BYTE = frozenset({"F4", "F6_E2M3", "F6_E3M2"})
_CANONICAL = ("dtype", "shape", "data_offsets")
_ST_NAME: dict[torch.dtype, str] = {dt: st for st, dt in DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype (``torch.int16`` -> ``"I16"``)."""
    return _ST_NAME.get(dtype, str(dtype))


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


def as_dict(pairs: tuple[tuple[str, Any], ...], *, file: Path, what: str) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(f"{what} names key {key!r} twice", file=file)
            seen.add(key)
    return obj


def is_object(value: Any) -> bool:
    return type(value) is tuple


def reject_constant(name: str) -> Any:
    # NaN and Infinity are Python's extension of JSON; the reference refuses them.
    raise ValueError(f"{name} is not a JSON value")


def _parse_int(token: str) -> int | float:
    return -0.0 if token == "-0" else int(token)


def loads_object(text: str, *, file: Path, what: str) -> dict[str, Any]:
    """Top-level JSON object as a dict; nested objects stay tuples of pairs.

    Duplicate keys must be caught, and a Python ``object_pairs_hook`` costs a call per
    object (a million for a large checkpoint). ``tuple`` as the hook runs in C, keeps every
    pair, and makes objects distinguishable from arrays (which stay lists); callers turn the
    objects they use into dicts with :func:`as_dict`, which checks for duplicates.
    """
    # "-0" is the float -0.0 to the reference, so not a valid size or offset; Python would
    # read it as the integer 0. Checking for the two characters first keeps the hook (a
    # Python call per integer) off the common path.
    parse_int = _parse_int if "-0" in text else None
    try:
        obj = json.loads(
            text, object_pairs_hook=tuple, parse_constant=reject_constant, parse_int=parse_int
        )
    except (ValueError, RecursionError) as err:
        # ValueError, not just JSONDecodeError: an integer past Python's 4300-digit limit
        # raises a bare ValueError.
        raise HeaderJSONError(f"{what} is not valid JSON: {err}", file=file) from None
    if not is_object(obj):
        raise HeaderJSONError(f"{what} must be a JSON object, got {type(obj).__name__}", file=file)
    return as_dict(obj, file=file, what=what)


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
    columns = _parse_compact(text)
    if columns is None:
        columns = _parse_general(text, path)
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


#: A tensor's kind: safetensors dtype, torch dtype, shape, bytes. Tensors share kinds (every
#: expert's ``suh`` of a layer has the same), so a file holds a few kinds and a number each.
Kind = tuple[str, torch.dtype, tuple[int, ...], int]
_K = TypeVar("_K")


_T = TypeVar("_T")


def frozen_columns(
    cls: type[_T], n: int, columns: Mapping[str, Sequence[Any]], same: Mapping[str, Any]
) -> list[_T]:
    """``n`` instances of the frozen, slotted dataclass ``cls``, built a field at a time
    rather than an instance at a time: field ``f`` of instance ``i`` is ``columns[f][i]``,
    or ``same[f]``, or the field's default.

    A frozen dataclass's ``__init__`` assigns each field through ``object.__setattr__``, a
    Python-level cost per field per instance that adds up to seconds for a few hundred
    thousand tensors (figures in docs/performance.md). Filling one slot of every instance
    with ``map`` over the slot's descriptor runs the loop in C; the instances are the same
    frozen objects ``__init__`` makes (there is no ``__post_init__`` to skip), as
    ``test_columns_make_the_objects_init_makes`` checks.
    """
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} checks its fields in __post_init__; build it per instance")
    fields = dataclasses.fields(cast(Any, cls))
    names = {f.name for f in fields}
    if unknown := (columns.keys() | same.keys()) - names:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    instances: list[_T] = list(map(object.__new__, itertools.repeat(cls, n)))
    for f in fields:
        column: Iterable[Any]
        if f.name in columns:
            column = columns[f.name]
            if len(column) != n:
                raise ValueError(f"{cls.__name__}.{f.name}: {len(column)} values for {n}")
        elif f.name in same:
            column = itertools.repeat(same[f.name])
        elif f.default is not dataclasses.MISSING:
            column = itertools.repeat(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            column = (f.default_factory() for _ in range(n))
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: give its values")
        collections.deque(map(getattr(cls, f.name).__set__, instances, column), maxlen=0)
    return instances


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


@dataclass(frozen=True, slots=True)
class _Columns:
    """One file's tensors in payload order: names, kinds (``ids`` number each tensor's
    among ``kinds``) and where each begins (from the payload start)."""

    metadata: dict[str, str]
    names: list[str]
    kinds: list[Kind]
    ids: list[int]
    begins: list[int]


_COMPACT_DECODER = json.JSONDecoder(object_pairs_hook=tuple, parse_constant=reject_constant)
# The separators of the compact layout, around: name, dtype, shape, offsets, next name.
_AFTER_NAME = '":{"dtype":"'
_AFTER_DTYPE = '","shape":['
_AFTER_SHAPE = '],"data_offsets":['
_AFTER_OFFSETS = ']},"'
_SPEC_MARK = "\x01"  # stands for _AFTER_DTYPE; a control character, so never in valid JSON text


def _parse_compact(text: str) -> _Columns | None:
    """The header in the layout every writer we know emits, parsed by whole-text operations.

    ``{"__metadata__":{...},"name":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},...}``
    then padding spaces. Replacing the fixed separators leaves three pieces per tensor (name,
    dtype-and-shape, offsets) that one ``split`` cuts out; dtype-and-shape pairs repeat, so
    each distinct one is checked once; numbers go through ``map(int, ...)``. Then the text is
    rebuilt from the pieces and compared with the original, which proves the layout exactly.
    A million tensors thus cost C loops instead of a million Python iterations.

    Returns ``None`` whenever the text departs from that layout in any way; the general
    parser then decides, and it alone raises errors. So this path only has to be exact about
    what it accepts: whatever it accepts, the general parser accepts with the same result
    (``test_property_compact_header_agrees_with_general``).
    """
    body = text.rstrip(" ")
    if "\\" in body or _SPEC_MARK in body:
        return None
    metadata: dict[str, str] = {}
    if body.startswith('{"__metadata__":'):
        try:
            raw, end = _COMPACT_DECODER.raw_decode(body, 16)
        except (ValueError, RecursionError):
            return None
        if type(raw) is not tuple or body[end : end + 1] != ",":
            return None
        metadata = dict(raw)
        if len(metadata) != len(raw) or not all(type(v) is str for v in metadata.values()):
            return None
        body = "{" + body[end + 1 :]
    if not (body.startswith('{"') and body.endswith("]}}")):
        return None
    # Drop the last tensor's closing "]}}" for "]}," so that every tensor ends alike.
    core = body[2:-3] + _AFTER_OFFSETS[:-1]
    flat = core.replace(_AFTER_NAME, '"').replace(_AFTER_DTYPE, _SPEC_MARK)
    parts = flat.replace(_AFTER_SHAPE, '"').split('"')
    n, extra = divmod(len(parts), 3)
    if extra:
        return None
    names = parts[0::3]
    specs = parts[1::3]  # dtype, _SPEC_MARK, dims: "F16\x012,3"
    tails = parts[2::3]  # "begin,end]},"
    # Names are the only free text: no quote or backslash (checked above), and no control
    # character, which JSON forbids and which could stand for a separator. isprintable() is
    # stricter (it also refuses, say, a no-break space), which only sends such names to the
    # general parser.
    if len(set(names)) != n or "__metadata__" in names or not "".join(names).isprintable():
        return None

    spec_of: dict[str, Kind] = {}
    spec_text: dict[str, str] = {}
    for spec in set(specs):
        st, _, dims = spec.partition(_SPEC_MARK)
        itemsize = _ITEMSIZE.get(st)
        shape = _canonical_dims(dims)
        if itemsize is None or shape is None:
            return None
        size = math.prod(shape) * itemsize
        if size >= _U64 or math.prod(filter(None, shape)) * itemsize >= _U64:
            return None
        spec_of[spec] = st, DTYPES[st], shape, size
        spec_text[spec] = f"{st}{_AFTER_DTYPE}{dims}"
    # The replacements forget which separator stood where; putting them back in the one
    # order the layout allows must give the original text.
    rebuilt = "".join(
        itertools.chain.from_iterable(
            zip(
                names,
                itertools.repeat(_AFTER_NAME),
                map(spec_text.__getitem__, specs),
                itertools.repeat(_AFTER_SHAPE),
                tails,
                itertools.repeat('"'),
            )
        )
    )
    if len(rebuilt) != len(core) + 1 or not rebuilt.startswith(core):
        return None

    return _compact_offsets(metadata, names, specs, spec_of, tails)


def _compact_offsets(
    metadata: dict[str, str],
    names: list[str],
    specs: list[str],
    spec_of: Mapping[str, Kind],
    tails: list[str],
) -> _Columns | None:
    """The second half of :func:`_parse_compact`: each tensor's ``"begin,end]},"`` tail,
    checked to be JSON's canonical integers spanning exactly its dtype and shape."""
    n = len(names)
    tokens = "".join(tails).replace("]},", ",").split(",")
    tokens.pop()  # after the last comma
    if len(tokens) != 2 * n:
        return None
    # In payload order each begin repeats the previous end: only the ends need parsing.
    in_order = tokens[0] == "0" and tokens[2::2] == tokens[1:-1:2]
    parsed = tokens[1::2] if in_order else tokens
    try:
        numbers = list(map(int, parsed))
    except ValueError:
        return None
    if in_order:
        ends = numbers
        begins = [0, *ends[:-1]]
    else:
        begins = numbers[0::2]
        ends = numbers[1::2]
    if (
        min(numbers) < 0
        or max(numbers) >= _U64
        # Two numbers in each tail, each as JSON writes it (int() also takes ' 1', '+1',
        # '1_0', '01' and non-ASCII digits).
        or '"'.join(["%d,%d]},"] * n)
        % tuple(itertools.chain.from_iterable(zip(begins, ends, strict=True)))
        != '"'.join(tails)
    ):
        return None
    nbytes = list(map(operator.sub, ends, begins))
    sizes = {spec: kind[3] for spec, kind in spec_of.items()}
    if nbytes != list(map(sizes.__getitem__, specs)):
        return None
    if not in_order or 0 in nbytes:
        # Listed out of payload order, or zero-size tensors, whose ties the general parser
        # orders by name: put them in that same order.
        order = sorted(range(n), key=lambda i: (begins[i], ends[i], names[i]))
        names, specs = list(map(names.__getitem__, order)), list(map(specs.__getitem__, order))
        begins, ends = list(map(begins.__getitem__, order)), list(map(ends.__getitem__, order))
        if begins[0] != 0 or begins[1:] != ends[:-1]:
            return None
    kinds, ids = _numbered(specs, spec_of)
    return _Columns(metadata, names, kinds, ids, begins)


def _numbered(keys: list[_K], kind_of: Mapping[_K, Kind]) -> tuple[list[Kind], list[int]]:
    """Each distinct key's kind, in order of first appearance, and each tensor's number
    among them: both parsers number alike, whatever their keys."""
    distinct = list(dict.fromkeys(keys))
    number = dict(zip(distinct, range(len(distinct)), strict=True))
    return list(map(kind_of.__getitem__, distinct)), list(map(number.__getitem__, keys))


def _canonical_dims(text: str) -> tuple[int, ...] | None:
    """``'2,3'`` -> ``(2, 3)``, ``''`` -> ``()``; ``None`` unless JSON's canonical integers."""
    if not text:
        return ()
    try:
        shape = tuple(map(int, text.split(",")))
    except ValueError:
        return None
    if min(shape) < 0 or ",".join(map(str, shape)) != text:
        return None
    return shape


def _parse_general(text: str, path: Path) -> _Columns:
    """Any valid JSON layout, checked entry by entry; raises the error for each violation."""
    obj = loads_object(text, file=path, what="header")

    metadata: dict[str, str] = {}
    raw_meta = obj.pop("__metadata__", None)
    if raw_meta is not None:
        if not is_object(raw_meta):
            raise HeaderJSONError("__metadata__ must map strings to strings", file=path)
        metadata = as_dict(raw_meta, file=path, what="__metadata__")
        if not all(type(v) is str for v in metadata.values()):
            raise HeaderJSONError("__metadata__ must map strings to strings", file=path)

    entries: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    kind_of: dict[tuple[str, tuple[int, ...]], Kind] = {}
    itemsizes = _ITEMSIZE
    for name, pairs in obj.items():
        if type(pairs) is not tuple:
            raise HeaderJSONError(
                f"entry must be an object, got {type(pairs).__name__}", file=path, tensor=name
            )
        if len(pairs) == 3 and (pairs[0][0], pairs[1][0], pairs[2][0]) == _CANONICAL:
            # The order every writer we know uses: no dict needed, no duplicates possible.
            (_, st), (_, shape), (_, offsets) = pairs
        else:
            info = dict(pairs)
            if len(info) != len(pairs):
                as_dict(pairs, file=path, what=f"entry {name!r}")
            try:
                st = info["dtype"]
                shape = info["shape"]
                offsets = info["data_offsets"]
            except KeyError as missing:
                raise HeaderJSONError(
                    f"entry lacks {missing.args[0]!r}", file=path, tensor=name
                ) from None
        itemsize = itemsizes.get(st) if type(st) is str else None
        if itemsize is None:
            sub_byte = type(st) is str and st in _SUB_BYTE  # a list or object is unhashable
            why = f"sub-byte dtype {st!r} is not supported" if sub_byte else f"unknown dtype {st!r}"
            raise UnknownDtypeError(
                f"{why}; expected one of {sorted(itemsizes)}",
                file=path,
                tensor=name,
                got=st,
            )
        bad_shape = type(shape) is not list
        if not bad_shape:
            for dim in shape:
                if type(dim) is not int or dim < 0:
                    bad_shape = True
        if bad_shape:
            raise InvalidShapeError(
                f"shape must be a list of non-negative integers, got {shape!r}",
                file=path,
                tensor=name,
                got=shape,
            )
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or type(offsets[0]) is not int
            or type(offsets[1]) is not int
        ):
            raise HeaderJSONError(
                f"data_offsets must be two integers, got {offsets!r}", file=path, tensor=name
            )
        begin, end = offsets
        if begin < 0 or end < begin or end >= _U64:
            raise OffsetError(
                f"data_offsets [{begin}, {end}] are not an ordered range of byte offsets",
                file=path,
                tensor=name,
            )
        expected = math.prod(shape) * itemsize
        if not expected and math.prod(filter(None, shape)) * itemsize >= _U64:
            # A zero dimension hides the others from the product, but they must still fit
            # 64 bits: the reference refuses them, and torch cannot stride such a shape.
            raise SizeMismatchError(
                f"shape {shape} x {itemsize} bytes ({st}) overflows 64 bits",
                file=path,
                tensor=name,
                expected=expected,
                got=end - begin,
            )
        if expected != end - begin:
            overflow = " (overflows 64 bits)" if expected >= _U64 else ""
            raise SizeMismatchError(
                f"shape {shape} x {itemsize} bytes ({st}) = {expected} bytes{overflow}, "
                f"but data_offsets span {end - begin}",
                file=path,
                tensor=name,
                expected=expected,
                got=end - begin,
            )
        shape = tuple(shape)
        kind_of.setdefault((st, shape), (st, DTYPES[st], shape, expected))
        entries.append((begin, end, name, st, shape))

    entries.sort()
    _check_contiguous(entries, path)
    kinds, ids = _numbered([(e[3], e[4]) for e in entries], kind_of)
    return _Columns(metadata, [e[2] for e in entries], kinds, ids, [e[0] for e in entries])


def _check_contiguous(
    entries: list[tuple[int, int, str, str, tuple[int, ...]]], path: Path
) -> None:
    """Sorted ``(begin, end, name, ...)`` entries must tile the payload from offset 0."""
    position = 0
    previous: str | None = None
    for begin, end, name, _, _ in entries:
        if begin != position:
            kind = "gap before" if begin > position else "overlap with"
            after = f" after {previous!r}" if previous is not None else ""
            raise OffsetError(
                f"{kind} tensor: it starts at {begin}, expected {position}{after}; "
                "tensors must be contiguous from offset 0",
                file=path,
                tensor=name,
                expected=position,
                got=begin,
            )
        position = end
        previous = name


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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    # Parsing a large checkpoint creates millions of small containers, none cyclic; each
    # allocation burst would trigger a collection over everything parsed so far, so the
    # collector's work would grow with the square of the tensor count and find nothing to
    # free (figures in docs/performance.md).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""Stage 1 of the data flow: safetensors headers, read and validated, payload untouched.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON,
then the payload. Everything a plan needs (names, dtypes, shapes, byte ranges) is in the
headers, so a checkpoint of hundreds of GB is understood — and rejected, if malformed — after
reading a few MB. The rules follow the reference implementation, plus duplicate-key
rejection: a JSON object that names a tensor twice is ambiguous, and parsers disagree about
which entry wins.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import operator
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, cast

import torch

from .._errors import (
    CheckpointError,
    DuplicateKeyError,
    DuplicateTensorError,
    FileTooShortError,
    HeaderBoundsError,
    HeaderEncodingError,
    HeaderJSONError,
    HeaderTooLargeError,
    IndexFileError,
    IndexMismatchError,
    InvalidShapeError,
    MissingFileError,
    OffsetError,
    PayloadSizeError,
    SizeMismatchError,
    UnknownDtypeError,
    UnsafePathError,
)

__all__ = ["Checkpoint", "ShardFile", "TensorInfo", "read_header", "parse_header", "DTYPES"]

#: The reference implementation's limit; a larger header is refused before it is read.
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
    between planning and reading, instead of reading garbage into a slab.
    """

    path: Path
    size: int
    header_len: int
    metadata: Mapping[str, str]
    tensors: tuple[str, ...]
    inode: int
    mtime_ns: int

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def _as_dict(pairs: tuple[tuple[str, Any], ...], *, file: Path, what: str) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(f"{what} names key {key!r} twice", file=file)
            seen.add(key)
    return obj


def _is_object(value: Any) -> bool:
    return type(value) is tuple


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are Python's extension of JSON; the reference refuses them.
    raise ValueError(f"{name} is not a JSON value")


def _parse_int(token: str) -> int | float:
    return -0.0 if token == "-0" else int(token)


def _loads_object(text: str, *, file: Path, what: str) -> dict[str, Any]:
    """Top-level JSON object as a dict; nested objects stay tuples of pairs.

    Duplicate keys must be caught, and a Python ``object_pairs_hook`` costs a call per
    object (a million for a large checkpoint). ``tuple`` as the hook runs in C, keeps every
    pair, and makes objects distinguishable from arrays (which stay lists); callers turn the
    objects they use into dicts with :func:`_as_dict`, which checks for duplicates.
    """
    # "-0" is the float -0.0 to the reference, so not a valid size or offset; Python would
    # read it as the integer 0. Checking for the two characters first keeps the hook (a
    # Python call per integer) off the common path.
    parse_int = _parse_int if "-0" in text else None
    try:
        obj = json.loads(
            text, object_pairs_hook=tuple, parse_constant=_reject_constant, parse_int=parse_int
        )
    except (ValueError, RecursionError) as err:
        # ValueError, not just JSONDecodeError: an integer past Python's 4300-digit limit
        # raises a bare ValueError.
        raise HeaderJSONError(f"{what} is not valid JSON: {err}", file=file) from None
    if not _is_object(obj):
        raise HeaderJSONError(f"{what} must be a JSON object, got {type(obj).__name__}", file=file)
    return _as_dict(obj, file=file, what=what)


def parse_header(
    header: bytes, *, file_size: int, file: str | os.PathLike[str] = "<memory>"
) -> tuple[dict[str, str], list[TensorInfo]]:
    """Validate the JSON header of a file of ``file_size`` bytes.

    Returns the ``__metadata__`` map and the tensors in payload order. Pure: no I/O, so the
    rules are property-tested on bytes alone.
    """
    path = file if isinstance(file, Path) else Path(file)
    metadata, _, tensors = _parse(header, file_size, path)
    return metadata, tensors


def _parse(
    header: bytes, file_size: int, path: Path
) -> tuple[dict[str, str], list[str], list[TensorInfo]]:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HeaderEncodingError(f"header is not UTF-8: {err}", file=path) from None
    data_start = 8 + len(header)
    columns = _parse_compact(text)
    if columns is None:
        columns = _parse_general(text, path)
    c = columns
    payload_end = data_start + (c.begins[-1] + c.nbytes[-1] if c.names else 0)
    if payload_end != file_size:
        what = "truncated" if payload_end > file_size else "has trailing bytes"
        raise PayloadSizeError(
            f"file {what}: payload should end at byte {payload_end}, file has {file_size}",
            file=path,
            expected=payload_end,
            got=file_size,
        )
    offsets = list(map(operator.add, c.begins, itertools.repeat(data_start)))
    tensors = _tensor_infos(path, c.names, c.dtypes, c.st_dtypes, c.shapes, offsets, c.nbytes)
    return c.metadata, c.names, tensors


_T = TypeVar("_T")


def frozen_columns(
    cls: type[_T], n: int, columns: Mapping[str, Sequence[Any]], same: Mapping[str, Any]
) -> list[_T]:
    """``n`` instances of the frozen, slotted dataclass ``cls``, built a field at a time
    rather than an instance at a time: field ``f`` of instance ``i`` is ``columns[f][i]``,
    or ``same[f]``, or the field's default.

    A frozen dataclass's ``__init__`` assigns each field through ``object.__setattr__``, a
    Python-level cost per field per instance that adds up to seconds for a few hundred
    thousand tensors (figures in benchmarks/README.md). Filling one slot of every instance
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


def _tensor_infos(
    path: Path,
    names: list[str],
    dtypes: list[torch.dtype],
    st_dtypes: list[str],
    shapes: list[tuple[int, ...]],
    offsets: list[int],
    nbytes: list[int],
) -> list[TensorInfo]:
    columns: dict[str, Sequence[Any]] = {
        "name": names,
        "dtype": dtypes,
        "st_dtype": st_dtypes,
        "shape": shapes,
        "offset": offsets,
        "nbytes": nbytes,
    }
    return frozen_columns(TensorInfo, len(names), columns, {"file": path})


@dataclass(frozen=True, slots=True)
class _Columns:
    """One file's tensors, a list per field, in payload order (``begins`` from the payload
    start)."""

    metadata: dict[str, str]
    names: list[str]
    dtypes: list[torch.dtype]
    st_dtypes: list[str]
    shapes: list[tuple[int, ...]]
    begins: list[int]
    nbytes: list[int]


_COMPACT_DECODER = json.JSONDecoder(object_pairs_hook=tuple, parse_constant=_reject_constant)
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

    spec_of: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
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
    per_tensor = list(map(spec_of.__getitem__, specs))
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
    if nbytes != list(map(operator.itemgetter(3), per_tensor)):
        return None
    st_dtypes = list(map(operator.itemgetter(0), per_tensor))
    dtypes = list(map(operator.itemgetter(1), per_tensor))
    shapes = list(map(operator.itemgetter(2), per_tensor))
    if not in_order or 0 in nbytes:
        # Listed out of payload order, or zero-size tensors, whose ties the general parser
        # orders by name: put them in that same order.
        order = sorted(range(n), key=lambda i: (begins[i], ends[i], names[i]))
        names, st_dtypes, shapes, begins, ends, nbytes = (
            list(map(column.__getitem__, order))
            for column in (names, st_dtypes, shapes, begins, ends, nbytes)
        )
        dtypes = list(map(dtypes.__getitem__, order))
        if begins[0] != 0 or begins[1:] != ends[:-1]:
            return None
    return _Columns(metadata, names, dtypes, st_dtypes, shapes, begins, nbytes)


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
    obj = _loads_object(text, file=path, what="header")

    metadata: dict[str, str] = {}
    raw_meta = obj.pop("__metadata__", None)
    if raw_meta is not None:
        if not _is_object(raw_meta):
            raise HeaderJSONError("__metadata__ must map strings to strings", file=path)
        metadata = _as_dict(raw_meta, file=path, what="__metadata__")
        if not all(type(v) is str for v in metadata.values()):
            raise HeaderJSONError("__metadata__ must map strings to strings", file=path)

    entries: list[tuple[int, int, str, str, tuple[int, ...]]] = []
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
                _as_dict(pairs, file=path, what=f"entry {name!r}")
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
        entries.append((begin, end, name, st, tuple(shape)))

    entries.sort()
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
    return _Columns(
        metadata,
        [e[2] for e in entries],
        [DTYPES[e[3]] for e in entries],
        [e[3] for e in entries],
        [e[4] for e in entries],
        [e[0] for e in entries],
        [e[1] - e[0] for e in entries],
    )


def read_header(path: str | os.PathLike[str]) -> tuple[ShardFile, list[TensorInfo]]:
    """Read and validate one file's header; the payload is never read."""
    shard, tensors = _read_header(path if isinstance(path, Path) else Path(path))
    return shard, tensors


def _read_header(path: Path) -> tuple[ShardFile, list[TensorInfo]]:
    fd = _open_regular(path)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < 8:
            raise FileTooShortError(
                f"file has {size} bytes, fewer than the 8-byte header length", file=path
            )
        header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
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
        header = _pread_exact(fd, header_len, 8)
    finally:
        os.close(fd)
    metadata, names, tensors = _parse(header, size, path)
    shard = ShardFile(
        path=path,
        size=size,
        header_len=header_len,
        metadata=MappingProxyType(metadata),
        tensors=tuple(names),
        inode=st.st_ino,
        mtime_ns=st.st_mtime_ns,
    )
    return shard, tensors


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    chunks = []
    while n:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            raise HeaderBoundsError("file shrank while its header was read")
        chunks.append(chunk)
        n -= len(chunk)
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

    __slots__ = ("root", "files", "tensors", "index")

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

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Accepts a ``.safetensors`` file, an index (``*.safetensors.index.json``), a
        directory with ``model.safetensors.index.json`` (or with one other index, as
        ``diffusion_pytorch_model.safetensors.index.json``), or a directory of
        ``*.safetensors`` files."""
        path = Path(path)
        with gc_paused():
            return cls._open(path)

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
        index: _Index | None = None
        index_files: dict[str, Path] = {}
        index_path: Path | None = None
        paths: list[Path] = []
        if path.is_dir():
            root, index_path = path, _find_index(path)
            if index_path is None:
                found = sorted(root.glob("*.safetensors"))
                paths = [_check_inside(root, p.name, None) for p in found]
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
            index = _read_index(index_path)
            index_files = _index_files(root, index)
            paths = list(index_files.values())
        return cls._of_files(root, paths, index_path, index, index_files)

    @classmethod
    def _of_files(
        cls,
        root: Path,
        paths: Sequence[Path],
        index_path: Path | None,
        index: _Index | None,
        index_files: dict[str, Path],
    ) -> Checkpoint:
        files: list[ShardFile] = []
        per_file: list[list[TensorInfo]] = []
        for file_path in paths:
            shard, infos = _read_header(file_path)
            files.append(shard)
            per_file.append(infos)
        # One dict built at C speed; a name in two files shows as a shorter dict.
        tensors = dict(
            zip(
                itertools.chain.from_iterable(f.tensors for f in files),
                itertools.chain.from_iterable(per_file),
                strict=True,
            )
        )
        if len(tensors) != sum(map(len, per_file)):
            _raise_duplicate(files, per_file)
        if index is not None:
            _check_index_matches(index, index_files, per_file, tensors)
        return cls(root, tuple(files), MappingProxyType(tensors), index_path)

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


def _raise_duplicate(files: list[ShardFile], per_file: list[list[TensorInfo]]) -> None:
    first: dict[str, TensorInfo] = {}
    for shard, infos in zip(files, per_file, strict=True):
        for info in infos:
            seen = first.setdefault(info.name, info)
            if seen is not info:
                raise DuplicateTensorError(
                    f"also present in {seen.file}; a tensor must live in one file",
                    file=shard.path,
                    tensor=info.name,
                )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    # Parsing a large checkpoint creates millions of small containers, none cyclic; each
    # allocation burst would trigger a collection over everything parsed so far, so the
    # collector's work would grow with the square of the tensor count and find nothing to
    # free (figures in benchmarks/README.md).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class _Index:
    """An index's ``weight_map`` as parallel lists.

    ``checked`` is False when the compact reader made it: it leaves repeated names and
    control characters in names to the comparison with the headers, whose names are valid.
    """

    path: Path
    names: list[str]
    files: list[str]
    checked: bool


def _find_index(root: Path) -> Path | None:
    """The directory's index: ``model.safetensors.index.json``, else its only other one
    (diffusers names theirs after the model). Several others are refused: globbing every
    shard would mix their variants (fp16 and fp32 shards of the same tensors)."""
    if (root / INDEX_NAME).exists():
        return root / INDEX_NAME
    # Regular files only, and no hidden ones (macOS leaves "._name" beside each file).
    found = sorted(
        p for p in root.glob("*" + INDEX_SUFFIX) if not p.name.startswith(".") and p.is_file()
    )
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
        raise IndexFileError(
            f"{len(found)} indexes and no {INDEX_NAME} ({names}): open the index to load",
            file=root,
        )
    return found[0] if found else None


def _read_index(index_path: Path) -> _Index:
    text = _index_text(index_path)
    fast = _weight_map_compact(text)
    if fast is not None:
        return _Index(index_path, *fast, checked=False)
    weight_map = _parse_index(text, index_path)
    return _Index(index_path, list(weight_map), list(weight_map.values()), checked=True)


def _index_text(index_path: Path) -> str:
    if not index_path.is_file():  # opening a FIFO would block forever
        raise IndexFileError("index is not a regular file", file=index_path)
    try:
        return index_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise IndexFileError(f"cannot read index: {err}", file=index_path) from err


def _parse_index(text: str, index_path: Path) -> dict[str, str]:
    try:
        obj = _loads_object(text, file=index_path, what="index")
    except (HeaderJSONError, DuplicateKeyError) as err:
        raise IndexFileError(err.message, file=index_path) from None
    raw_map = obj.get("weight_map")
    if raw_map is None or not _is_object(raw_map):
        raise IndexFileError("index has no 'weight_map' object", file=index_path)
    try:
        weight_map = _as_dict(raw_map, file=index_path, what="weight_map")
    except DuplicateKeyError as err:
        raise IndexFileError(err.message, file=index_path) from None
    for name, file_name in weight_map.items():
        if type(file_name) is not str:
            raise IndexFileError(
                f"weight_map entry maps to {file_name!r}, expected a file name",
                file=index_path,
                tensor=name,
            )
    return weight_map


_OPENER = re.compile(r"[ \t\n\r]*:[ \t\n\r]*\{[ \t\n\r]*")
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_COMMA = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")


def _weight_map_compact(text: str) -> tuple[list[str], list[str]] | None:
    """An index's ``weight_map`` (a million entries, for a large checkpoint) as parallel
    lists of names and file names, without a Python step per entry; ``None`` sends the
    text to the general parser, which alone raises errors.

    With no escapes, splitting on ``"`` leaves string contents at odd positions and the
    syntax between them at even ones, so the map is four strided slices: names, colons,
    file names, commas. The separators are checked as distinct strings (writers repeat one
    of each), and the rest of the document, with the map emptied, goes through the general
    JSON parser. Two things are left to the caller, because comparing the names with the
    headers' settles both at no extra cost: that no name repeats, and that no name holds a
    control character. Whatever this accepts, the general parser reads alike
    (``test_property_compact_index_agrees_with_general``).
    """
    if "\\" in text:
        return None
    parts = text.split('"')
    try:
        k = parts.index("weight_map")
    except ValueError:
        return None
    if k % 2 == 0 or k + 1 == len(parts) or _OPENER.fullmatch(parts[k + 1]) is None:
        return None  # not a key, an unterminated string, or not followed by an object
    # After each file name: a comma, or for the last one the map's closing brace.
    after = parts[k + 5 :: 4]
    m = 1
    if after and _COMMA.fullmatch(after[0]) is not None:
        m += len(list(itertools.takewhile(after[0].__eq__, after)))
    if m > len(after):
        return None
    names = parts[k + 2 : k + 2 + 4 * m : 4]
    colons = parts[k + 3 : k + 3 + 4 * m : 4]
    files = parts[k + 4 : k + 4 + 4 * m : 4]
    if not all(_COLON.fullmatch(colon) for colon in set(colons)):
        return None
    # JSON forbids control characters in strings; isprintable() is stricter, which only
    # sends unusual file names to the general parser.
    if not "".join(dict.fromkeys(files)).isprintable():
        return None
    # The document with the map emptied: "weight_map": {<opener><closer>...
    rest = '"'.join(parts[: k + 2]) + '"'.join(parts[k + 1 + 4 * m :])
    try:
        obj = json.loads(rest, object_pairs_hook=tuple, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not tuple:
        return None
    top = dict(obj)
    if len(top) != len(obj) or top.get("weight_map") != ():
        return None
    return names, files


def _check_inside(root: Path, name: str, index_path: Path | None) -> Path:
    where = index_path if index_path is not None else root / name
    pure = Path(name)
    if pure.is_absolute() or ".." in pure.parts or name == "" or "\x00" in name:
        raise UnsafePathError(
            f"file name {name!r} must be relative and stay inside {root}", file=where
        )
    candidate = root / pure
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop: RuntimeError before 3.13
        raise MissingFileError(f"cannot resolve {name!r}: {err}", file=candidate) from None
    if not any(resolved.is_relative_to(place) for place in _allowed_targets(root)):
        raise UnsafePathError(
            f"{name!r} resolves to {resolved}, outside the checkpoint directory {root}",
            file=where,
        )
    return candidate


def _allowed_targets(root: Path) -> list[Path]:
    """Where a shard of ``root`` may resolve to: inside it, and, for a snapshot of a
    Hugging Face hub cache (``models--org--name/snapshots/<revision>``, whose files are
    links to ``../../blobs/<hash>``), that repository's blobs — the most common layout of a
    downloaded checkpoint; any other place outside stays refused."""
    real = root.resolve()
    places = [real]
    if real.parent.name == "snapshots":
        places.append(real.parent.parent / "blobs")
    return places


def _index_files(root: Path, index: _Index) -> dict[str, Path]:
    """Each file name the index uses (in first-use order) -> the file, checked to be inside
    ``root`` and named only once."""
    index_path = index.path
    paths: dict[str, Path] = {}
    by_target: dict[Path, str] = {}
    for name in dict.fromkeys(index.files):
        candidate = _check_inside(root, name, index_path)
        target = candidate.resolve()
        if target in by_target:
            raise IndexFileError(
                f"{by_target[target]!r} and {name!r} name the same file", file=index_path
            )
        by_target[target] = name
        paths[name] = candidate
    return paths


def _check_index_matches(
    index: _Index,
    expected_for: Mapping[str, Path],
    per_file: list[list[TensorInfo]],
    tensors: Mapping[str, TensorInfo],
) -> None:
    """``expected_for``: each file name the index uses -> the file (:func:`_index_files`)."""
    # Every entry is checked by C loops; Python loops run only to name a culprit. Each index
    # name found, no two naming the same tensor, as many as the headers hold, each in the
    # file the index says: then the two agree exactly.
    found = list(map(tensors.get, index.names))
    if len(found) == len(tensors) and None not in found:
        infos = cast("list[TensorInfo]", found)
        # Writers list names sorted (transformers) or in file order; either settles
        # uniqueness by a linear scan, without hashing a million entries again.
        unique = (
            index.checked
            or all(map(operator.lt, index.names, itertools.islice(index.names, 1, None)))
            or infos == list(itertools.chain.from_iterable(per_file))
            or len(set(map(id, infos))) == len(infos)
        )
        placed = list(map(operator.attrgetter("file"), infos))
        if unique and placed == list(map(expected_for.__getitem__, index.files)):
            return
    # They disagree. An index the compact reader took may also be malformed in a way it
    # left to this comparison (a repeated name): the general parser reports that first.
    weight_map = (
        dict(zip(index.names, index.files, strict=True))
        if index.checked
        else _parse_index(_index_text(index.path), index.path)
    )
    for name, file_name in weight_map.items():
        info = tensors.get(name)
        if info is None or info.file is not expected_for.get(file_name):
            actual = f"it is in {info.file}" if info is not None else "no file has it"
            raise IndexMismatchError(
                f"index places it in {file_name!r}, but {actual}",
                file=index.path,
                tensor=name,
            )
    extra = [name for name in tensors if name not in weight_map]
    if not extra:  # read again above, the index now agrees: it was rewritten meanwhile
        raise IndexFileError("index changed while the checkpoint was opened", file=index.path)
    info = tensors[extra[0]]
    raise IndexMismatchError(
        f"present in the file but absent from the index ({len(extra)} such tensors)",
        file=info.file,
        tensor=info.name,
    )

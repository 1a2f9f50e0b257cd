"""A safetensors header's JSON text, parsed into one file's tensors as columns.

Two parsers give the same columns: :func:`parse_compact` reads the layout every writer we
know emits by whole-text operations (C loops, no Python step per tensor) and gives up on any
other; :func:`parse_general` reads any valid JSON layout entry by entry, and it alone raises
the errors. Below them sit the dtype table and the JSON rules the index file shares (no
duplicate keys, no NaN). :mod:`._header` reads the bytes from a source and checks the
payload against the columns.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from ..errors import (
    DuplicateKeyError,
    HeaderJSONError,
    InvalidShapeError,
    OffsetError,
    SizeMismatchError,
    UnknownDtypeError,
)

__all__ = [
    "DTYPES",
    "Kind",
    "as_dict",
    "is_object",
    "loads_object",
    "parse_compact",
    "parse_general",
    "reject_constant",
    "safetensors_dtype",
]

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


#: A tensor's kind: safetensors dtype, torch dtype, shape, bytes. Tensors share kinds (every
#: expert's ``suh`` of a layer has the same), so a file holds a few kinds and a number each.
Kind = tuple[str, torch.dtype, tuple[int, ...], int]
_K = TypeVar("_K")


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


def parse_compact(text: str) -> _Columns | None:
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
    """The second half of :func:`parse_compact`: each tensor's ``"begin,end]},"`` tail,
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


def parse_general(text: str, path: Path) -> _Columns:
    """Any valid JSON layout, checked entry by entry; raises the error for each violation."""
    obj = loads_object(text, file=path, what="header")
    metadata = _metadata(obj.pop("__metadata__", None), path)
    entries, kind_of = _entries(obj, path)
    entries.sort()
    _check_contiguous(entries, path)
    kinds, ids = _numbered([(e[3], e[4]) for e in entries], kind_of)
    return _Columns(metadata, [e[2] for e in entries], kinds, ids, [e[0] for e in entries])


def _metadata(raw_meta: Any, path: Path) -> dict[str, str]:
    """The header's ``__metadata__`` (``None`` when it has none), strings to strings."""
    if raw_meta is None:
        return {}
    if not is_object(raw_meta):
        raise HeaderJSONError("__metadata__ must map strings to strings", file=path)
    metadata = as_dict(raw_meta, file=path, what="__metadata__")
    if not all(type(v) is str for v in metadata.values()):
        raise HeaderJSONError("__metadata__ must map strings to strings", file=path)
    return metadata


#: A tensor's entry, as sorting puts it in payload order: begin, end, name, dtype, shape.
_Entry = tuple[int, int, str, str, tuple[int, ...]]


def _entries(
    obj: dict[str, Any], path: Path
) -> tuple[list[_Entry], dict[tuple[str, tuple[int, ...]], Kind]]:
    """Every tensor's entry, checked, and the kind of each distinct dtype and shape.

    A loop over the entries in which a valid one calls no function of ours: the two errors
    whose wording takes working out are built by :func:`_dtype_error` and
    :func:`_size_error`, only on the way out."""
    entries: list[_Entry] = []
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
            raise _dtype_error(st, path, name)
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
        if expected != end - begin or (
            not expected and math.prod(filter(None, shape)) * itemsize >= _U64
        ):
            raise _size_error(shape, st, itemsize, end - begin, path, name)
        shape = tuple(shape)
        kind_of.setdefault((st, shape), (st, DTYPES[st], shape, expected))
        entries.append((begin, end, name, st, shape))
    return entries, kind_of


def _dtype_error(st: Any, path: Path, name: str) -> UnknownDtypeError:
    """The error for an entry whose dtype is none the table knows."""
    sub_byte = type(st) is str and st in _SUB_BYTE  # a list or object is unhashable
    why = f"sub-byte dtype {st!r} is not supported" if sub_byte else f"unknown dtype {st!r}"
    return UnknownDtypeError(
        f"{why}; expected one of {sorted(_ITEMSIZE)}",
        file=path,
        tensor=name,
        got=st,
    )


def _size_error(
    shape: list[int], st: str, itemsize: int, span: int, path: Path, name: str
) -> SizeMismatchError:
    """The error for an entry whose shape and dtype do not make the bytes its
    ``data_offsets`` span."""
    expected = math.prod(shape) * itemsize
    if not expected and math.prod(filter(None, shape)) * itemsize >= _U64:
        # A zero dimension hides the others from the product, but they must still fit
        # 64 bits: the reference refuses them, and torch cannot stride such a shape.
        return SizeMismatchError(
            f"shape {shape} x {itemsize} bytes ({st}) overflows 64 bits",
            file=path,
            tensor=name,
            expected=expected,
            got=span,
        )
    overflow = " (overflows 64 bits)" if expected >= _U64 else ""
    return SizeMismatchError(
        f"shape {shape} x {itemsize} bytes ({st}) = {expected} bytes{overflow}, "
        f"but data_offsets span {span}",
        file=path,
        tensor=name,
        expected=expected,
        got=span,
    )


def _check_contiguous(entries: list[_Entry], path: Path) -> None:
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

"""Byte-level builders for safetensors files, valid and malformed, and the table of malformed
cases the format tests run.

A safetensors file is ``struct.pack('<Q', N)`` + ``N`` bytes of UTF-8 JSON + payload. The
builders here write JSON *text* (not ``json.dumps`` of a dict) so that a case can repeat a key,
put a float where an integer belongs, or splice in something that is not JSON at all.

Imported by the tests as ``from tests import malformed``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncslab.errors import (
    AsyncSlabError,
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

U64 = 1 << 64
MAX_HEADER_BYTES = 100_000_000


class Raw(str):
    """A JSON fragment inserted verbatim (``Raw("1.5")``, ``Raw("NaN")``)."""


def js(value: Any) -> str:
    """JSON text of ``value``; :class:`Raw` fragments and tuples of pairs pass through."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, tuple):  # ordered pairs: an object that may repeat keys
        return obj(*value)
    if isinstance(value, list):
        return "[" + ",".join(js(v) for v in value) + "]"
    return json.dumps(value)


def obj(*pairs: tuple[str, Any]) -> Raw:
    """A JSON object from ordered ``(key, value)`` pairs; keys may repeat."""
    return Raw("{" + ",".join(f"{json.dumps(k)}:{js(v)}" for k, v in pairs) + "}")


def entry(
    dtype: Any = "U8",
    shape: Any = (4,),
    offsets: Any = (0, 4),
    *,
    extra: Iterable[tuple[str, Any]] = (),
    omit: str | None = None,
) -> Raw:
    """One tensor entry; ``shape`` and ``offsets`` tuples become JSON arrays."""
    fields: list[tuple[str, Any]] = [
        ("dtype", dtype),
        ("shape", list(shape) if isinstance(shape, tuple) else shape),
        ("data_offsets", list(offsets) if isinstance(offsets, tuple) else offsets),
        *extra,
    ]
    return obj(*[(k, v) for k, v in fields if k != omit])


def header(*pairs: tuple[str, Any]) -> bytes:
    """Header bytes of a top-level object from ordered ``(name, entry)`` pairs."""
    return obj(*pairs).encode()


def build(
    head: bytes | str,
    payload: bytes | int = b"",
    *,
    length: int | None = None,
    pad: bool = False,
) -> bytes:
    """A whole file: length prefix + header + payload.

    ``payload`` may be a byte count (filled with a counting pattern). ``length`` overrides the
    declared header length; ``pad`` pads the header with spaces to a multiple of 8, as the
    reference writer does.
    """
    hb = head.encode() if isinstance(head, str) else head
    if pad:
        hb += b" " * (-len(hb) % 8)
    if isinstance(payload, int):
        payload = bytes(i % 251 for i in range(payload))
    n = len(hb) if length is None else length
    return struct.pack("<Q", n) + hb + payload


def one(e: Raw, payload: bytes | int = 4, name: str = "t") -> bytes:
    """A file holding one tensor entry ``e`` named ``name``."""
    return build(header((name, e)), payload)


@dataclass(frozen=True)
class Case:
    """One malformed file and what opening it must raise.

    ``match`` is a regex searched in the error's own message (after ``file: tensor 'x': ``);
    ``tensor`` is the expected ``err.tensor``. ``reference_rejects`` records whether
    ``safetensors.safe_open`` rejects the file too: where it is False, asyncslab is
    deliberately stricter than the reference (duplicate keys, sub-byte dtypes).
    """

    id: str
    data: bytes
    error: type[AsyncSlabError]
    match: str
    tensor: str | None = None
    reference_rejects: bool = True


E = entry  # short alias for the table

CASES: list[Case] = [
    # --- the length prefix ---------------------------------------------------------------
    Case("empty-file", b"", FileTooShortError, r"file has 0 bytes, fewer than the 8-byte"),
    Case("seven-bytes", b"\x02\0\0\0\0\0\0", FileTooShortError, r"file has 7 bytes"),
    Case(
        "header-too-large",
        build(b"{}", length=MAX_HEADER_BYTES + 1),
        HeaderTooLargeError,
        rf"header length {MAX_HEADER_BYTES + 1} exceeds the limit of {MAX_HEADER_BYTES}",
    ),
    Case(
        "header-length-u64-max",
        build(b"{}", length=U64 - 1),
        HeaderTooLargeError,
        rf"header length {U64 - 1} exceeds",
    ),
    Case(
        "header-length-at-limit-past-eof",  # exactly the limit is allowed, but past EOF
        build(b"{}", length=MAX_HEADER_BYTES),
        HeaderBoundsError,
        rf"header length {MAX_HEADER_BYTES} runs past the end of the file \(10 bytes\)",
    ),
    Case(
        "header-past-eof",
        build(b"{}", length=3),
        HeaderBoundsError,
        r"header length 3 runs past the end of the file \(10 bytes\)",
    ),
    Case(
        "header-length-only",
        struct.pack("<Q", 1),
        HeaderBoundsError,
        r"header length 1 runs past the end of the file \(8 bytes\)",
    ),
    # --- encoding and JSON ---------------------------------------------------------------
    Case("header-not-utf8", build(b'{"\xff":1}'), HeaderEncodingError, r"header is not UTF-8"),
    Case(
        "header-split-utf8",  # the first byte of a two-byte sequence, then the end
        build('{"\u00e9":1}'.encode()[:-5]),
        HeaderEncodingError,
        r"header is not UTF-8",
    ),
    Case("header-latin1", build('{"caf\u00e9":1}'.encode("latin-1")), HeaderEncodingError, "UTF-8"),
    Case("header-empty", build(b""), HeaderJSONError, r"header is not valid JSON"),
    Case("header-not-json", build(b"hello"), HeaderJSONError, r"header is not valid JSON"),
    Case("header-unclosed", build(b'{"t":'), HeaderJSONError, r"header is not valid JSON"),
    Case("header-trailing-garbage", build(b"{} x"), HeaderJSONError, r"not valid JSON"),
    Case("header-nul-padding", build(b"{}\0\0\0\0\0\0"), HeaderJSONError, r"not valid JSON"),
    Case(
        "header-deep-nesting",
        build(b"[" * 200_000 + b"]" * 200_000),
        HeaderJSONError,
        r"header is not valid JSON",
    ),
    Case(
        "header-nan-in-extra-key",  # NaN is Python's extension, not JSON; the reference refuses
        one(E(extra=[("x", Raw("NaN"))])),
        HeaderJSONError,
        r"header is not valid JSON",
    ),
    Case(
        "header-infinity-in-metadata",
        build(header(("__metadata__", obj(("k", Raw("-Infinity")))))),
        HeaderJSONError,
        r"header is not valid JSON",
    ),
    Case(
        "header-int-over-4300-digits",  # Python's int-parsing limit raises a bare ValueError
        one(E(offsets=Raw("[0," + "9" * 5000 + "]"))),
        HeaderJSONError,
        r"header is not valid JSON",
    ),
    Case("top-level-array", build(b"[]"), HeaderJSONError, r"must be a JSON object, got list"),
    Case("top-level-string", build(b'"x"'), HeaderJSONError, r"must be a JSON object, got str"),
    Case("top-level-number", build(b"42"), HeaderJSONError, r"must be a JSON object, got int"),
    Case("top-level-float", build(b"4.5"), HeaderJSONError, r"must be a JSON object, got float"),
    Case("top-level-null", build(b"null"), HeaderJSONError, r"JSON object, got NoneType"),
    Case("top-level-true", build(b"true"), HeaderJSONError, r"JSON object, got bool"),
    # --- duplicate keys (the reference lets the last one win for tensors and metadata) ---
    Case(
        "duplicate-tensor-key",
        build(header(("t", E()), ("t", E())), 4),
        DuplicateKeyError,
        r"header names key 't' twice",
        reference_rejects=False,
    ),
    Case(
        "duplicate-metadata-key-top-level",
        build(header(("__metadata__", obj()), ("__metadata__", obj()))),
        DuplicateKeyError,
        r"header names key '__metadata__' twice",
    ),
    Case(
        "duplicate-key-in-entry",
        one(obj(("dtype", "U8"), ("dtype", "U8"), ("shape", [4]), ("data_offsets", [0, 4]))),
        DuplicateKeyError,
        r"entry 't' names key 'dtype' twice",
    ),
    Case(
        "duplicate-extra-key-in-entry",
        one(E(extra=[("x", 1), ("x", 2)])),
        DuplicateKeyError,
        r"entry 't' names key 'x' twice",
        reference_rejects=False,  # the reference ignores unknown fields, repeated or not
    ),
    Case(
        "duplicate-key-in-metadata",
        build(header(("__metadata__", obj(("k", "a"), ("k", "b"))))),
        DuplicateKeyError,
        r"__metadata__ names key 'k' twice",
        reference_rejects=False,
    ),
    # --- dtype ---------------------------------------------------------------------------
    Case("dtype-lowercase", one(E("f32", (1,))), UnknownDtypeError, r"unknown dtype 'f32'", "t"),
    Case("dtype-torch-name", one(E("float32", (1,))), UnknownDtypeError, r"unknown dtype", "t"),
    Case("dtype-empty", one(E("", (4,))), UnknownDtypeError, r"unknown dtype ''", "t"),
    Case(
        "dtype-F4-sub-byte",
        one(E("F4", (8,)), 4),
        UnknownDtypeError,
        r"sub-byte dtype 'F4' is not supported",
        "t",
        reference_rejects=False,
    ),
    Case(
        "dtype-F6_E2M3-sub-byte",
        one(E("F6_E2M3", (16,), (0, 12)), 12),
        UnknownDtypeError,
        r"sub-byte dtype 'F6_E2M3' is not supported",
        "t",
        reference_rejects=False,
    ),
    Case("dtype-number", one(E(5)), UnknownDtypeError, r"unknown dtype 5;", "t"),
    Case("dtype-null", one(E(None)), UnknownDtypeError, r"unknown dtype None;", "t"),
    Case("dtype-list", one(E(["U8"])), UnknownDtypeError, r"unknown dtype \['U8'\]", "t"),
    Case("dtype-object", one(E(obj(("a", [1])))), UnknownDtypeError, r"unknown dtype", "t"),
    # --- shape ---------------------------------------------------------------------------
    Case("shape-negative", one(E(shape=(-1,))), InvalidShapeError, r"got \[-1\]", "t"),
    Case("shape-float", one(E(shape=Raw("[1.5]"))), InvalidShapeError, r"got \[1\.5\]", "t"),
    Case("shape-float-integral", one(E(shape=Raw("[4.0]"))), InvalidShapeError, r"\[4\.0\]", "t"),
    Case("shape-exponent", one(E(shape=Raw("[4e0]"))), InvalidShapeError, r"non-negative", "t"),
    Case("shape-string-dim", one(E(shape=("4",))), InvalidShapeError, r"got \['4'\]", "t"),
    Case("shape-bool-dim", one(E(shape=(True,))), InvalidShapeError, r"got \[True\]", "t"),
    Case("shape-null-dim", one(E(shape=(None,))), InvalidShapeError, r"got \[None\]", "t"),
    Case("shape-nested", one(E(shape=Raw("[[4]]"))), InvalidShapeError, r"got \[\[4\]\]", "t"),
    Case("shape-string", one(E(shape="4")), InvalidShapeError, r"got '4'", "t"),
    Case("shape-number", one(E(shape=4)), InvalidShapeError, r"got 4$", "t"),
    Case("shape-null", one(E(shape=None)), InvalidShapeError, r"got None", "t"),
    Case("shape-object", one(E(shape=obj(("0", 4)))), InvalidShapeError, r"non-negative", "t"),
    # "-0" is the float -0.0 to the reference; Python's JSON alone would read integer 0.
    Case(
        "shape-negative-zero",
        one(E(shape=Raw("[-0]"), offsets=(0, 0)), 0),
        InvalidShapeError,
        r"got \[-0\.0\]",
        "t",
    ),
    # --- data_offsets --------------------------------------------------------------------
    Case(
        "offsets-floats",
        one(E(offsets=Raw("[0.0,4.0]"))),
        HeaderJSONError,
        r"data_offsets must be two integers, got \[0\.0, 4\.0\]",
        "t",
    ),
    Case(
        "offsets-negative-zero",
        one(E(offsets=Raw("[-0,4]"))),
        HeaderJSONError,
        r"two integers, got \[-0\.0, 4\]",
        "t",
    ),
    Case("offsets-three", one(E(offsets=(0, 4, 8))), HeaderJSONError, r"two integers", "t"),
    Case("offsets-one", one(E(offsets=(4,))), HeaderJSONError, r"two integers, got \[4\]", "t"),
    Case("offsets-empty", one(E(offsets=())), HeaderJSONError, r"two integers, got \[\]", "t"),
    Case("offsets-strings", one(E(offsets=("0", "4"))), HeaderJSONError, r"two integers", "t"),
    Case("offsets-bools", one(E(offsets=(False, 4))), HeaderJSONError, r"two integers", "t"),
    Case("offsets-null", one(E(offsets=None)), HeaderJSONError, r"two integers, got None", "t"),
    Case("offsets-object", one(E(offsets=obj(("0", 4)))), HeaderJSONError, r"two integers", "t"),
    Case(
        "offsets-negative",
        one(E(offsets=(-4, 0))),
        OffsetError,
        r"data_offsets \[-4, 0\] are not an ordered range",
        "t",
    ),
    Case(
        "offsets-end-before-begin",
        one(E(shape=(0,), offsets=(4, 0))),
        OffsetError,
        r"data_offsets \[4, 0\] are not an ordered range",
        "t",
    ),
    Case(
        "offsets-past-u64",
        one(E(shape=(0,), offsets=(U64, U64))),
        OffsetError,
        rf"\[{U64}, {U64}\] are not an ordered range",
        "t",
    ),
    # --- element count x item size vs byte length ----------------------------------------
    Case(
        "size-mismatch-short",
        one(E("F32", (2,), (0, 4))),
        SizeMismatchError,
        r"shape \[2\] x 4 bytes \(F32\) = 8 bytes, but data_offsets span 4",
        "t",
    ),
    Case(
        "size-mismatch-long",
        one(E("U8", (2, 2), (0, 5)), 5),
        SizeMismatchError,
        r"= 4 bytes, but data_offsets span 5",
        "t",
    ),
    Case(
        "size-mismatch-scalar",
        one(E("I64", (), (0, 4))),
        SizeMismatchError,
        r"shape \[\] x 8 bytes \(I64\) = 8 bytes, but data_offsets span 4",
        "t",
    ),
    Case(
        "size-overflow-u64",  # 2**32 * 2**32 * 4 bytes, with offsets that fit the file
        one(E("F32", (1 << 32, 1 << 32), (0, 4))),
        SizeMismatchError,
        r"\(overflows 64 bits\)",
        "t",
    ),
    Case(
        "size-overflow-wraps-to-zero",  # 2**64 elements x 1 byte wraps to 0 in u64 arithmetic
        one(E("U8", (1 << 32, 1 << 32), (0, 0)), 0),
        SizeMismatchError,
        r"overflows 64 bits",
        "t",
    ),
    Case(
        "size-overflow-hidden-by-zero-dim",  # the reference overflows before it reaches the 0
        one(E("U8", (1 << 40, 1 << 40, 0), (0, 0)), 0),
        SizeMismatchError,
        r"overflows 64 bits",
        "t",
    ),
    Case(
        "shape-dim-past-u64-with-zero-dim",
        one(E("U8", (0, U64), (0, 0)), 0),
        SizeMismatchError,
        r"overflows 64 bits",
        "t",
    ),
    # --- layout of the payload -----------------------------------------------------------
    Case(
        "offsets-gap",
        build(header(("a", E(offsets=(0, 4))), ("b", E(offsets=(8, 12)))), 12),
        OffsetError,
        r"gap before tensor: it starts at 8, expected 4 after 'a'",
        "b",
    ),
    Case(
        "offsets-overlap",
        build(header(("a", E("U8", (8,), (0, 8))), ("b", E("U8", (8,), (4, 12)))), 12),
        OffsetError,
        r"overlap with tensor: it starts at 4, expected 8 after 'a'",
        "b",
    ),
    Case(
        "offsets-shared-start",
        build(header(("a", E(offsets=(0, 4))), ("b", E(offsets=(0, 4)))), 4),
        OffsetError,
        r"overlap with tensor: it starts at 0, expected 4 after 'a'",
        "b",
    ),
    Case(
        "offsets-first-not-at-zero",
        build(header(("a", E(offsets=(4, 8)))), 8),
        OffsetError,
        r"gap before tensor: it starts at 4, expected 0; tensors must be contiguous",
        "a",
    ),
    Case(
        "offsets-empty-tensor-inside-another",
        build(header(("a", E("U8", (8,), (0, 8))), ("z", E("U8", (0,), (4, 4)))), 8),
        OffsetError,
        r"overlap with tensor: it starts at 4, expected 8 after 'a'",
        "z",
    ),
    Case(
        "offsets-empty-tensor-past-payload",
        build(header(("a", E()), ("z", E("U8", (0,), (9, 9)))), 4),
        OffsetError,
        r"gap before tensor: it starts at 9, expected 4 after 'a'",
        "z",
    ),
    # --- payload size --------------------------------------------------------------------
    Case(
        "payload-trailing-bytes",
        build(header(("t", E())), 5),
        PayloadSizeError,
        r"file has trailing bytes: payload should end at byte \d+, file has \d+",
    ),
    Case(
        "payload-truncated",
        build(header(("t", E())), 3),
        PayloadSizeError,
        r"file truncated: payload should end at byte \d+, file has \d+",
    ),
    Case(
        "payload-missing",
        build(header(("t", E())), 0),
        PayloadSizeError,
        r"file truncated",
    ),
    Case("empty-header-with-payload", build(b"{}", 1), PayloadSizeError, r"trailing bytes"),
    # --- structure of entries and metadata -----------------------------------------------
    Case("entry-list", one(Raw("[]")), HeaderJSONError, r"entry must be an object, got list", "t"),
    Case("entry-string", one(Raw('"U8"')), HeaderJSONError, r"object, got str", "t"),
    Case("entry-number", one(Raw("1")), HeaderJSONError, r"object, got int", "t"),
    Case("entry-null", one(Raw("null")), HeaderJSONError, r"object, got NoneType", "t"),
    Case("entry-empty-object", one(obj()), HeaderJSONError, r"entry lacks 'dtype'", "t"),
    Case("entry-missing-dtype", one(E(omit="dtype")), HeaderJSONError, r"lacks 'dtype'", "t"),
    Case("entry-missing-shape", one(E(omit="shape")), HeaderJSONError, r"lacks 'shape'", "t"),
    Case(
        "entry-missing-data_offsets",
        one(E(omit="data_offsets")),
        HeaderJSONError,
        r"entry lacks 'data_offsets'",
        "t",
    ),
    Case(
        "metadata-number-value",
        build(header(("__metadata__", obj(("k", 1))))),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
    Case(
        "metadata-null-value",
        build(header(("__metadata__", obj(("k", None))))),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
    Case(
        "metadata-nested-object",
        build(header(("__metadata__", obj(("k", obj(("a", "b"))))))),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
    Case(
        "metadata-string",
        build(header(("__metadata__", "format=pt"))),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
    Case(
        "metadata-list",
        build(header(("__metadata__", ["format", "pt"]))),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
    Case(
        "metadata-tensor-entry",  # a tensor may not be called __metadata__
        build(header(("__metadata__", E())), 4),
        HeaderJSONError,
        r"__metadata__ must map strings to strings",
    ),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# --- valid files built by hand ------------------------------------------------------------


def padded_header_file() -> bytes:
    """One U8 tensor with the header padded by spaces to 8-byte alignment."""
    return build(header(("t", E())), 4, pad=True)


def mutate_number(head: bytes, index: int, value: int | str) -> bytes:
    """Replace the ``index``-th run of ASCII digits in ``head`` (mod their count) by ``value``."""
    runs = list(re.finditer(rb"[0-9]+", head))
    if not runs:
        return head
    m = runs[index % len(runs)]
    return head[: m.start()] + str(value).encode() + head[m.end() :]


def split(data: bytes) -> tuple[int, bytes, bytes]:
    """``(declared header length, header bytes, payload)`` of a well-formed file."""
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n], data[8 + n :]

"""A checkpoint's index (``model.safetensors.index.json``): read, its file names checked to
stay inside the checkpoint, and compared with the headers. The rules are the same for a
directory and for a bucket prefix; only where the text and the files come from differs."""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import cast

from ..errors import (
    DuplicateKeyError,
    HeaderJSONError,
    IndexFileError,
    IndexMismatchError,
    MissingFileError,
    UnsafePathError,
)
from ._header import INDEX_NAME, INDEX_SUFFIX, TensorTable
from ._header_parse import as_dict, is_object, loads_object, reject_constant

__all__ = [
    "Index",
    "check_index_matches",
    "check_inside",
    "check_name",
    "choose_index",
    "find_index",
    "files_of_index",
    "index_of_text",
    "read_index",
]


@dataclass(frozen=True, slots=True)
class Index:
    """An index's ``weight_map`` as parallel lists.

    ``checked`` is False when the compact reader made it: it leaves repeated names and
    control characters in names to the comparison with the headers, whose names are valid.
    """

    path: Path
    names: list[str]
    files: list[str]
    checked: bool
    # Reads the text again, to name a culprit once the index and the headers disagree.
    reread: Callable[[], str] = field(compare=False, repr=False, default=lambda: "")


def find_index(root: Path) -> Path | None:
    """The directory's index: ``model.safetensors.index.json``, else its only other one
    (diffusers names theirs after the model). Several others are refused: globbing every
    shard would mix their variants (fp16 and fp32 shards of the same tensors)."""
    if (root / INDEX_NAME).exists():
        return root / INDEX_NAME
    # Regular files only, and no hidden ones (macOS leaves "._name" beside each file).
    found = sorted(
        p for p in root.glob("*" + INDEX_SUFFIX) if not p.name.startswith(".") and p.is_file()
    )
    name = choose_index([p.name for p in found], root)
    return None if name is None else root / name


def choose_index(found: list[str], root: Path) -> str | None:
    """The one index among ``found`` (sorted names other than ``model.safetensors.index.json``,
    no hidden ones); several are refused."""
    if len(found) > 1:
        names = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "")
        raise IndexFileError(
            f"{len(found)} indexes and no {INDEX_NAME} ({names}): open the index to load",
            file=root,
        )
    return found[0] if found else None


def read_index(index_path: Path) -> Index:
    return index_of_text(_index_text(index_path), index_path, lambda: _index_text(index_path))


def index_of_text(text: str, index_path: Path, reread: Callable[[], str]) -> Index:
    fast = _weight_map_compact(text)
    if fast is not None:
        return Index(index_path, *fast, checked=False, reread=reread)
    weight_map = _parse_index(text, index_path)
    names, files = list(weight_map), list(weight_map.values())
    return Index(index_path, names, files, checked=True, reread=reread)


def _index_text(index_path: Path) -> str:
    if not index_path.is_file():  # opening a FIFO would block forever
        raise IndexFileError("index is not a regular file", file=index_path)
    try:
        return index_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise IndexFileError(f"cannot read index: {err}", file=index_path) from err


def _parse_index(text: str, index_path: Path) -> dict[str, str]:
    try:
        obj = loads_object(text, file=index_path, what="index")
    except (HeaderJSONError, DuplicateKeyError) as err:
        raise IndexFileError(err.message, file=index_path) from None
    raw_map = obj.get("weight_map")
    if raw_map is None or not is_object(raw_map):
        raise IndexFileError("index has no 'weight_map' object", file=index_path)
    try:
        weight_map = as_dict(raw_map, file=index_path, what="weight_map")
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
        obj = json.loads(rest, object_pairs_hook=tuple, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not tuple:
        return None
    top = dict(obj)
    if len(top) != len(obj) or top.get("weight_map") != ():
        return None
    return names, files


def check_name(root: Path, name: str, where: Path) -> PurePosixPath:
    """A file name an index (or a listing) gives, as a relative path that stays inside
    ``root`` by its text alone: not absolute, no ``..``, not empty, no NUL."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or name == "" or "\x00" in name:
        raise UnsafePathError(
            f"file name {name!r} must be relative and stay inside {root}", file=where
        )
    return pure


def check_inside(root: Path, name: str, index_path: Path | None) -> Path:
    where = index_path if index_path is not None else root / name
    candidate = root / check_name(root, name, where)
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


def files_of_index(root: Path, index: Index) -> dict[str, Path]:
    """Each file name the index uses (in first-use order) -> the file, checked to be inside
    ``root`` and named only once."""
    index_path = index.path
    paths: dict[str, Path] = {}
    by_target: dict[Path, str] = {}
    for name in dict.fromkeys(index.files):
        candidate = check_inside(root, name, index_path)
        target = candidate.resolve()
        if target in by_target:
            raise IndexFileError(
                f"{by_target[target]!r} and {name!r} name the same file", file=index_path
            )
        by_target[target] = name
        paths[name] = candidate
    return paths


def check_index_matches(
    index: Index, expected_for: Mapping[str, Path], tensors: TensorTable
) -> None:
    """``expected_for``: each file name the index uses -> the file (:func:`files_of_index`)."""
    # Every entry is checked by C loops; Python loops run only to name a culprit. Each index
    # name found, no two naming the same tensor, as many as the headers hold, each in the
    # file the index says: then the two agree exactly.
    found = tensors.numbers_of(index.names)
    if len(found) == len(tensors) and None not in found:
        numbers = cast("list[int]", found)
        # Writers list names sorted (transformers) or in file order; either settles
        # uniqueness by a linear scan, without hashing a million entries again.
        unique = (
            index.checked
            or all(map(operator.lt, index.names, itertools.islice(index.names, 1, None)))
            or numbers == list(range(len(numbers)))
            or len(set(numbers)) == len(numbers)
        )
        file_number = {path: i for i, path in enumerate(tensors.paths)}
        expected = [file_number.get(path, -1) for path in expected_for.values()]
        of_name = dict(zip(expected_for, expected, strict=True))
        placed = list(map(tensors.files.__getitem__, numbers))
        if unique and placed == list(map(of_name.__getitem__, index.files)):
            return
    # They disagree. An index the compact reader took may also be malformed in a way it
    # left to this comparison (a repeated name): the general parser reports that first.
    weight_map = (
        dict(zip(index.names, index.files, strict=True))
        if index.checked
        else _parse_index(index.reread(), index.path)
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

"""Every error asyncslab raises.

All of them derive from :class:`AsyncSlabError`, and each also derives from the builtin a
caller would naturally catch (a malformed file or a bad plan is a ``ValueError``; a broken load
is a ``RuntimeError``). Messages say what, where and expected-vs-got; the pieces are kept as
attributes so that code can inspect them instead of parsing text.
"""

from __future__ import annotations

import copy
import os
import traceback
from typing import Any

__all__ = [
    "AsyncSlabError",
    "CheckpointError",
    "HeaderError",
    "FileTooShortError",
    "HeaderTooLargeError",
    "HeaderBoundsError",
    "HeaderEncodingError",
    "HeaderJSONError",
    "DuplicateKeyError",
    "UnknownDtypeError",
    "InvalidShapeError",
    "SizeMismatchError",
    "OffsetError",
    "PayloadSizeError",
    "IndexFileError",
    "UnsafePathError",
    "MissingFileError",
    "IndexMismatchError",
    "DuplicateTensorError",
    "PlanError",
    "PartitionError",
    "TierMapError",
    "DtypeMismatchError",
    "ShapeMismatchError",
    "CoverageError",
    "UnmatchedTensorError",
    "CaptureError",
    "LoadError",
    "ReadError",
    "ReadTimeoutError",
    "FileChangedError",
    "IncompleteLoadError",
    "DuplicateLandingError",
    "ClosedError",
    "BindError",
]


class AsyncSlabError(Exception):
    """Base of every asyncslab error.

    ``file`` and ``tensor`` say where, when known; ``details`` holds the rest (layer, expert,
    shard, slot, expected, got, ...) for code that wants to inspect rather than read.
    """

    file: str | None
    tensor: str | None
    details: dict[str, Any]

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike[str] | None = None,
        tensor: str | None = None,
        **details: Any,
    ) -> None:
        self.file = os.fspath(file) if file is not None else None
        self.tensor = tensor
        self.details = details
        self.message = message
        where = []
        if self.file is not None:
            where.append(self.file)
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(": ".join([*where, message]))

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments do not survive the default pickling, and errors cross
        # process boundaries (benchmarks, distributed ranks;
        # test_errors_keep_their_pieces_and_pickle).
        return (_rebuild, (type(self), self.message, self.file, self.tensor, self.details))


def _rebuild(
    cls: type[AsyncSlabError],
    message: str,
    file: str | None,
    tensor: str | None,
    details: dict[str, Any],
) -> AsyncSlabError:
    return cls(message, file=file, tensor=tensor, **details)


# --- reading checkpoints -----------------------------------------------------------------


class CheckpointError(AsyncSlabError, ValueError):
    """The checkpoint on disk is malformed or unsafe; nothing was loaded."""


class HeaderError(CheckpointError):
    """A safetensors header violates the format."""


class FileTooShortError(HeaderError):
    """The file is shorter than the 8-byte header length prefix."""


class HeaderTooLargeError(HeaderError):
    """The declared header length exceeds the 100,000,000-byte limit."""


class HeaderBoundsError(HeaderError):
    """The declared header length runs past the end of the file."""


class HeaderEncodingError(HeaderError):
    """The header bytes are not valid UTF-8."""


class HeaderJSONError(HeaderError):
    """The header is not JSON, not a JSON object, or an entry has the wrong structure."""


class DuplicateKeyError(HeaderError):
    """A JSON object in the header names the same key twice."""


class UnknownDtypeError(HeaderError):
    """A tensor's dtype is not one asyncslab can represent."""


class InvalidShapeError(HeaderError):
    """A tensor's shape has a negative or non-integer dimension."""


class SizeMismatchError(HeaderError):
    """Element count times item size differs from the tensor's byte length (or overflows)."""


class OffsetError(HeaderError):
    """Tensor byte ranges are not sorted and contiguous from 0 (gap, overlap, shared start)."""


class PayloadSizeError(HeaderError):
    """The payload does not end exactly at the end of the file (short, or trailing bytes)."""


class IndexFileError(CheckpointError):
    """``model.safetensors.index.json`` is malformed."""


class UnsafePathError(CheckpointError):
    """An index entry points outside the checkpoint directory (absolute, ``..``, symlink)."""


class MissingFileError(CheckpointError):
    """A file the index references does not exist or is not a regular file."""


class IndexMismatchError(CheckpointError):
    """The index and the files' headers disagree about which tensor lives where."""


class DuplicateTensorError(CheckpointError):
    """The same tensor name appears in two files."""


# --- planning ----------------------------------------------------------------------------


class PlanError(AsyncSlabError, ValueError):
    """The checkpoint does not fit the plan's rules; raised before any payload is read."""


class PartitionError(PlanError):
    """An expert partition is not exact: experts missing, duplicated or unknown."""


class TierMapError(PlanError):
    """A declared tier map is malformed or disagrees with the checkpoint's shapes."""


class DtypeMismatchError(PlanError):
    """A tensor's dtype differs from the schema's; asyncslab never casts silently."""


class ShapeMismatchError(PlanError):
    """A tensor's shape differs from its slot's."""


class CoverageError(PlanError):
    """Slots left uncovered, or covered more than once, or a tensor routed twice."""


class UnmatchedTensorError(PlanError):
    """Tensors no rule claims, under the default policy that unmatched tensors are errors."""


# --- loading -----------------------------------------------------------------------------


class CaptureError(PlanError):
    """An engine's own weight loader refused the checkpoint while asyncslab recorded where
    it puts each tensor (no payload read yet); ``tensor`` is the one it was handling."""


class LoadError(AsyncSlabError, RuntimeError):
    """A load broke; the underlying exception is the ``__cause__``. The affected units stay
    incomplete, staging buffers are released, and a retry can succeed."""


class ReadError(LoadError):
    """Reading a shard file failed (the ``OSError`` is the ``__cause__``)."""


class ReadTimeoutError(ReadError):
    """A read made no progress within the configured timeout."""


class FileChangedError(LoadError):
    """A shard file changed (size or identity) between planning and reading."""


class IncompleteLoadError(AsyncSlabError, RuntimeError):
    """A slab or unit was asked for before every one of its slots landed."""


class DuplicateLandingError(AsyncSlabError, RuntimeError):
    """A slot was written twice in one load; the plan or the pipeline is broken."""


class ClosedError(AsyncSlabError, RuntimeError):
    """The object was closed by its owner; distinct from a broken load (:class:`LoadError`)."""


class BindError(AsyncSlabError, ValueError):
    """Binding module parameters to slab views failed: unbound or mismatched parameters."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its repr when the message is empty): what an
    error raised here quotes of the one it wraps."""
    return (str(err).splitlines() or [repr(err)])[0]


def detached(error: BaseException) -> BaseException:
    """A copy of ``error`` that holds no frame: its type, message and fields, its cause and
    context detached in turn, and where it was raised kept as text in a note.

    What a long-lived object keeps of a failure: the error itself holds its traceback, the
    traceback every frame it went through, and those frames their locals; kept by the object
    that appears in those locals, it is a cycle that frees the object's memory only at the
    collector's next full pass. Pinned by
    ``test_a_dropped_slabset_whose_load_failed_frees_its_slabs_without_the_collector``.
    """
    return _detached(error, {})


def _detached(error: BaseException, seen: dict[int, BaseException]) -> BaseException:
    if id(error) in seen:
        return seen[id(error)]
    clone: BaseException
    try:
        if isinstance(error, BaseExceptionGroup):
            clone = error.derive([_detached(e, seen) for e in error.exceptions])
        else:
            clone = copy.copy(error)
    except Exception:  # an error type that cannot be rebuilt from its arguments
        clone = RuntimeError(f"{type(error).__name__}: {error}")
    seen[id(error)] = clone
    clone.__traceback__ = None
    notes = [note for note in getattr(error, "__notes__", ()) if isinstance(note, str)]
    if error.__traceback__ is not None:
        where = "".join(traceback.format_tb(error.__traceback__)).rstrip()
        notes.append(f"raised at (traceback kept as text):\n{where}")
    if notes:
        clone.__notes__ = notes
    if error.__cause__ is not None:
        clone.__cause__ = _detached(error.__cause__, seen)
    if error.__context__ is not None:
        clone.__context__ = _detached(error.__context__, seen)
    clone.__suppress_context__ = error.__suppress_context__
    return clone

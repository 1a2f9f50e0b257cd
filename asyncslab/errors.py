"""Every error asyncslab raises, one hierarchy, defined here. Each also derives from the
builtin a caller would naturally catch (``ValueError`` for bad files and plans,
``RuntimeError`` for a broken load; ``FileNotFoundError`` and ``TimeoutError`` where they
fit), and keeps what it names (``file``, ``tensor``, ``details``: layer, expert, slot,
expected, got) as attributes. The base and the categories
are also at the top level (``asyncslab.PlanError``), and ``asyncslab.distributed`` exports
``DistributedLoadError`` too. The tree below is the one place it is written
(``docs/errors.md`` shows a copy, and ``tests/test_exports.py`` checks both against the
classes):

    AsyncSlabError
    ├── CheckpointError (ValueError): a file or index that is not what it says
    │   ├── HeaderError: a malformed safetensors header, before any payload is read
    │   │   ├── FileTooShortError, HeaderTooLargeError, HeaderBoundsError,
    │   │   ├── HeaderEncodingError, HeaderJSONError, DuplicateKeyError,
    │   │   └── UnknownDtypeError, InvalidShapeError, SizeMismatchError, OffsetError,
    │   │       PayloadSizeError
    │   ├── IndexFileError, UnsafePathError, IndexMismatchError,
    │   ├── MissingFileError (FileNotFoundError)
    │   └── DuplicateTensorError
    ├── PlanError (ValueError): the checkpoint does not fit the plan, before any read
    │   ├── PartitionError, TierMapError, DtypeMismatchError, ShapeMismatchError
    │   ├── CoverageError, UnmatchedTensorError
    │   └── CaptureError: an engine's own loader refused a tensor while recording
    ├── LoadError (RuntimeError): the load itself failed
    │   ├── ReadError
    │   │   └── ReadTimeoutError (TimeoutError)
    │   ├── FileChangedError: changed since it was opened; also a CheckpointError
    │   ├── CudaError: a CUDA call failed, named with its error code
    │   └── DistributedLoadError: a load across ranks failed, raised on every rank
    ├── IncompleteLoadError (RuntimeError): a unit asked for before it is complete
    ├── DuplicateLandingError (RuntimeError)
    ├── ClosedError (RuntimeError): the SlabSet was closed
    └── BindError (ValueError): a module's parameters do not fit the slabs

Messages say what, where and expected-vs-got; the pieces are kept as attributes so that code
can inspect them instead of parsing text.
"""

from __future__ import annotations

import os
import typing

if typing.TYPE_CHECKING:  # only names of this module's own are public
    from collections.abc import Mapping
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
    "CudaError",
    "DistributedLoadError",
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


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs (a shard the index references, a model's config) does not
    exist or is not a regular file. Also a ``FileNotFoundError``, for callers that
    catch a missing file the standard way; its ``errno`` is ``None`` (an object store's
    missing key has none)."""


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


class ReadTimeoutError(ReadError, TimeoutError):
    """A read made no progress within the configured timeout. Also a ``TimeoutError``,
    as ``asyncio.timeout`` raises, so that one ``except TimeoutError`` covers both."""


class FileChangedError(LoadError, CheckpointError):
    """A shard file, or an object in object storage, changed (size, identity or ETag) between
    opening and reading. Also a :class:`CheckpointError`: the checkpoint is no longer the one
    planned, and opening it again is the remedy, not retrying the load."""


class CudaError(LoadError):
    """A CUDA call failed; ``details["call"]`` names it and ``details["code"]`` is its
    ``cudaError_t``. Where a read's pages could not be registered it is the ``__cause__`` of
    the :class:`ReadError` naming the file and range."""


class DistributedLoadError(LoadError):
    """A distributed load failed; raised on every rank alike.

    ``details["ranks"]`` lists the ranks (of the group) that failed, ``details["errors"]``
    maps each to its error text, ``details["rank"]`` is the rank that raised. On the rank
    whose own load broke, ``__cause__`` is the original error. When the cause is a lost
    rank or a timeout, the process group is unusable afterwards.
    """

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.details.get("ranks", ()))

    @property
    def errors(self) -> Mapping[int, str]:
        return dict(self.details.get("errors", {}))


class IncompleteLoadError(AsyncSlabError, RuntimeError):
    """A slab or unit was asked for before every one of its slots landed."""


class DuplicateLandingError(AsyncSlabError, RuntimeError):
    """A slot was written twice in one load; the plan or the pipeline is broken."""


class ClosedError(AsyncSlabError, RuntimeError):
    """The object was closed by its owner; distinct from a broken load (:class:`LoadError`)."""


class BindError(AsyncSlabError, ValueError):
    """Binding module parameters to slab views failed: unbound or mismatched parameters."""

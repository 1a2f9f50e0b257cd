"""Every error asyncslab raises, one hierarchy. Each also derives from the builtin a caller
would naturally catch (``ValueError`` for bad files and plans, ``RuntimeError`` for a broken
load), and keeps what it names (``file``, ``tensor``, ``details``: layer, expert, slot,
expected, got) as attributes. The base and the categories are also at the top level
(``asyncslab.PlanError``); this module has them all.

    AsyncSlabError
    ├── CheckpointError (ValueError): a file or index that is not what it says
    │   ├── HeaderError: a malformed safetensors header, before any payload is read
    │   │   ├── FileTooShortError, HeaderTooLargeError, HeaderBoundsError,
    │   │   ├── HeaderEncodingError, HeaderJSONError, DuplicateKeyError,
    │   │   └── UnknownDtypeError, InvalidShapeError, SizeMismatchError, OffsetError,
    │   │       PayloadSizeError
    │   ├── IndexFileError, UnsafePathError, MissingFileError, IndexMismatchError
    │   └── DuplicateTensorError
    ├── PlanError (ValueError): the checkpoint does not fit the plan, before any read
    │   ├── PartitionError, TierMapError, DtypeMismatchError, ShapeMismatchError
    │   ├── CoverageError, UnmatchedTensorError
    │   └── CaptureError: an engine's own loader refused a tensor while recording
    ├── LoadError (RuntimeError): the load itself failed
    │   ├── ReadError
    │   │   └── ReadTimeoutError
    │   └── FileChangedError
    ├── IncompleteLoadError (RuntimeError): a unit asked for before it is complete
    ├── DuplicateLandingError (RuntimeError)
    ├── ClosedError (RuntimeError): the SlabSet was closed
    └── BindError (ValueError): a module's parameters do not fit the slabs
"""

from ._errors import AsyncSlabError as AsyncSlabError
from ._errors import BindError as BindError
from ._errors import CaptureError as CaptureError
from ._errors import CheckpointError as CheckpointError
from ._errors import ClosedError as ClosedError
from ._errors import CoverageError as CoverageError
from ._errors import DtypeMismatchError as DtypeMismatchError
from ._errors import DuplicateKeyError as DuplicateKeyError
from ._errors import DuplicateLandingError as DuplicateLandingError
from ._errors import DuplicateTensorError as DuplicateTensorError
from ._errors import FileChangedError as FileChangedError
from ._errors import FileTooShortError as FileTooShortError
from ._errors import HeaderBoundsError as HeaderBoundsError
from ._errors import HeaderEncodingError as HeaderEncodingError
from ._errors import HeaderError as HeaderError
from ._errors import HeaderJSONError as HeaderJSONError
from ._errors import HeaderTooLargeError as HeaderTooLargeError
from ._errors import IncompleteLoadError as IncompleteLoadError
from ._errors import IndexFileError as IndexFileError
from ._errors import IndexMismatchError as IndexMismatchError
from ._errors import InvalidShapeError as InvalidShapeError
from ._errors import LoadError as LoadError
from ._errors import MissingFileError as MissingFileError
from ._errors import OffsetError as OffsetError
from ._errors import PartitionError as PartitionError
from ._errors import PayloadSizeError as PayloadSizeError
from ._errors import PlanError as PlanError
from ._errors import ReadError as ReadError
from ._errors import ReadTimeoutError as ReadTimeoutError
from ._errors import ShapeMismatchError as ShapeMismatchError
from ._errors import SizeMismatchError as SizeMismatchError
from ._errors import TierMapError as TierMapError
from ._errors import UnknownDtypeError as UnknownDtypeError
from ._errors import UnmatchedTensorError as UnmatchedTensorError
from ._errors import UnsafePathError as UnsafePathError

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

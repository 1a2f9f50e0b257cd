"""asyncslab: load checkpoints straight into the slabs an inference engine computes with.

Plan before I/O (headers only, every tensor resolved to its slot and validated), then one
pipelined async pass that writes every byte once into its final place.
"""

from ._bind import Target as Target
from ._bind import bind_module as bind_module
from ._errors import (
    AsyncSlabError as AsyncSlabError,
)
from ._errors import (
    BindError as BindError,
)
from ._errors import (
    CaptureError as CaptureError,
)
from ._errors import (
    CheckpointError as CheckpointError,
)
from ._errors import (
    ClosedError as ClosedError,
)
from ._errors import (
    CoverageError as CoverageError,
)
from ._errors import (
    DtypeMismatchError as DtypeMismatchError,
)
from ._errors import (
    DuplicateKeyError as DuplicateKeyError,
)
from ._errors import (
    DuplicateLandingError as DuplicateLandingError,
)
from ._errors import (
    DuplicateTensorError as DuplicateTensorError,
)
from ._errors import (
    FileChangedError as FileChangedError,
)
from ._errors import (
    FileTooShortError as FileTooShortError,
)
from ._errors import (
    HeaderBoundsError as HeaderBoundsError,
)
from ._errors import (
    HeaderEncodingError as HeaderEncodingError,
)
from ._errors import (
    HeaderError as HeaderError,
)
from ._errors import (
    HeaderJSONError as HeaderJSONError,
)
from ._errors import (
    HeaderTooLargeError as HeaderTooLargeError,
)
from ._errors import (
    IncompleteLoadError as IncompleteLoadError,
)
from ._errors import (
    IndexFileError as IndexFileError,
)
from ._errors import (
    IndexMismatchError as IndexMismatchError,
)
from ._errors import (
    InvalidShapeError as InvalidShapeError,
)
from ._errors import (
    LoadError as LoadError,
)
from ._errors import (
    MissingFileError as MissingFileError,
)
from ._errors import (
    OffsetError as OffsetError,
)
from ._errors import (
    PartitionError as PartitionError,
)
from ._errors import (
    PayloadSizeError as PayloadSizeError,
)
from ._errors import (
    PlanError as PlanError,
)
from ._errors import (
    ReadError as ReadError,
)
from ._errors import (
    ReadTimeoutError as ReadTimeoutError,
)
from ._errors import (
    ShapeMismatchError as ShapeMismatchError,
)
from ._errors import (
    SizeMismatchError as SizeMismatchError,
)
from ._errors import (
    TierMapError as TierMapError,
)
from ._errors import (
    UnknownDtypeError as UnknownDtypeError,
)
from ._errors import (
    UnmatchedTensorError as UnmatchedTensorError,
)
from ._errors import (
    UnsafePathError as UnsafePathError,
)
from ._format import Checkpoint as Checkpoint
from ._format import ShardFile as ShardFile
from ._format import TensorInfo as TensorInfo
from ._loader import LoadOptions as LoadOptions
from ._loader import LoadStatistics as LoadStatistics
from ._loader import SlabSet as SlabSet
from ._loader import load as load
from ._moe import ExpertPartition as ExpertPartition
from ._moe import TieredMoE as TieredMoE
from ._moe import load_tier_map as load_tier_map
from ._plan import Plan as Plan
from ._plan import plan as plan
from ._rules import Dense as Dense
from ._rules import RowSlice as RowSlice
from ._rules import Stack as Stack
from ._rules import default_rules as default_rules
from ._synthetic import SyntheticCheckpoint as SyntheticCheckpoint
from ._synthetic import SyntheticSpec as SyntheticSpec
from ._synthetic import spec_for_size as spec_for_size
from ._synthetic import write_synthetic as write_synthetic
from ._vocab import Claim as Claim
from ._vocab import Location as Location
from ._vocab import Route as Route
from ._vocab import Rule as Rule
from ._vocab import SlabSpec as SlabSpec
from ._vocab import make_route as make_route

__version__ = "0.1.0"

__all__ = [
    "AsyncSlabError",
    "BindError",
    "CaptureError",
    "Checkpoint",
    "CheckpointError",
    "Claim",
    "ClosedError",
    "CoverageError",
    "Dense",
    "DtypeMismatchError",
    "DuplicateKeyError",
    "DuplicateLandingError",
    "DuplicateTensorError",
    "ExpertPartition",
    "FileChangedError",
    "FileTooShortError",
    "HeaderBoundsError",
    "HeaderEncodingError",
    "HeaderError",
    "HeaderJSONError",
    "HeaderTooLargeError",
    "IncompleteLoadError",
    "IndexFileError",
    "IndexMismatchError",
    "InvalidShapeError",
    "LoadError",
    "LoadOptions",
    "LoadStatistics",
    "Location",
    "MissingFileError",
    "OffsetError",
    "PartitionError",
    "PayloadSizeError",
    "Plan",
    "PlanError",
    "ReadError",
    "ReadTimeoutError",
    "Route",
    "RowSlice",
    "Rule",
    "ShapeMismatchError",
    "ShardFile",
    "SizeMismatchError",
    "SlabSet",
    "SlabSpec",
    "Stack",
    "SyntheticCheckpoint",
    "SyntheticSpec",
    "Target",
    "TensorInfo",
    "TierMapError",
    "TieredMoE",
    "UnknownDtypeError",
    "UnmatchedTensorError",
    "UnsafePathError",
    "bind_module",
    "default_rules",
    "load",
    "load_tier_map",
    "make_route",
    "plan",
    "spec_for_size",
    "write_synthetic",
]

"""asyncslab: load checkpoints straight into the slabs an inference engine computes with.

Plan before I/O (headers only, every tensor resolved to its slot and validated), then one
pipelined async pass that writes every byte once into its final place.
"""

from ._errors import (
    AsyncSlabError as AsyncSlabError,
    BindError as BindError,
    CheckpointError as CheckpointError,
    ClosedError as ClosedError,
    CoverageError as CoverageError,
    DtypeMismatchError as DtypeMismatchError,
    DuplicateKeyError as DuplicateKeyError,
    DuplicateLandingError as DuplicateLandingError,
    DuplicateTensorError as DuplicateTensorError,
    FileChangedError as FileChangedError,
    FileTooShortError as FileTooShortError,
    HeaderBoundsError as HeaderBoundsError,
    HeaderEncodingError as HeaderEncodingError,
    HeaderError as HeaderError,
    HeaderJSONError as HeaderJSONError,
    HeaderTooLargeError as HeaderTooLargeError,
    IncompleteLoadError as IncompleteLoadError,
    IndexFileError as IndexFileError,
    IndexMismatchError as IndexMismatchError,
    InvalidShapeError as InvalidShapeError,
    LoadError as LoadError,
    MissingFileError as MissingFileError,
    OffsetError as OffsetError,
    PartitionError as PartitionError,
    PayloadSizeError as PayloadSizeError,
    PlanError as PlanError,
    ReadError as ReadError,
    ReadTimeoutError as ReadTimeoutError,
    ShapeMismatchError as ShapeMismatchError,
    SizeMismatchError as SizeMismatchError,
    TierMapError as TierMapError,
    UnknownDtypeError as UnknownDtypeError,
    UnmatchedTensorError as UnmatchedTensorError,
    UnsafePathError as UnsafePathError,
)
from ._bind import bind_module as bind_module
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
from ._plan import Claim as Claim
from ._plan import Location as Location
from ._plan import Plan as Plan
from ._plan import Route as Route
from ._plan import Rule as Rule
from ._plan import SlabSpec as SlabSpec
from ._plan import plan as plan
from ._rules import Dense as Dense
from ._rules import Stack as Stack
from ._rules import default_rules as default_rules
from ._synthetic import SyntheticCheckpoint as SyntheticCheckpoint
from ._synthetic import SyntheticSpec as SyntheticSpec
from ._synthetic import write_synthetic as write_synthetic

__version__ = "0.1.0"

__all__ = [
    "AsyncSlabError",
    "BindError",
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
    "Rule",
    "ShapeMismatchError",
    "ShardFile",
    "SizeMismatchError",
    "SlabSet",
    "SlabSpec",
    "Stack",
    "SyntheticCheckpoint",
    "SyntheticSpec",
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
    "plan",
    "write_synthetic",
]

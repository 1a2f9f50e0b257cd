"""asyncslab: load checkpoints straight into the slabs an inference engine computes with.

Plan before I/O (headers only, every tensor resolved to its slot and validated), then one
pipelined async pass that writes every byte once into its final place.

The face, by stage: open a ``Checkpoint``; ``plan`` it with the built-in rules (rules of
your own: ``asyncslab.rules``); ``load`` it into a ``SlabSet``; ``bind_module`` the slabs.
Every error: ``asyncslab.errors`` (the base and the categories are here too). The synthetic
checkpoint writer and a verifier: ``asyncslab.testing``. Beside: ``asyncslab.distributed``,
``asyncslab.vllm``.
"""

from . import errors as errors
from . import rules as rules
from ._public import publish as _publish
from .checkpoint import Checkpoint, ShardFile, TensorInfo
from .engines import Target, bind_module
from .errors import (
    AsyncSlabError,
    BindError,
    CheckpointError,
    ClosedError,
    DuplicateLandingError,
    IncompleteLoadError,
    LoadError,
    PlanError,
)
from .loading import LoadOptions, LoadStatistics, SlabSet, load
from .planning import (
    Dense,
    Location,
    Plan,
    RowSlice,
    Stack,
    TieredMoE,
    default_rules,
    load_tier_map,
    plan,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncSlabError",
    "BindError",
    "Checkpoint",
    "CheckpointError",
    "ClosedError",
    "Dense",
    "DuplicateLandingError",
    "IncompleteLoadError",
    "LoadError",
    "LoadOptions",
    "LoadStatistics",
    "Location",
    "Plan",
    "PlanError",
    "RowSlice",
    "ShardFile",
    "SlabSet",
    "Stack",
    "Target",
    "TensorInfo",
    "TieredMoE",
    "bind_module",
    "default_rules",
    "load",
    "load_tier_map",
    "plan",
]

_publish(globals())

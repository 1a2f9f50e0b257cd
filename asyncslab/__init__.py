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
from ._bind import Target, bind_module
from ._errors import (
    AsyncSlabError,
    BindError,
    CheckpointError,
    ClosedError,
    DuplicateLandingError,
    IncompleteLoadError,
    LoadError,
    PlanError,
)
from ._format import Checkpoint, ShardFile, TensorInfo
from ._loader import LoadOptions, LoadStatistics, SlabSet, load
from ._moe import TieredMoE, load_tier_map
from ._plan import Plan, plan
from ._rules import Dense, RowSlice, Stack, default_rules
from ._vocab import Location

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

"""The planning stage: the plan vocabulary, the rules, tiered MoE partitions, a whole
checkpoint planned.

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._moe import EXL3_EXPERT_PATTERN as EXL3_EXPERT_PATTERN
from ._moe import TieredMoE as TieredMoE
from ._partition import ExpertPartition as ExpertPartition
from ._partition import load_tier_map as load_tier_map
from ._plan import Plan as Plan
from ._plan import plan as plan
from ._routes import RouteTable as RouteTable
from ._routes import numbers_of as numbers_of
from ._routes import route_column as route_column
from ._rules import Dense as Dense
from ._rules import RowSlice as RowSlice
from ._rules import Stack as Stack
from ._rules import default_rules as default_rules
from ._vocabulary import Claim as Claim
from ._vocabulary import Location as Location
from ._vocabulary import Route as Route
from ._vocabulary import Rule as Rule
from ._vocabulary import SlabSpec as SlabSpec
from ._vocabulary import make_route as make_route
from ._vocabulary import unit_of_layer as unit_of_layer

__all__ = [
    "Claim",
    "Dense",
    "EXL3_EXPERT_PATTERN",
    "ExpertPartition",
    "Location",
    "Plan",
    "Route",
    "RouteTable",
    "RowSlice",
    "Rule",
    "SlabSpec",
    "Stack",
    "TieredMoE",
    "default_rules",
    "load_tier_map",
    "make_route",
    "numbers_of",
    "plan",
    "route_column",
    "unit_of_layer",
]

"""Writing a rule of your own: a rule is any object with ``claim(checkpoint, pending) ->
Claim``, returning the ``SlabSpec``s to allocate and a ``Route`` per tensor it places
(``make_route`` builds one), plus the names it only checks or skips; ``asyncslab.plan``
then checks the whole result. The built-in rules are here too. See ``docs/plans.md``.
"""

from ._moe import ExpertPartition as ExpertPartition
from ._moe import TieredMoE as TieredMoE
from ._moe import load_tier_map as load_tier_map
from ._rules import Dense as Dense
from ._rules import RowSlice as RowSlice
from ._rules import Stack as Stack
from ._rules import default_rules as default_rules
from ._vocab import Claim as Claim
from ._vocab import Location as Location
from ._vocab import Route as Route
from ._vocab import Rule as Rule
from ._vocab import SlabSpec as SlabSpec
from ._vocab import make_route as make_route

__all__ = [
    "Claim",
    "Dense",
    "ExpertPartition",
    "Location",
    "Route",
    "RowSlice",
    "Rule",
    "SlabSpec",
    "Stack",
    "TieredMoE",
    "default_rules",
    "load_tier_map",
    "make_route",
]

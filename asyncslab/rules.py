"""Writing a rule of your own: a rule is any object with ``claim(checkpoint, pending) ->
Claim``, returning the ``SlabSpec``s to allocate and a ``Route`` per tensor it places
(``make_route`` builds one), plus the names it only checks or skips; ``asyncslab.plan``
then checks the whole result. The built-in rules are here too. See ``docs/plans.md``.
"""

from ._public import publish as _publish
from .planning import Claim as Claim
from .planning import Dense as Dense
from .planning import ExpertPartition as ExpertPartition
from .planning import Location as Location
from .planning import Route as Route
from .planning import RowSlice as RowSlice
from .planning import Rule as Rule
from .planning import SlabSpec as SlabSpec
from .planning import Stack as Stack
from .planning import TieredMoE as TieredMoE
from .planning import default_rules as default_rules
from .planning import load_tier_map as load_tier_map
from .planning import make_route as make_route

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

_publish(globals())

"""Loading one checkpoint across the ranks of a ``torch.distributed`` process group:
rank-aware plans, optional read-once-and-share, and one coordinated readiness.
See ``docs/distributed.md``."""

from .._public import publish as _publish
from ..errors import DistributedLoadError as DistributedLoadError
from ._session import DEFAULT_ROWS as DEFAULT_ROWS
from ._session import MODES as MODES
from ._session import DistributedLoad as DistributedLoad
from ._session import Mode as Mode
from ._session import RankReport as RankReport
from ._session import RoundRobinExperts as RoundRobinExperts
from ._session import load as load
from ._session import rank_plan as rank_plan

__all__ = [
    "DEFAULT_ROWS",
    "MODES",
    "DistributedLoad",
    "DistributedLoadError",
    "Mode",
    "RankReport",
    "RoundRobinExperts",
    "load",
    "rank_plan",
]

_publish(globals())

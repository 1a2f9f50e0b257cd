"""Loading one checkpoint across the ranks of a ``torch.distributed`` process group:
rank-aware plans, optional read-once-and-share, and one coordinated readiness.
See ``docs/distributed.md``."""

from .._public import publish as _publish
from ..errors import DistributedLoadError as DistributedLoadError
from ._agreement import DistributedLoad as DistributedLoad
from ._agreement import RankReport as RankReport
from ._rank_plan import DEFAULT_ROWS as DEFAULT_ROWS
from ._rank_plan import MODES as MODES
from ._rank_plan import Mode as Mode
from ._rank_plan import RoundRobinExperts as RoundRobinExperts
from ._rank_plan import rank_plan as rank_plan
from ._session import load as load

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

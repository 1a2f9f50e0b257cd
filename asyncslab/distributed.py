"""Loading one checkpoint across the ranks of a ``torch.distributed`` process group:
rank-aware plans, optional read-once-and-share, and one coordinated readiness.
See ``docs/distributed.md``."""

from ._distributed import DEFAULT_ROWS as DEFAULT_ROWS
from ._distributed import MODES as MODES
from ._distributed import DistributedLoad as DistributedLoad
from ._distributed import DistributedLoadError as DistributedLoadError
from ._distributed import Mode as Mode
from ._distributed import RankReport as RankReport
from ._distributed import RoundRobinExperts as RoundRobinExperts
from ._distributed import load as load
from ._distributed import rank_plan as rank_plan

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

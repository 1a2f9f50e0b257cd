"""The loading stage: the read schedule, positional reads, transfer strategies, the sink,
the tracker, the slabs.

A load that moves its bytes itself (the distributed load's shared reads) drives one
through :class:`Loads` (``SlabSet.loads``): ``settled()``, ``begin_shared()``, ``closed``,
``void()``; the :class:`Load` it is handed lands bytes and ends as any other.

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._copy import direct_scatters as direct_scatters
from ._copy import host_copy as host_copy
from ._load import Load as Load
from ._load import map_checked as map_checked
from ._load import open_checked as open_checked
from ._loads import Loads as Loads
from ._memory import slab_layout as slab_layout
from ._options import LoadOptions as LoadOptions
from ._options import LoadStatistics as LoadStatistics
from ._options import ProgressCallback as ProgressCallback
from ._pinned import pinned_bytes as pinned_bytes
from ._read import byte_view as byte_view
from ._read import pread_scatter as pread_scatter
from ._read import scatter as scatter
from ._schedule import schedule as schedule
from ._sink import Sink as Sink
from ._slabs import SlabSet as SlabSet
from ._slabs import load as load
from ._strategy_mapped import PopulateRegistry as PopulateRegistry
from ._strategy_remote import presigns as presigns
from ._strategy_remote import reads_objects as reads_objects
from ._strategy_remote import response_tensor as response_tensor

__all__ = [
    "Load",
    "Loads",
    "LoadOptions",
    "LoadStatistics",
    "PopulateRegistry",
    "ProgressCallback",
    "Sink",
    "SlabSet",
    "byte_view",
    "direct_scatters",
    "host_copy",
    "load",
    "map_checked",
    "open_checked",
    "pinned_bytes",
    "presigns",
    "pread_scatter",
    "reads_objects",
    "response_tensor",
    "scatter",
    "schedule",
    "slab_layout",
]

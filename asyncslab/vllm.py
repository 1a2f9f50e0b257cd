"""vLLM's load format ``asyncslab`` (``pip install "asyncslab[vllm]"``, then
``vllm serve MODEL --load-format asyncslab``). Importing this module imports vLLM.
See ``docs/vllm.md``."""

from ._public import publish as _publish
from .engines._vllm import LOAD_FORMAT as LOAD_FORMAT
from .engines._vllm import AsyncSlabLoader as AsyncSlabLoader
from .engines._vllm import LoadReport as LoadReport
from .engines._vllm import ReloadReport as ReloadReport
from .engines._vllm import options_from_config as options_from_config
from .engines._vllm import register as register

__all__ = [
    "LOAD_FORMAT",
    "AsyncSlabLoader",
    "LoadReport",
    "ReloadReport",
    "options_from_config",
    "register",
]

_publish(globals())

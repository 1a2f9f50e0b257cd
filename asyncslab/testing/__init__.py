"""For tests and benchmarks: a synthetic EXL3-like mixed-tier MoE checkpoint, written with
the real ``safetensors`` library (``write_synthetic(dir, SyntheticSpec(...))``, or
``spec_for_size(bytes)``), and ``verify_slabs``, which compares every loaded tensor with
what ``safetensors`` reads, byte for byte. Not imported by ``import asyncslab``.
"""

from .._public import publish as _publish
from ._sizing import spec_for_size as spec_for_size
from ._synthetic import SyntheticCheckpoint as SyntheticCheckpoint
from ._synthetic import SyntheticSpec as SyntheticSpec
from ._synthetic import write_synthetic as write_synthetic
from ._verify import VerifyResult as VerifyResult
from ._verify import verify_slabs as verify_slabs

__all__ = [
    "SyntheticCheckpoint",
    "SyntheticSpec",
    "VerifyResult",
    "spec_for_size",
    "verify_slabs",
    "write_synthetic",
]

_publish(globals())

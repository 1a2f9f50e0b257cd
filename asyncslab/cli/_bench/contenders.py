"""What ``asyncslab bench`` compares: the contenders, the page-cache and memory modes, which
contender runs in which mode, and the limits a run is checked against."""

from __future__ import annotations

from .worker import PEERS

__all__ = [
    "APPLICABLE",
    "COLD_CACHED_MAX",
    "CONTENDERS",
    "GiB",
    "MANY_SMALL_CONTENDERS",
    "MANY_SMALL_VERIFY",
    "MEMORY_FACTOR",
    "MODES",
    "MiB",
    "VERIFY_ALL",
    "human",
]

MiB = 1 << 20
GiB = 1 << 30

MODES = ("warm-fresh", "warm-pretouched", "cold")
CONTENDERS = (
    "old-path",
    "old-path-mmap",
    "direct-copy",
    "asyncslab",
    "bound-1",
    "bound-N",
    *PEERS,
    "first-touch-1",
    "first-touch-N",
)
# Which contenders make sense in which mode; the others print "-".
APPLICABLE = {
    "warm-fresh": set(CONTENDERS),
    "warm-pretouched": {"direct-copy", "asyncslab", "bound-1", "bound-N"},
    "cold": set(CONTENDERS) - {"first-touch-1", "first-touch-N"},
}
MANY_SMALL_CONTENDERS = ("old-path", "direct-copy", "asyncslab", "bound-N", *PEERS)
# How much anonymous memory a contender holds at its peak, in multiples of the slab bytes.
# fastsafetensors reads whole files into a buffer of its own, then the slabs are filled.
MEMORY_FACTOR = {"old-path": 2.0, "fastsafetensors": 2.0, "fastsafetensors-buffered-N": 2.0}

# A cold run whose drop left more of the shards cached than this is not a cold run.
COLD_CACHED_MAX = 0.02
VERIFY_ALL = -1
MANY_SMALL_VERIFY = 2000


def human(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"

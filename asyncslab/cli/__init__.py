"""The ``asyncslab`` command: demo, inspect, load, bench.

Internal. What other stages use is imported from here, never from the private modules;
the public names are re-exported by ``asyncslab`` and its public modules."""

from ._main import main as main

__all__ = [
    "main",
]

"""The ``asyncslab`` command: demo, inspect, load, bench.

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

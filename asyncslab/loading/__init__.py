"""The loading stage: the read schedule, positional reads, transfer strategies, the sink,
the tracker, the slabs.

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

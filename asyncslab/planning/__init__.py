"""The planning stage: the plan vocabulary, the rules, tiered MoE partitions, a whole
checkpoint planned.

Internal: the public names are re-exported by ``asyncslab`` and its public modules."""

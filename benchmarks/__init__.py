"""The repository's benchmarks, each a module run from the repository root:
``python -m benchmarks.vllm_bench ...`` (``benchmarks/README.md`` lists them)."""

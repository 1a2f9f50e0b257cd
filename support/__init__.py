"""What the tests and the benchmarks share, imported by both and shipped by neither: the
object stores' servers and the fault proxy, fault and fuzzing helpers, and the vLLM
checkpoint writers. Importable from the repository root (pytest's ``pythonpath``,
``python -m benchmarks.vllm_bench``)."""

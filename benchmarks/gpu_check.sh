#!/usr/bin/env bash
# The whole device check as one short run, from the repository root of a machine with one
# CUDA device: the CUDA tests (and the CPU load and capture tests beside them), the
# transformers case (a small MoE loaded onto the GPU by transformers' own from_pretrained and
# by asyncslab.transformers, compared bit for bit and timed), then the GPU benchmark.
# Results land in $RESULTS/ (default: $OUT, the folder a remote run brings back, else
# gpu-results/). If pytest-asyncio (>= 1.0, with its loop-factories hook) is missing there,
# put its wheel in .whl/ first (pip download --no-deps -d .whl pytest-asyncio==1.5.0) and
# carry it. Each step has a time limit (all three within one 10-minute command), so that a
# hang in one still leaves the others' results; the benchmark's JSON is rewritten after each
# row. The transformers case (skipped where transformers is not importable): TF_MODELS
# (default qwen3moe: 128 experts a layer) written with --quick (small; TF_QUICK=0 for the
# benchmark's full sizes, GBs to write), TF_ROUNDS rounds (default 3), TF_TIMEOUT seconds
# (default 90); it exits 1 if a tensor or the logits differ. Where vLLM is importable, a
# block-wise FP8 MoE is served with both load formats (VLLM_FP8_TIMEOUT, default 240 s), and
# VLLM_BENCH_TIMEOUT=N (seconds; default 0: skipped, it does not fit the same 10 minutes)
# adds benchmarks/vllm_bench.py --device cuda, one round; VLLM_MODEL_TIMEOUT=N (default 0:
# skipped) its get_model path, 3 rounds, each layer processed after the load (the default)
# and as it lands (asyncslab-landed), beside auto.
set -uo pipefail
results=${RESULTS:-${OUT:-gpu-results}}
mkdir -p "$results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# An older pytest-asyncio lacks the hook tests/conftest.py implements: pytest would refuse
# to start. pytest-timeout is needed too (pyproject's strict config names its option).
if ! python3 -c "import pytest_asyncio.plugin as p; assert hasattr(p, 'PytestAsyncioSpecs')" \
    2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/asyncslab-site .whl/*.whl \
    && export PYTHONPATH="/tmp/asyncslab-site:$PYTHONPATH"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 -c "
from importlib.metadata import PackageNotFoundError, version
for name in ('pytest', 'pytest-asyncio', 'pytest-timeout', 'safetensors', 'numpy', 'uvloop'):
    try:
        print(name, version(name))
    except PackageNotFoundError:
        print(name, 'MISSING')"
  nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$results/machine.txt"
python3 -c "import pytest_timeout" 2>/dev/null || echo "pytest-timeout missing: the tests will not start"
timeout -k 10 "${TEST_TIMEOUT:-200}" python3 -m pytest tests/loading/test_cuda.py tests/loading/test_load.py tests/engines/test_capture.py -q \
  tests/distributed/test_distributed.py::test_shared_and_own_loads_into_cuda_slabs_are_bit_identical \
  -p no:cacheprovider -rs 2>&1 | tee "$results/pytest_cuda.log"
tf_quick=--quick
[ "${TF_QUICK:-1}" = 0 ] && tf_quick=
if python3 -c "import transformers" 2>/dev/null; then
  timeout -k 10 "${TF_TIMEOUT:-90}" python3 -m benchmarks.transformers_bench --device-check cuda \
    --models "${TF_MODELS:-qwen3moe}" $tf_quick --rounds "${TF_ROUNDS:-3}" \
    --workdir /tmp/asyncslab-tf-gpu --json "$results/transformers_cuda.json" 2>&1 \
    | tee "$results/transformers_cuda.log"
else
  echo "transformers is not importable here: the transformers case skipped" \
    | tee "$results/transformers_cuda.log"
fi
timeout -k 10 "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.gpu_bench --size "${SIZE:-20GiB}" \
  --json "$results/gpu_bench.json" 2>&1 | tee "$results/gpu_bench.log"
# Block-wise FP8 MoE end to end in vLLM against auto (greedy tokens, the bytes after
# load_weights), where vLLM is importable; it exits 1 if anything differs.
if python3 -c "import vllm" 2>/dev/null; then
  timeout -k 10 "${VLLM_FP8_TIMEOUT:-240}" python3 -m benchmarks.vllm_fp8_check \
    --json "$results/vllm_fp8.json" 2>&1 | tee "$results/vllm_fp8.log"
else
  echo "vLLM is not importable here: the FP8 end-to-end check skipped" | tee "$results/vllm_fp8.log"
fi
if [ "${VLLM_BENCH_TIMEOUT:-0}" -gt 0 ]; then
  if python3 -c "import vllm" 2>/dev/null; then
    timeout -k 10 "$VLLM_BENCH_TIMEOUT" python3 -m benchmarks.vllm_bench --device cuda \
      --rounds 1 --json "$results/vllm_bench.json" 2>&1 | tee "$results/vllm_bench.log"
  else
    echo "vLLM is not importable here: benchmarks/vllm_bench.py skipped" | tee "$results/vllm_bench.log"
  fi
fi
if [ "${VLLM_MODEL_TIMEOUT:-0}" -gt 0 ]; then
  if python3 -c "import vllm" 2>/dev/null; then
    timeout -k 10 "$VLLM_MODEL_TIMEOUT" python3 -m benchmarks.vllm_bench --device cuda \
      --paths model --rounds 3 --only auto,asyncslab,asyncslab-landed \
      --json "$results/vllm_model.json" 2>&1 | tee "$results/vllm_model.log"
  else
    echo "vLLM is not importable here: the get_model path skipped" | tee "$results/vllm_model.log"
  fi
fi

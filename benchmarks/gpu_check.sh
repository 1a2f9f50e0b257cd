#!/usr/bin/env bash
# The whole device check as one short run, from the repository root of a machine with one
# CUDA device: the CUDA tests (and the CPU load tests beside them), then the GPU benchmark.
# Results land in ${RESULTS:-gpu-results}/. If pytest-asyncio is missing there, put its
# wheel in .whl/ first (pip download --no-deps -d .whl pytest-asyncio==1.5.0). Each step has
# a time limit, so that a hang in one still leaves the other's results.
set -uo pipefail
results=${RESULTS:-gpu-results}
mkdir -p "$results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import pytest_asyncio" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/asyncslab-site .whl/*.whl \
    && export PYTHONPATH="/tmp/asyncslab-site:$PYTHONPATH"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$results/machine.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_cuda.py tests/test_load.py -q \
  -p no:cacheprovider -rs 2>&1 | tee "$results/pytest_cuda.log"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/gpu_bench.py --size "${SIZE:-20GiB}" \
  --json "$results/gpu_bench.json" 2>&1 | tee "$results/gpu_bench.log"

#!/usr/bin/env bash
# The whole device check as one short run, from the repository root of a machine with one
# CUDA device: the CUDA tests (and the CPU load tests beside them), then the GPU benchmark.
# Results land in ${RESULTS:-gpu-results}/. If pytest-asyncio is missing there, put its
# wheel in .whl/ first (pip download --no-deps -d .whl pytest-asyncio==1.5.0).
set -uo pipefail
results=${RESULTS:-gpu-results}
mkdir -p "$results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import pytest_asyncio" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/asyncslab-site .whl/*.whl \
    && export PYTHONPATH="/tmp/asyncslab-site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$results/gpu.txt"
python3 -m pytest tests/test_cuda.py tests/test_load.py -q -p no:cacheprovider -rs 2>&1 \
  | tee "$results/pytest_cuda.log"
python3 benchmarks/gpu_bench.py --size "${SIZE:-20GiB}" --json "$results/gpu_bench.json" 2>&1 \
  | tee "$results/gpu_bench.log"

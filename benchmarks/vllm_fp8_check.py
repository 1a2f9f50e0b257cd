"""Block-wise FP8 MoE end to end in vLLM on a GPU, ``--load-format asyncslab`` against
``auto`` (``benchmarks/gpu_check.sh`` runs it where vLLM is installed).

    python -m benchmarks.vllm_fp8_check [--workdir DIR] [--json OUT]

Writes a tiny Qwen3-MoE in DeepSeek-V3's block-wise FP8 layout
(``support/quantized_models.py``), then serves it with each format in turn
(``tests/engines/vllm_worker.py generate``: vLLM's own engine, its CUDA FP8 kernels): every
parameter byte after ``load_weights`` must equal ``auto``'s, every parameter keep its
address, and the greedy tokens after vLLM's processing equal ``auto``'s. Exits 1 if not.
On a CPU without AMX vLLM has no kernel for the format: the tests compare its bytes there
(``tests/engines/test_vllm_quantized.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default=tempfile.mkdtemp(prefix="asyncslab-fp8-"))
    ap.add_argument("--json")
    args = ap.parse_args()
    from support.quantized_models import write_fp8_block_model

    work = Path(args.workdir).resolve()  # the worker runs from the repository root
    model = write_fp8_block_model(work / "fp8-block-qwen3_moe", "qwen3_moe")
    cases = work / "cases.json"
    cases.write_text(json.dumps([{"name": "fp8-block-moe", "model": str(model)}]))
    out = work / "out.json"
    worker = [sys.executable, "-m", "tests.engines.vllm_worker"]  # the tests' vLLM worker
    run = subprocess.run([*worker, "generate", str(cases), str(out)], cwd=ROOT, check=False)
    if run.returncode != 0:
        print(f"the vLLM worker failed (exit {run.returncode})")
        return 1
    result = json.loads(out.read_text())["fp8-block-moe"]
    tokens = result["tokens"]
    same_tokens = tokens["asyncslab"] == tokens["auto"]
    print(f"greedy tokens equal: {same_tokens} ({tokens['auto']})")
    print(f"parameters whose bytes differ after load_weights: {result['differ']}")
    print(f"pointers kept: {result['pointers_kept']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = same_tokens and result["differ"] == [] and all(result["pointers_kept"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tiny random ModelOpt checkpoints, written by NVIDIA's ModelOpt library itself (0.42, the
last release that installs beside vLLM's CPU build): a seeded transformers model (a Qwen3-MoE
or a dense Llama, :data:`~tests.engines.compressed_models.ARCHS`, the experts unfused as
there) quantized by ``mtq.quantize`` with one of its default configs (``FP8_DEFAULT_CFG``,
``NVFP4_DEFAULT_CFG``) and one calibration forward pass over random tokens, then saved by
``export_hf_checkpoint``: the shard, ``config.json`` with its ``quantization_config`` and the
legacy ``hf_quant_config.json``.

Two things ModelOpt 0.42 needs on this machine, neither changing what it writes:
- ``export_hf_checkpoint`` asks CUDA's device capability before it asks whether the weight
  is on CUDA, to pick TensorRT-LLM's FP4 kernel: on a CPU build of torch that question
  raises. :func:`_export` answers it "no", which is the answer for a CPU tensor.
- Its MoE calibration sets the block's ``top_k`` to ``num_experts`` so that every expert
  sees every token; transformers 5 keeps ``top_k`` on the router. The unfused experts
  already see every token, so the block gets the two attributes for ModelOpt to set.

transformers 5's MoE routers are not ``nn.Linear``: ModelOpt neither quantizes nor lists
them, where its default configs exclude ``*mlp.gate.*`` and a real export lists the routers
among the excluded modules. vLLM's routers are linear layers that would otherwise expect
quantized weights, so :func:`_exclude_routers` adds them to both configs, as the export does.

The writes run in a process of their own (:func:`write_modelopt_models`): ModelOpt registers
its quantized stand-ins for transformers' classes when imported, which the test process that
loads transformers models elsewhere should not carry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]

#: The algorithm names of ModelOpt's ``quant_algo``, by the config ``mtq`` quantizes with.
CONFIGS = {"FP8": "FP8_DEFAULT_CFG", "NVFP4": "NVFP4_DEFAULT_CFG"}


def write_modelopt_models(root: Path, models: dict[str, tuple[str, str]]) -> dict[str, Path]:
    """Write each ``name -> (arch, algo)`` of ``models`` under ``root / name`` (``algo``: a
    key of :data:`CONFIGS`), in one child process; the written folders, by name."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "modelopt-models.json"
    spec.write_text(json.dumps({n: [str(root / n), *m] for n, m in models.items()}))
    run = subprocess.run(
        [sys.executable, "-m", "tests.engines.modelopt_models", str(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    return {name: root / name for name in models}


def write_modelopt_model(root: Path, arch: str, algo: str, *, seed: int = 0) -> Path:
    """In this process: model ``arch`` quantized by ModelOpt's ``algo`` into ``root``."""
    import modelopt.torch.quantization as mtq
    import transformers

    from support.vllm_models import _tokenizer
    from tests.engines.compressed_models import ARCHS, float_model

    model = float_model(arch, seed)
    model.config.architectures = [ARCHS[arch][0]]  # the export reads it; a config lacks it
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.top_k = model.config.num_experts_per_tok
            layer.mlp.num_experts = model.config.num_experts

    def calibrate(m: Any) -> None:
        tokens = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(seed))
        m(tokens)

    with torch.no_grad():
        model = mtq.quantize(model, getattr(mtq, CONFIGS[algo]), calibrate)
        _export(model, root)
    if arch == "qwen3_moe":
        _exclude_routers(root, model.config.num_hidden_layers)
    _tokenizer(root, transformers)
    return root


def _export(model: Any, root: Path) -> None:
    from modelopt.torch.export import export_hf_checkpoint

    # See the module's docstring: the CUDA question a CPU weight would answer "no" to.
    with mock.patch(
        "modelopt.torch.quantization.qtensor.nvfp4_tensor.fp4_compatible", return_value=False
    ):
        export_hf_checkpoint(model, export_dir=root)


def _exclude_routers(root: Path, layers: int) -> None:
    routers = [f"model.layers.{i}.mlp.gate" for i in range(layers)]
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] += routers
    config_path.write_text(json.dumps(config, indent=2))
    legacy_path = root / "hf_quant_config.json"
    legacy = json.loads(legacy_path.read_text())
    legacy["quantization"]["exclude_modules"] += routers
    legacy_path.write_text(json.dumps(legacy, indent=2))


if __name__ == "__main__":
    for folder, arch, algo in json.loads(Path(sys.argv[1]).read_text()).values():
        write_modelopt_model(Path(folder), arch, algo)

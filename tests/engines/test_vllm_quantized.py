"""The field's quantized checkpoints through ``--load-format asyncslab``, against ``auto``
in vLLM's CPU build: every parameter byte after ``load_weights`` equal, every parameter in
vLLM's own memory, and where the CPU build serves a format, the greedy tokens equal.

The checkpoints are written at test time in each format's on-disk layout
(``quantized_models.py`` by hand: block-wise and per-tensor FP8, ModelOpt FP8 and NVFP4,
gpt-oss's MXFP4; ``compressed_models.py`` by the compressed-tensors library itself), each on
a tiny Qwen3-MoE and a dense Qwen3 (MXFP4: gpt-oss). This CPU has no AMX and vLLM's CPU
build has no NVFP4 kernel, so most of these formats cannot be served here: their models are
created with vLLM's kernel selection told the kernel is eligible
(``vllm_worker._select_kernels_without_running_them``), loaded by both formats and compared
before ``process_weights_after_loading``, where the kernels would first run.

Static FP8 on a MoE is the case of ``docs/vllm.md``'s "Parameters several tensors write":
each expert's ``gate_proj.input_scale`` and ``up_proj.input_scale`` both write its one
``w13_input_scale``; the checkpoints here give them different values, so equal bytes show
that the write vLLM keeps is the one asyncslab keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.engines.quantized_models import (
    write_fp8_block_model,
    write_fp8_tensor_model,
    write_modelopt_fp8_model,
    write_modelopt_nvfp4_model,
    write_mxfp4_model,
)
from tests.engines.test_vllm import _assert_greedy_equal, _worker
from tests.engines.test_vllm import pytestmark as vllm_marks

pytestmark = vllm_marks

ARCHS = ("qwen3_moe", "qwen3")

#: name -> (writer, whether vLLM's kernel selection must be told a kernel is eligible).
FORMATS: dict[str, tuple[Callable[..., Path], bool]] = {
    "fp8-block": (write_fp8_block_model, True),
    "fp8-block-bf16-scales": (
        lambda root, arch: write_fp8_block_model(root, arch, scale_dtype=torch.bfloat16),
        True,
    ),
    "fp8-static": (write_fp8_tensor_model, False),
    "fp8-dynamic": (lambda root, arch: write_fp8_tensor_model(root, arch, static=False), False),
    "modelopt-fp8": (write_modelopt_fp8_model, False),
    "modelopt-fp8-config-json": (
        lambda root, arch: write_modelopt_fp8_model(root, arch, in_config_json=True),
        False,
    ),
    "modelopt-nvfp4": (write_modelopt_nvfp4_model, True),
}


def _shard(root: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def _apart(root: Path) -> Path:
    """Each expert's ``up_proj.input_scale`` made other than its ``gate_proj``'s (a
    calibration measures one value for both: then either write would do)."""
    tensors = _shard(root)
    for name in tensors:
        if name.endswith("up_proj.input_scale"):
            tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def _split_against_name_order(root: Path) -> Path:
    """The checkpoint as two files whose natural order (``part-2`` before ``part-10``,
    vLLM's) is not their order by name: the ``up_proj`` input scales in ``part-2``, read
    first, everything else in ``part-10``, so that each expert's ``gate_proj.input_scale``
    is the write vLLM keeps."""
    tensors = _shard(root)
    up = {n: t for n, t in tensors.items() if n.endswith("up_proj.input_scale")}
    rest = {n: t for n, t in tensors.items() if n not in up}
    (root / "model.safetensors").unlink()
    save_file(up, str(root / "part-2.safetensors"), metadata={"format": "pt"})
    save_file(rest, str(root / "part-10.safetensors"), metadata={"format": "pt"})
    return root


def _expert_scales(layers: int, experts: int, proj: str) -> list[str]:
    return [
        f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.input_scale"
        for i in range(layers)
        for e in range(experts)
    ]


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-quantized")
    cases: list[dict[str, Any]] = []
    # An MoE model first: the worker sets vLLM's parallel groups up from it.
    for arch in ARCHS:
        for name, (writer, select) in FORMATS.items():
            root = writer(tmp / f"{name}-{arch}", arch)
            if arch == "qwen3_moe" and name in ("fp8-static", "modelopt-fp8"):
                _apart(root)
            cases.append({"name": f"{name}-{arch}", "model": str(root), "select_kernels": select})
    root = _apart(write_fp8_tensor_model(tmp / "fp8-static-split", "qwen3_moe"))
    _split_against_name_order(root)
    cases.append({"name": "fp8-static-split", "model": str(root)})
    root = write_mxfp4_model(tmp / "mxfp4-gpt_oss")
    cases.append({"name": "mxfp4-gpt_oss", "model": str(root), "select_kernels": True})
    return _worker("loads", cases, tmp)


def _same_bytes_as_auto(case: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in case, case.get("message")
    assert case["same_names"]
    assert case["parameters"] > 10
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    report: dict[str, Any] = case["report"]
    assert report["skipped"] == []
    assert report["bytes"] > 0
    return report


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_loads_byte_for_byte_into_vllms_quantized_parameters(
    loads: dict[str, Any], name: str, arch: str
) -> None:
    case = loads[f"{name}-{arch}"]
    report = _same_bytes_as_auto(case)
    dtypes = case["dtypes"]
    weights = {d for n, d in dtypes.items() if n.endswith(("qkv_proj.weight", "w13_weight"))}
    if name.startswith(("fp8", "modelopt-fp8")):
        assert weights == {"float8_e4m3fn"}, dtypes
    else:  # NVFP4: two E2M1 codes a byte
        assert weights == {"uint8"}, dtypes
    # vLLM keeps block scales in float32: a checkpoint's bfloat16 ones go through its loaders.
    cast = [n for n in report["transformed"] if n.endswith("weight_scale_inv")]
    assert report["transformed"] == cast
    assert bool(cast) == (name == "fp8-block-bf16-scales")
    static_moe = arch == "qwen3_moe" and name in (
        "fp8-static",
        "modelopt-fp8",
        "modelopt-fp8-config-json",
    )
    if static_moe:
        # One input scale per expert in vLLM, written from gate_proj's, then up_proj's: the
        # first is never read (and the bytes above show up_proj's stands, as in vLLM).
        assert sorted(report["overwritten"]) == sorted(_expert_scales(2, 8, "gate"))
        assert report["runs"] == report["tensors"] - len(report["overwritten"])
    else:
        assert report["overwritten"] == []


def test_the_write_vllm_keeps_follows_its_reading_order_across_files(
    loads: dict[str, Any],
) -> None:
    """vLLM reads ``part-2`` before ``part-10``: there each expert's ``gate_proj`` input
    scale is the later write, and so the one asyncslab reads."""
    report = _same_bytes_as_auto(loads["fp8-static-split"])
    assert report["files"] == 2
    assert sorted(report["overwritten"]) == sorted(_expert_scales(2, 8, "up"))


def test_mxfp4_experts_load_byte_for_byte(loads: dict[str, Any]) -> None:
    """gpt-oss's MXFP4 experts: vLLM views each layer's ``*_blocks`` as its packed
    parameter's leading part and copies it there; the blocks, scales and biases are all
    byte runs."""
    case = loads["mxfp4-gpt_oss"]
    report = _same_bytes_as_auto(case)
    dtypes = case["dtypes"]
    assert {d for n, d in dtypes.items() if n.endswith(("w13_weight", "w2_weight"))} == {"uint8"}
    assert report["transformed"] == []
    assert report["overwritten"] == []


def test_a_tensor_in_two_files_is_still_refused(tmp_path: Path) -> None:
    """Accepting the writes vLLM repeats by design does not accept a checkpoint that
    repeats a tensor: one expert's input scale in a second file is refused when the files
    are opened, naming it, before any read."""
    root = write_fp8_tensor_model(tmp_path / "twice", "qwen3_moe")
    twin = "model.layers.1.mlp.experts.3.up_proj.input_scale"
    save_file({twin: _shard(root)[twin]}, str(root / "model-extra.safetensors"))
    case = {"name": "twice", "model": str(root), "formats": ["asyncslab"]}
    refused = _worker("loads", [case], tmp_path)["twice"]
    assert refused["error"] == "DuplicateTensorError", refused
    assert refused["tensor"] == twin
    assert "model-extra.safetensors" in refused["message"]


def test_nvfp4_served_by_vllms_emulation_kernel_answers_as_auto_does(tmp_path: Path) -> None:
    """End to end where vLLM can run the format here: dense NVFP4 through vLLM's own
    pure-torch emulation kernel (put in the CPU's row of its kernel table), after vLLM's
    processing of the bytes each format loaded: the same greedy tokens."""
    root = write_modelopt_nvfp4_model(tmp_path / "nvfp4", "qwen3")
    case = {"name": "nvfp4-qwen3", "model": str(root), "select_kernels": True}
    _assert_greedy_equal(_worker("generate", [case], tmp_path))

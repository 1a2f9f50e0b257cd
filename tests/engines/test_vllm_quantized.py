"""The field's quantized checkpoints through ``--load-format asyncslab``, against ``auto``
in vLLM's CPU build: every parameter byte after ``load_weights`` equal, every parameter in
vLLM's own memory, and where the CPU build serves a format, the greedy tokens equal.

The checkpoints are written at test time in each format's on-disk layout
(``quantized_models.py`` by hand: block-wise and per-tensor FP8, ModelOpt FP8 and NVFP4,
gpt-oss's MXFP4; ``compressed_models.py`` by the compressed-tensors library itself,
``modelopt_models.py`` by NVIDIA's ModelOpt), each on a tiny MoE and a dense model (MXFP4:
gpt-oss). This CPU has no AMX and vLLM's CPU
build has no NVFP4 kernel, so most of these formats cannot be served here: their models are
created with vLLM's kernel selection told the kernel is eligible
(``support.vllm_kernels.select_kernels_without_running_them``), loaded by both formats and
compared before ``process_weights_after_loading``, where the kernels would first run.

Static FP8 on a MoE is the case of ``docs/vllm.md``'s "Parameters several tensors write":
each expert's ``gate_proj.input_scale`` and ``up_proj.input_scale`` both write its one
``w13_input_scale``; the checkpoints here give them different values, so equal bytes show
that the write vLLM keeps is the one asyncslab keeps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from support.quantized_models import (
    write_fp8_block_model,
    write_fp8_tensor_model,
    write_modelopt_fp8_model,
    write_modelopt_nvfp4_model,
    write_mxfp4_model,
)
from tests.engines.compressed_models import (
    write_fp8_model,
    write_nvfp4_model,
    write_w4a16_model,
    write_w8a8_int8_model,
)
from tests.engines.modelopt_models import write_modelopt_models
from tests.engines.test_vllm import LAYERS, _assert_greedy_equal, _handed, _worker
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


#: compressed-tensors' formats, written by its own library (name -> writer), on its tiny
#: Qwen3-MoE and Llama.
COMPRESSED: dict[str, Callable[..., Path]] = {
    "ct-w4a16-g32": lambda root, arch: write_w4a16_model(root, arch, group_size=32),
    "ct-w4a16-g128": write_w4a16_model,
    "ct-w4a16-g128-asym": lambda root, arch: write_w4a16_model(root, arch, symmetric=False),
    "ct-w8a8-int8": write_w8a8_int8_model,
    "ct-fp8-dynamic": write_fp8_model,
    "ct-fp8-static": lambda root, arch: write_fp8_model(root, arch, static=True),
    "ct-nvfp4": write_nvfp4_model,
}
COMPRESSED_ARCHS = ("qwen3_moe", "llama")

#: ModelOpt's formats, written by its own library (name -> (algorithm, whether vLLM's kernel
#: selection must be told a kernel is eligible)), on compressed-tensors' tiny models.
MODELOPT: dict[str, tuple[str, bool]] = {"mo-fp8": ("FP8", False), "mo-nvfp4": ("NVFP4", True)}


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
    for arch in COMPRESSED_ARCHS:
        for name, write in COMPRESSED.items():
            root = write(tmp / f"{name}-{arch}", arch)
            cases.append({"name": f"{name}-{arch}", "model": str(root), "select_kernels": True})
    modelopt = {
        f"{name}-{arch}": (arch, algo, select)
        for name, (algo, select) in MODELOPT.items()
        for arch in COMPRESSED_ARCHS
    }
    written = write_modelopt_models(tmp / "modelopt", {n: m[:2] for n, m in modelopt.items()})
    for name, root in written.items():
        cases.append({"name": name, "model": str(root), "select_kernels": modelopt[name][2]})
    # Scales vLLM's compressed-tensors MoE loader refuses: gate's and up's differ.
    root = _apart(write_fp8_model(tmp / "ct-fp8-static-apart", "qwen3_moe", static=True))
    for fmt in ("auto", "asyncslab"):
        cases.append({"name": f"ct-fp8-static-apart-{fmt}", "model": str(root), "formats": [fmt]})
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


@pytest.mark.parametrize("arch", COMPRESSED_ARCHS)
@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_tensors_formats_load_byte_for_byte(
    loads: dict[str, Any], name: str, arch: str
) -> None:
    """Checkpoints compressed-tensors itself wrote, as llm-compressor saves them: every byte
    equal to ``auto``'s. vLLM keeps their bfloat16 scales in float32 (and an MoE's
    ``weight_shape`` in bfloat16): those go through its loaders; everything else is read
    as bytes."""
    case = loads[f"{name}-{arch}"]
    report = _same_bytes_as_auto(case)
    transformed = report["transformed"]
    assert all(n.rpartition(".")[2] in _VLLM_CASTS for n in transformed), transformed
    assert report["runs"] >= report["tensors"] - len(transformed) - len(report["overwritten"])
    if name == "ct-fp8-static" and arch == "qwen3_moe":
        # One input scale per expert, which vLLM's loader writes from gate_proj's and then
        # checks up_proj's against: both go through it, in order (the next test).
        scales = _expert_scales(2, 8, "gate") + _expert_scales(2, 8, "up")
        assert set(scales) <= set(transformed)
    if not name.startswith("ct-w4a16"):
        assert report["overwritten"] == []


@pytest.mark.parametrize("arch", COMPRESSED_ARCHS)
@pytest.mark.parametrize("name", list(MODELOPT))
def test_modelopt_exports_load_byte_for_byte(loads: dict[str, Any], name: str, arch: str) -> None:
    """Checkpoints ModelOpt itself quantized and exported: every byte equal to ``auto``'s,
    each tensor read as bytes into vLLM's parameter (none through its loaders). A static
    FP8 expert's two input scales write its one ``w13_input_scale``: the gate's, written
    first, is never read."""
    case = loads[f"{name}-{arch}"]
    report = _same_bytes_as_auto(case)
    weights = {
        d for n, d in case["dtypes"].items() if n.endswith(("qkv_proj.weight", "w13_weight"))
    }
    assert weights == ({"float8_e4m3fn"} if name == "mo-fp8" else {"uint8"}), case["dtypes"]
    assert report["transformed"] == []
    if (name, arch) == ("mo-fp8", "qwen3_moe"):
        assert sorted(report["overwritten"]) == sorted(_expert_scales(2, 8, "gate"))
    else:
        assert report["overwritten"] == []


#: What vLLM's loaders change on compressed-tensors' way: scales kept in float32, the MoE's
#: weight_shape kept in bfloat16, the static MoE's input scales checked.
_VLLM_CASTS = ("weight_scale", "input_scale", "weight_shape")


@pytest.mark.parametrize("arch", COMPRESSED_ARCHS)
def test_pack_quantized_weight_shapes_keep_the_last_shards(
    loads: dict[str, Any], arch: str
) -> None:
    """W4A16's ``weight_shape`` (``[out, in]`` of each shard) has one slot in vLLM's fused
    parameter (``qkv_proj.weight_shape``, ``gate_up_proj.weight_shape``, an expert's
    ``w13_weight_shape`` row): each shard's tensor writes it, ``v_proj``'s and ``up_proj``'s
    (the last by name) standing, as the equal bytes show. The earlier ones are not read."""
    case = loads[f"ct-w4a16-g128-{arch}"]
    report = _same_bytes_as_auto(case)
    layers = range(2)
    attention = [f"model.layers.{i}.self_attn.{p}_proj.weight_shape" for i in layers for p in "kq"]
    if arch == "llama":
        mlp = [f"model.layers.{i}.mlp.gate_proj.weight_shape" for i in layers]
    else:
        mlp = [
            f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight_shape"
            for i in layers
            for e in range(8)
        ]
    assert sorted(report["overwritten"]) == sorted(attention + mlp)
    assert not set(report["overwritten"]) & set(report["transformed"])


def test_a_check_vllms_loader_makes_of_what_it_wrote_runs_on_the_real_values(
    loads: dict[str, Any],
) -> None:
    """vLLM's loader refuses a compressed-tensors static FP8 expert whose gate and up input
    scales differ, comparing the second with the first it wrote. While recorded the check
    reads a slot no copy has changed, and passes; asyncslab hands both tensors to the
    loader, in vLLM's order, and the check refuses the checkpoint as under ``auto``."""
    auto, ours = loads["ct-fp8-static-apart-auto"], loads["ct-fp8-static-apart-asyncslab"]
    assert auto["error"] == "ValueError", auto
    assert "input_scales of w1 and w3" in auto["message"]
    assert (ours["error"], ours["message"]) == (auto["error"], auto["message"])


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


def test_formats_this_cpu_can_serve_answer_as_auto_does(tmp_path: Path) -> None:
    """End to end where vLLM's CPU build runs the format here (dense models: its quantized
    MoE experts need AMX): compressed-tensors FP8 with dynamic activations and W8A8 int8,
    and NVFP4 (ModelOpt's and compressed-tensors') through vLLM's own pure-torch emulation
    kernel, registered for the CPU. After vLLM's processing of the bytes each format
    loaded, the same greedy tokens."""
    models = {
        "ct-fp8-dynamic-llama": write_fp8_model(tmp_path / "fp8", "llama"),
        "ct-w8a8-int8-llama": write_w8a8_int8_model(tmp_path / "w8a8", "llama"),
        "ct-nvfp4-llama": write_nvfp4_model(tmp_path / "ct-nvfp4", "llama"),
        "modelopt-nvfp4-qwen3": write_modelopt_nvfp4_model(tmp_path / "nvfp4", "qwen3"),
        **write_modelopt_models(tmp_path / "modelopt", {"mo-nvfp4-llama": ("llama", "NVFP4")}),
    }
    cases = [
        {"name": n, "model": str(m), "select_kernels": True, "landed": True}
        for n, m in models.items()
    ]
    result = _worker("generate", cases, tmp_path)
    _assert_greedy_equal(result)
    # Each layer's quantized linears processed as the layer landed, as vLLM's pass would.
    assert all(_handed(case) == LAYERS for case in result.values()), {
        n: _handed(c) for n, c in result.items()
    }


def test_a_quantized_model_over_two_ranks_answers_as_auto_does(tmp_path: Path) -> None:
    """Tensor parallelism where this CPU serves the format (compressed-tensors FP8 with
    dynamic activations, and W8A8 int8, on the dense model): each rank's recording gives
    it its own rows of the float8 or int8 weights and of their per-channel scales, so each
    reads less than the checkpoint; the greedy tokens are ``auto``'s under the same split."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two ranks need two cores")
    models = {
        "ct-fp8-dynamic-llama": write_fp8_model(tmp_path / "fp8", "llama"),
        "ct-w8a8-int8-llama": write_w8a8_int8_model(tmp_path / "w8a8", "llama"),
    }
    result = _worker(
        "tp",
        [{"name": n, "model": str(m)} for n, m in models.items()],
        tmp_path,
        # As test_vllm's tensor-parallel test: a core per rank, reports pickled back.
        VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    for name, model in models.items():
        case = result[name]
        assert case["tokens"]["asyncslab"] == case["tokens"]["auto"], name
        assert all(len(t) == 8 for t in case["tokens"]["auto"]), name
        reports = case["reports"]
        assert len(reports) == 2
        assert all(r is not None for r in reports), name
        total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        read = [r["bytes"] for r in reports]
        assert all(0 < b < total * 0.75 for b in read), (name, read, total)

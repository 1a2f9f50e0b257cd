"""Tiny random checkpoints in the on-disk layouts of the quantization formats the field
ships, hand-written (their libraries do not install here), exactly as vLLM's own
quantization code reads them: tensor names, dtypes and shapes, and the quantization config
in ``config.json`` (or ``hf_quant_config.json``, where ModelOpt's older exports keep it).

Each writer starts from :func:`~support.vllm_models.write_model`'s float model
(transformers' seeded random initialisation, in bfloat16, the published tensor names) and
quantizes its decoder linear layers from those float weights, so the dequantized model is
close to the float one and every value is finite: FP8 weights are rounded from the float
weights over a scale of ``amax / 448``, FP4 ones to the nearest of E2M1's sixteen values
over power-of-two (MXFP4) or FP8 (NVFP4) group scales. The activation scales a calibration
would measure are drawn at random (seeded, small and positive), the same for every
projection that reads the same input (``q``/``k``/``v``; an expert's ``gate``/``up``), as a
calibration measures them. Embeddings, norms, the head and the MoE routers stay bfloat16,
as the formats' exporters leave them.

Two tiny architectures, :data:`TINY`: ``qwen3_moe`` (Qwen3-MoE: eight experts, top two) and
``qwen3`` (dense Qwen3, tied embeddings); hidden size 128 and head size 128, so that every
projection is a whole number of FP8's 128 x 128 blocks, as block-wise FP8 requires of
merged projections. MXFP4 is gpt-oss's format: :func:`write_mxfp4_model` writes the tiny
gpt-oss of :data:`~support.vllm_models.CONFIGS`.

vLLM's CPU build (0.32) on a CPU without AMX creates the per-tensor FP8 and ModelOpt FP8
models, but not the block-wise FP8, NVFP4 or MXFP4 ones: their kernel selection, in
``create_weights``, finds no kernel (the CPU kernels want AMX; NVFP4 has no CPU kernel
listed). ``load_weights`` runs no kernel, so a test comparing loaders' bytes may get past
the selection alone, in its worker: ``CPUFp8BlockScaledMMKernel.is_supported`` (block FP8),
``CPUExpertsMxfp4._supports_current_device`` (MXFP4), and for NVFP4 the emulation kernels
(``EmulationNvFp4LinearKernel`` as the CPU's entry of ``_POSSIBLE_NVFP4_KERNELS``,
``Nvfp4QuantizationEmulationTritonExperts._supports_current_device``). Unpatched, none is
served end to end there: per-tensor FP8's ``process_weights_after_loading`` calls a
CUDA-only op (``static_scaled_fp8_quant``); patched, block FP8 and MXFP4 stop at the AMX
packing op (``convert_weight_packed``), and dense NVFP4 is served by the emulation kernel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from support.vllm_models import CONFIGS, write_model

_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
}

#: Per tiny architecture: the transformers class, its config class and the config.
TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **CONFIGS["qwen3"][2],
            **_SHAPE,
            "tie_word_embeddings": False,
            "intermediate_size": 256,  # unused: every layer is sparse
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {**CONFIGS["qwen3"][2], **_SHAPE, "intermediate_size": 256},
    ),
}

#: The linear layers the formats quantize: attention's and the MLP's (each expert's).
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP4_MAX = 6.0  # E2M1's largest value
#: E2M1's eight magnitudes, by code (the sign is the code's fourth bit).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def write_tiny_model(root: Path, arch: str = "qwen3_moe", *, seed: int = 0) -> Path:
    """Write the float (bfloat16) model ``arch`` of :data:`TINY` into ``root``, one shard
    ``model.safetensors``, as :func:`~support.vllm_models.write_model` writes it
    (Qwen3-MoE's experts one tensor each: ``mlp.experts.E.{gate,up,down}_proj.weight``):
    the unquantized twin of the quantized writers' checkpoints."""
    class_name, config_name, config = TINY[arch]
    # write_model reads its architectures from CONFIGS: this one is added for the call only.
    with mock.patch.dict(CONFIGS, {arch: (class_name, config_name, config)}):
        return write_model(root, arch, seed=seed)


def write_fp8_block_model(
    root: Path,
    arch: str = "qwen3_moe",
    *,
    scale_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write ``arch`` as block-wise FP8, as DeepSeek-V3/R1 and Qwen3-FP8 ship it
    (``quant_method: "fp8"``, ``fmt: "e4m3"``, ``activation_scheme: "dynamic"``,
    ``weight_block_size: [128, 128]``): every decoder linear layer ``X`` (each expert's
    too) as ``X.weight`` (float8_e4m3fn ``[out, in]``) and ``X.weight_scale_inv``
    (``scale_dtype``, float32 as published, ``[ceil(out / 128), ceil(in / 128)]``: the
    multiplier that dequantizes each 128 x 128 block, its amax / 448); no input scales
    (activations are quantized per 128-column group at run time). The routers
    (``mlp.gate``) and the head stay bfloat16 and are listed in
    ``modules_to_not_convert``, as Qwen3-FP8 lists them."""

    def linear(layer: str, weight: torch.Tensor, _: Any) -> dict[str, torch.Tensor]:
        q, scale = _fp8_blocks(weight, 128)
        return {f"{layer}.weight": q, f"{layer}.weight_scale_inv": scale.to(scale_dtype)}

    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": _unconverted(arch),
    }
    return _quantize(root, arch, seed, linear, config)


def to_fp8_block(root: Path, *, block: int = 128) -> Path:
    """Rewrite the bfloat16 model in ``root`` (any architecture :func:`write_model` writes,
    sharded or not) as :func:`write_fp8_block_model`'s block-wise FP8, in place: every 2-D
    ``weight`` of a decoder layer but the MoE router's (``.gate.weight``) becomes float8
    with its ``weight_scale_inv``; the index, where there is one, lists the new tensors.
    Each shard is rewritten in turn (a large model is never in memory whole)."""
    from safetensors.torch import load_file, save_file

    index = root / "model.safetensors.index.json"
    listed = json.loads(index.read_text()) if index.exists() else None
    for shard in sorted(root.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(str(shard)).items():
            if _block_quantized(name, tensor):
                layer = name.removesuffix(".weight")
                q, scale = _fp8_blocks(tensor.float(), block)
                tensors[name], tensors[f"{layer}.weight_scale_inv"] = q, scale
                if listed is not None:
                    listed["weight_map"][f"{layer}.weight_scale_inv"] = shard.name
            else:
                tensors[name] = tensor
        save_file(tensors, str(shard), metadata={"format": "pt"})
    if listed is not None:
        index.write_text(json.dumps(listed, indent=2))
    config = json.loads((root / "config.json").read_text())
    layers = config["num_hidden_layers"]
    _set_quantization_config(
        root,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
            "modules_to_not_convert": ["lm_head"]
            + [f"model.layers.{i}.{m}.gate" for i in range(layers) for m in _ROUTERS],
        },
    )
    return root


#: Where architectures keep their MoE router (Qwen's ``mlp.gate``, Mixtral's).
_ROUTERS = ("mlp", "block_sparse_moe")


def _block_quantized(name: str, tensor: torch.Tensor) -> bool:
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not name.endswith(".gate.weight")
    )


def write_fp8_tensor_model(
    root: Path, arch: str = "qwen3_moe", *, static: bool = True, seed: int = 0
) -> Path:
    """Write ``arch`` as per-tensor FP8 (``quant_method: "fp8"``, as AutoFP8 saved it
    for the FP8 releases of Llama and Mixtral): every decoder linear layer ``X`` (each expert's
    projection too) as ``X.weight`` (float8_e4m3fn ``[out, in]``) and ``X.weight_scale``
    (float32 scalar, shape ``[]``: the weight's amax / 448), and, when ``static``
    (``activation_scheme: "static"``), ``X.input_scale`` (float32 scalar, the same for the
    projections that read one input); ``activation_scheme: "dynamic"`` has none. The
    routers and the head stay bfloat16, listed in ``ignored_layers``."""

    def linear(layer: str, weight: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
        q, scale = _fp8_tensor(weight)
        out = {f"{layer}.weight": q, f"{layer}.weight_scale": scale}
        if static:
            out[f"{layer}.input_scale"] = group.input_scale(0.005, 0.02)
        return out

    config = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static else "dynamic",
        "ignored_layers": _unconverted(arch),
    }
    return _quantize(root, arch, seed, linear, config)


def write_modelopt_fp8_model(
    root: Path, arch: str = "qwen3_moe", *, in_config_json: bool = False, seed: int = 0
) -> Path:
    """Write ``arch`` as NVIDIA ModelOpt's FP8 (``quant_algo: "FP8"``, per-tensor, static
    activations): every decoder linear layer ``X`` (each expert's too) as ``X.weight``
    (float8_e4m3fn ``[out, in]``), ``X.weight_scale`` and ``X.input_scale`` (float32
    scalars, shape ``[]``). The quantization config as :func:`_modelopt_config` writes it
    (``hf_quant_config.json``, or ``config.json`` when ``in_config_json``); the routers and
    the head stay bfloat16, excluded."""

    def linear(layer: str, weight: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
        q, scale = _fp8_tensor(weight)
        return {
            f"{layer}.weight": q,
            f"{layer}.weight_scale": scale,
            f"{layer}.input_scale": group.input_scale(0.005, 0.02),
        }

    root = _quantize(root, arch, seed, linear, None)
    _modelopt_config(root, arch, "FP8", in_config_json, group_size=None)
    return root


def write_modelopt_nvfp4_model(
    root: Path, arch: str = "qwen3_moe", *, in_config_json: bool = False, seed: int = 0
) -> Path:
    """Write ``arch`` as NVIDIA ModelOpt's NVFP4 (``quant_algo: "NVFP4"``, W4A4, groups of
    16), as nvidia/DeepSeek-R1-FP4 ships it: every decoder linear layer ``X`` (each
    expert's too) as ``X.weight`` (uint8 ``[out, in / 2]``, two E2M1 values a byte, the
    even column in the low nibble), ``X.weight_scale`` (float8_e4m3fn ``[out, in / 16]``,
    one per group of 16), ``X.weight_scale_2`` (float32 scalar, shape ``[]``: the global
    scale, amax / (448 * 6), one for the projections vLLM fuses: ``q``/``k``/``v``, an
    expert's ``gate``/``up``) and ``X.input_scale`` (float32 scalar, the activations'
    global scale). Dequantized: ``e2m1 * weight_scale * weight_scale_2``. The quantization
    config as :func:`_modelopt_config` writes it; the routers and the head stay bfloat16,
    excluded."""

    def linear(layer: str, weight: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
        packed, scale, scale_2 = _nvfp4(weight, group.amax, 16)
        return {
            f"{layer}.weight": packed,
            f"{layer}.weight_scale": scale,
            f"{layer}.weight_scale_2": scale_2,
            f"{layer}.input_scale": group.input_scale(0.001, 0.004),
        }

    root = _quantize(root, arch, seed, linear, None)
    _modelopt_config(root, arch, "NVFP4", in_config_json, group_size=16)
    return root


def write_mxfp4_model(root: Path, *, seed: int = 0, **config: Any) -> Path:
    """Write the tiny gpt-oss (``gpt_oss`` in :data:`~support.vllm_models.CONFIGS`,
    ``config`` overriding it) as openai/gpt-oss ships it (``quant_method: "mxfp4"``): each
    layer's experts, all in one tensor each, as ``mlp.experts.gate_up_proj_blocks`` (uint8
    ``[experts, 2 * inter, hidden / 32, 16]``: per output row, blocks of 32 E2M1 values, two
    a byte, the even one in the low nibble; rows gate and up interleaved, as gpt-oss's own
    layout has them), ``gate_up_proj_scales`` (uint8 ``[experts, 2 * inter, hidden / 32]``:
    each block's E8M0 power-of-two scale, the exponent biased by 127),
    ``gate_up_proj_bias`` (bfloat16 ``[experts, 2 * inter]``), ``down_proj_blocks`` (uint8
    ``[experts, hidden, inter / 32, 16]``), ``down_proj_scales`` (uint8 ``[experts, hidden,
    inter / 32]``) and ``down_proj_bias`` (bfloat16 ``[experts, hidden]``). Attention (with
    its sinks), the router, embeddings and the head stay bfloat16, listed in
    ``modules_to_not_convert`` as gpt-oss lists them."""
    from safetensors.torch import load_file, save_file

    write_model(root, "gpt_oss", seed=seed, **config)
    shard = root / "model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(shard)).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # transformers keeps them [experts, in, out]; gpt-oss stores [experts, out, in].
            blocks, scales = _mxfp4(tensor.transpose(1, 2).float())
            tensors[f"{name}_blocks"] = blocks
            tensors[f"{name}_scales"] = scales
        else:
            tensors[name] = tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _set_quantization_config(
        root,
        {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    )
    return root


# -- the float model, rewritten ------------------------------------------------------------


class _Group:
    """The projections that read one input (``q``/``k``/``v``; an expert's or an MLP's
    ``gate``/``up``): one activation scale between them, one weight amax for NVFP4's
    global scale."""

    def __init__(self, amax: float, generator: torch.Generator) -> None:
        self.amax = amax
        self._generator = generator
        self._input_scale: torch.Tensor | None = None

    def input_scale(self, low: float, high: float) -> torch.Tensor:
        """The group's activation scale (float32 scalar, shape ``[]``), drawn once between
        ``low`` and ``high``; a copy each call, as each projection's tensor is its own."""
        if self._input_scale is None:
            u = torch.rand((), generator=self._generator, dtype=torch.float32)
            self._input_scale = low + (high - low) * u
        return self._input_scale.clone()


def _group_of(name: str) -> str:
    """The input a linear layer ``name`` (without ``.weight``) reads: its module, with
    ``q``/``k``/``v`` and ``gate``/``up`` made one."""
    module, _, proj = name.rpartition(".")
    if proj in ("q_proj", "k_proj", "v_proj"):
        return f"{module}.qkv"
    if proj in ("gate_proj", "up_proj"):
        return f"{module}.gate_up"
    return name


def _quantize(
    root: Path,
    arch: str,
    seed: int,
    linear: Callable[[str, torch.Tensor, _Group], dict[str, torch.Tensor]],
    quantization_config: dict[str, Any] | None,
) -> Path:
    """The float model ``arch`` whose quantized linear layers ``linear(layer, weight,
    group)`` replaces, in its one shard, with ``quantization_config`` (when given) in its
    config."""
    from safetensors.torch import load_file, save_file

    write_tiny_model(root, arch, seed=seed)
    shard = root / "model.safetensors"
    floats = load_file(str(shard))
    layers = {
        name.removesuffix(".weight"): tensor.float()
        for name, tensor in floats.items()
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in _QUANTIZED
    }
    amax: dict[str, float] = {}
    for layer, weight in layers.items():
        group = _group_of(layer)
        amax[group] = max(amax.get(group, 0.0), weight.abs().max().item())
    generator = torch.Generator().manual_seed(seed)
    groups = {group: _Group(value, generator) for group, value in sorted(amax.items())}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in floats.items():
        layer = name.removesuffix(".weight")
        if layer in layers:
            tensors.update(linear(layer, layers[layer], groups[_group_of(layer)]))
        else:
            tensors[name] = tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})
    if quantization_config is not None:
        _set_quantization_config(root, quantization_config)
    return root


def _set_quantization_config(root: Path, quantization_config: dict[str, Any]) -> None:
    """Put ``quantization_config`` into ``root``'s ``config.json``."""
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config, indent=2))


def _unconverted(arch: str) -> list[str]:
    """The layers a format leaves in bfloat16: the head and each MoE layer's router."""
    layers = TINY[arch][2]["num_hidden_layers"]
    routers = [f"model.layers.{i}.mlp.gate" for i in range(layers)] if "moe" in arch else []
    return ["lm_head", *routers]


def _modelopt_config(
    root: Path, arch: str, algo: str, in_config_json: bool, group_size: int | None
) -> None:
    """ModelOpt's quantization config for ``algo``. By default the legacy
    ``hf_quant_config.json`` beside ``config.json`` (ModelOpt 0.29 and before, and
    nvidia/DeepSeek-R1-FP4): ``{"producer": {"name": "modelopt", ...}, "quantization":
    {"quant_algo", "kv_cache_quant_algo": null, "group_size", "exclude_modules"}}``, which
    vLLM reads when ``config.json`` has no ``quantization_config``. With
    ``in_config_json``, ModelOpt 0.31's form instead: ``quantization_config`` in
    ``config.json``, ``{"quant_method": "modelopt", "quant_algo", "config_groups",
    "ignore", "producer"}``. Excluded either way: the head and the routers (ModelOpt's
    wildcards)."""
    producer = {"name": "modelopt", "version": "0.29.0" if not in_config_json else "0.31.0"}
    exclude = ["lm_head"] + (["model.layers.*.mlp.gate"] if "moe" in arch else [])
    if not in_config_json:
        quantization: dict[str, Any] = {
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            "exclude_modules": exclude,
        }
        if group_size is not None:
            quantization["group_size"] = group_size
        hf_quant = {"producer": producer, "quantization": quantization}
        (root / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
        return
    if algo == "NVFP4":
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}
        groups = {"group_0": {"weights": fp4, "input_activations": fp4, "targets": ["Linear"]}}
    else:
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        groups = {"group_0": {"weights": fp8, "input_activations": fp8, "targets": ["Linear"]}}
    config: dict[str, Any] = {
        "quant_method": "modelopt",
        "quant_algo": algo,
        "config_groups": groups,
        "ignore": exclude,
        "producer": producer,
    }
    if group_size is not None:
        config["group_size"] = group_size
    _set_quantization_config(root, config)


# -- the formats' arithmetic ---------------------------------------------------------------


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already over its scale) as float8_e4m3fn, saturated at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (float32) as FP8 over one float32 scalar scale, its amax / 448."""
    scale = (weight.abs().max() / FP8_MAX).clamp(min=1e-12).to(torch.float32)
    return _fp8(weight / scale), scale.reshape(())


def _fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as FP8 over a float32 scale per ``block`` x ``block`` tile
    (``[ceil(out / block), ceil(in / block)]``, each tile's amax / 448; a partial tile at
    the edge has one too)."""
    out, inp = weight.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = weight.new_zeros(rows * block, cols * block)
    padded[:out, :inp] = weight
    tiles = padded.reshape(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = tiles / scale[:, None, :, None]
    return _fp8(q.reshape(rows * block, cols * block)[:out, :inp]), scale


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 code (uint8, 0 to 15, the sign in bit 3) of each value of ``x``."""
    code = (x.abs().clamp(max=FP4_MAX).unsqueeze(-1) - _E2M1).abs().argmin(dim=-1)
    return (code | ((x < 0).to(code.dtype) << 3)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte along the last dimension: the even one in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _nvfp4(
    weight: torch.Tensor, amax: float, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as NVFP4: packed E2M1 (uint8 ``[out, in / 2]``), an FP8
    scale per ``group`` inputs (``[out, in / group]``) and the float32 global scale (from
    ``amax``, the fused projections' largest magnitude: amax / (448 * 6))."""
    out, inp = weight.shape
    scale_2 = torch.tensor(max(amax, 1e-12) / (FP8_MAX * FP4_MAX), dtype=torch.float32)
    groups = weight.reshape(out, inp // group, group)
    # Each group's scale, in units of the global one; at least E4M3's smallest normal.
    scale = _fp8((groups.abs().amax(dim=-1) / FP4_MAX / scale_2).clamp(min=2.0**-6))
    values = groups / (scale.float() * scale_2).unsqueeze(-1)
    return _pack(_e2m1(values.reshape(out, inp))), scale, scale_2


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., out, in]`` as OCP MXFP4 in gpt-oss's layout: blocks (uint8
    ``[..., out, in / 32, 16]``) and E8M0 scales (uint8 ``[..., out, in / 32]``: the exponent
    plus 127 of each block's power of two, ``floor(log2(amax)) - 2``, E2M1's largest
    exponent taken off)."""
    *lead, out, inp = weight.shape
    blocks = weight.reshape(*lead, out, inp // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.floor(torch.log2(amax)) - 2
    values = blocks / torch.exp2(exponent).unsqueeze(-1)
    return _pack(_e2m1(values)), (exponent + 127).clamp(0, 254).to(torch.uint8)

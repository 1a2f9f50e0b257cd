"""Tiny random compressed-tensors checkpoints, written by the compressed-tensors library itself
(0.17's API), the way llm-compressor writes them: a seeded transformers model (a Qwen3-MoE or a
dense Llama, :data:`ARCHS`) whose linear layers compressed-tensors marks for quantization
(``apply_quantization_config``), with scales and zero points computed by compressed-tensors'
own ``calculate_qparams`` and ``generate_gparam`` from min-max statistics (of the weights, and
for static activation scales, of the inputs of one calibration forward pass); then
``ModelCompressor.from_pretrained_model`` infers the format, ``compress_model`` compresses every
quantized module's state dict and sets the status to ``compressed``, transformers'
``save_pretrained`` writes the shard and ``update_config`` the ``quantization_config``.

As llm-compressor's recipes do, only ``Linear`` layers are targeted, and the head
(``lm_head``) and the MoE routers (``model.layers.N.mlp.gate``) are ignored; embeddings and
norms stay bfloat16. The MoE's experts, which transformers 5 keeps fused in 3-D parameters,
are unfused first into one MLP of ``nn.Linear`` layers per expert (llm-compressor's MoE
calibration modules do the same), so the checkpoint names them one by one
(``mlp.experts.E.gate_proj.weight_packed``), as published compressed-tensors MoE checkpoints
do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from support.vllm_models import CONFIGS, VOCAB, _tokenizer, random_model

_SIZES: dict[str, Any] = {
    # Every quantized layer's input width (128, or 256 for Llama's down_proj) is a multiple
    # of the largest group (128); k_proj and v_proj are 64 wide.
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}

#: Per architecture: the transformers class, its config class and the tiny defaults.
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        CONFIGS["llama"][0],
        CONFIGS["llama"][1],
        {**CONFIGS["llama"][2], **_SIZES, "intermediate_size": 256},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **CONFIGS["llama"][2],
            **_SIZES,
            "intermediate_size": 256,  # unused: every layer is sparse
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
}


def write_w4a16_model(
    root: Path, arch: str, *, group_size: int = 128, symmetric: bool = True, seed: int = 0
) -> Path:
    """Write model ``arch`` (a key of :data:`ARCHS`) as a W4A16 ``pack-quantized`` checkpoint
    (llm-compressor's ``W4A16`` scheme, or ``W4A16_ASYM`` when not ``symmetric``, at
    ``group_size``): every quantized layer ``X`` (``[out, in]``) as ``X.weight_packed``
    (int32 ``[out, in / 8]``, eight 4-bit values a word, the first in the low bits, each
    stored offset by 8), ``X.weight_scale`` (bfloat16 ``[out, in / group_size]``) and
    ``X.weight_shape`` (int64 ``[2]``: ``out, in``); asymmetric, also ``X.weight_zero_point``
    (int32 ``[out / 8, in / group_size]``: packed along the output). Activations stay
    bfloat16."""
    scheme = _preset("W4A16" if symmetric else "W4A16_ASYM")
    weights = scheme.weights.model_copy(update={"group_size": group_size})
    return write_compressed_model(root, arch, weights, seed=seed)


def write_w8a8_int8_model(root: Path, arch: str, *, seed: int = 0) -> Path:
    """Write model ``arch`` as a W8A8 ``int-quantized`` checkpoint (llm-compressor's
    ``W8A8`` int8 scheme): every quantized layer ``X`` as ``X.weight`` (int8 ``[out, in]``,
    symmetric) and ``X.weight_scale`` (bfloat16 ``[out, 1]``, one per output channel); the
    activations are quantized per token at run time, so the checkpoint holds no input
    scale."""
    scheme = _preset("W8A8")
    return write_compressed_model(root, arch, scheme.weights, scheme.input_activations, seed=seed)


def write_fp8_model(root: Path, arch: str, *, static: bool = False, seed: int = 0) -> Path:
    """Write model ``arch`` as an FP8 ``float-quantized`` checkpoint: every quantized layer
    ``X`` as ``X.weight`` (float8_e4m3fn ``[out, in]``) and ``X.weight_scale`` (bfloat16).
    By default llm-compressor's ``FP8_DYNAMIC``: one weight scale per output channel
    (``[out, 1]``), activations quantized per token at run time (no input scale). With
    ``static``, its ``FP8`` scheme: one weight scale per tensor (``[1]``) and a static
    per-tensor ``X.input_scale`` (bfloat16 ``[1]``) from one calibration pass over random
    tokens."""
    scheme = _preset("FP8" if static else "FP8_DYNAMIC")
    return write_compressed_model(root, arch, scheme.weights, scheme.input_activations, seed=seed)


def write_nvfp4_model(root: Path, arch: str, *, seed: int = 0) -> Path:
    """Write model ``arch`` as an NVFP4 ``nvfp4-pack-quantized`` checkpoint (llm-compressor's
    ``NVFP4`` scheme): every quantized layer ``X`` as ``X.weight_packed`` (uint8
    ``[out, in / 2]``, two FP4 E2M1 codes a byte, the first in the low nibble),
    ``X.weight_scale`` (float8_e4m3fn ``[out, in / 16]``, one per 16 inputs, already
    multiplied by the global scale), ``X.weight_global_scale`` (float32 ``[1]``:
    ``448 * 6 / amax(weight)``, a divisor) and ``X.input_global_scale`` (float32 ``[1]``, the
    same for the inputs' absolute maximum over one calibration pass); activations get their
    per-16 scales at run time."""
    scheme = _preset("NVFP4")
    return write_compressed_model(root, arch, scheme.weights, scheme.input_activations, seed=seed)


def _preset(name: str) -> Any:
    """compressed-tensors' preset scheme ``name`` (llm-compressor's ``scheme=`` names)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(name, ["Linear"])


def write_compressed_model(
    root: Path,
    arch: str,
    weights: Any,
    input_activations: Any = None,
    *,
    seed: int = 0,
) -> Path:
    """Write model ``arch`` (bfloat16, transformers' seeded random initialisation) with every
    ``Linear`` layer but the head and the MoE routers quantized by compressed-tensors'
    ``QuantizationArgs`` ``weights`` (and ``input_activations``), in whichever format
    compressed-tensors infers for them, in one shard with its ``quantization_config``,
    and a tokenizer. Static activation scales come from the inputs of one calibration
    forward pass over random tokens (every expert sees every token)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        DynamicType,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import is_module_quantized

    model = float_model(arch, seed)
    layers = model.config.num_hidden_layers
    routers = [f"model.layers.{i}.mlp.gate" for i in range(layers)] if arch == "qwen3_moe" else []
    ignore = ["lm_head", *routers]
    scheme = QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=input_activations
    )
    static_inputs = input_activations is not None and input_activations.dynamic in (
        False,
        DynamicType.LOCAL,
    )
    with torch.no_grad():
        inputs = _calibrate(model, ignore, seed) if static_inputs else {}
        config = QuantizationConfig(
            config_groups={"group_0": scheme},
            ignore=ignore,
            quantization_status=QuantizationStatus.INITIALIZED,
        )
        apply_quantization_config(model, config)
        for name, module in model.named_modules():
            if is_module_quantized(module):
                _set_qparams(module, inputs.get(name))
                module.quantization_status = QuantizationStatus.FROZEN
        compressor = ModelCompressor.from_pretrained_model(model)
        assert compressor.quantization_config is not None
        # The routers are not nn.Linear in transformers 5, so the config compressed-tensors
        # derives from the model leaves them out; vLLM's are linear layers, to be ignored.
        qconfig = compressor.quantization_config
        qconfig.ignore = [*qconfig.ignore, *(r for r in routers if r not in qconfig.ignore)]
        # The FP4 rounding is a torch.compile function: run eagerly (the same values), not
        # compiled for each shape (tens of seconds on a CPU).
        with torch.compiler.set_stance("force_eager"):
            compressor.compress_model(model)
    model.save_pretrained(root, safe_serialization=True)
    compressor.update_config(str(root))
    del model
    _tokenizer(root, transformers)
    return root


def float_model(arch: str, seed: int) -> Any:
    """``arch``'s model, made in bfloat16 as ``write_model`` makes it; a MoE's experts
    unfused into one MLP per expert."""
    model = random_model(*ARCHS[arch], torch.bfloat16, seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the unfused experts too
    try:
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                layer.mlp.experts = _Experts(model.config, experts)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


class _Experts(torch.nn.ModuleList):
    """transformers' fused experts (``gate_up_proj`` ``[E, 2 * I, H]``, ``down_proj``
    ``[E, H, I]``) as one ``Qwen3MoeMLP`` of ``nn.Linear`` layers per expert, as
    llm-compressor's MoE calibration modules unfuse them; called as the fused module is.
    Every expert sees every token (all are calibrated); the routing weights pick the
    output."""

    def __init__(self, config: Any, fused: Any) -> None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

        size = fused.intermediate_dim
        mlps = []
        for e in range(fused.num_experts):
            mlp = Qwen3MoeMLP(config, intermediate_size=size)
            mlp.gate_proj.weight.data.copy_(fused.gate_up_proj.data[e, :size])
            mlp.up_proj.weight.data.copy_(fused.gate_up_proj.data[e, size:])
            mlp.down_proj.weight.data.copy_(fused.down_proj.data[e])
            mlps.append(mlp)
        super().__init__(mlps)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            out += expert(hidden) * weight.to(hidden.dtype)
        return out


def _calibrate(model: Any, ignore: list[str], seed: int) -> dict[str, torch.Tensor]:
    """Each targeted linear layer's input absolute maximum (float32) over one forward pass of
    random tokens: the static-min-max observer's statistic."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in ignore:

            def record(mod: Any, args: Any, name: str = name) -> None:
                value = args[0].detach().abs().amax().float()
                amax[name] = torch.maximum(amax.get(name, value), value)

            hooks.append(module.register_forward_pre_hook(record))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (4, 32), generator=generator)
    try:
        model(input_ids=tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return amax


def _set_qparams(module: Any, input_amax: torch.Tensor | None) -> None:
    """Fill the scales (and zero points, global scales) compressed-tensors registered on
    ``module``, with compressed-tensors' ``calculate_qparams`` (and ``generate_gparam`` for
    the tensor-group strategy) over min-max statistics, as llm-compressor's observers do."""
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = module.quantization_scheme
    weight = module.weight.detach().float()
    args = scheme.weights
    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        global_scale = generate_gparam(weight.amin(), weight.amax())
        update_offload_parameter(module, "weight_global_scale", global_scale)
    low, high = _minmax(weight, args)
    scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
    update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        update_offload_parameter(module, "weight_zero_point", zero_point)
    inputs = scheme.input_activations
    if inputs is None or inputs.dynamic is True:
        return
    assert input_amax is not None, "a static activation scale needs calibration"
    if hasattr(module, "input_global_scale"):
        update_offload_parameter(
            module, "input_global_scale", generate_gparam(-input_amax, input_amax)
        )
    if hasattr(module, "input_scale"):
        scale, zero_point = calculate_qparams(-input_amax.reshape(1), input_amax.reshape(1), inputs)
        update_offload_parameter(module, "input_scale", scale.to(module.input_scale.dtype))
        if hasattr(module, "input_zero_point"):
            update_offload_parameter(module, "input_zero_point", zero_point)


def _minmax(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's minimum and maximum per quantization unit of ``args``' strategy, shaped as
    compressed-tensors shapes the scale."""
    from compressed_tensors.quantization import QuantizationStrategy

    if args.strategy == QuantizationStrategy.TENSOR:
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(dim=-1), groups.amax(dim=-1)
    raise NotImplementedError(f"no min-max statistic for the {args.strategy} strategy")

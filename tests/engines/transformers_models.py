"""Tiny random transformers models for the tests, built from configs (nothing is fetched):
each architecture asyncslab.transformers is proven on, saved as ``save_pretrained`` saves it
(per-expert tensors, as on the Hub) or fused (the model's own 3-D expert tensors); and
quantized checkpoints of them (FP8 block-wise, compressed-tensors), which it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: name -> (config class name, config fields): small enough for a test, every feature kept
#: (shared experts, latent attention, dense first layers, tied embeddings).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    "llama_tied": (
        "LlamaConfig",
        dict(intermediate_size=48, tie_word_embeddings=True),
    ),
}

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def config(name: str, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Any:
    import transformers

    cls_name, fields = MODELS[name]
    return getattr(transformers, cls_name)(**{**_COMMON, **fields, **overrides, "dtype": dtype})


def build(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised model of ``name``, in its config's dtype."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(name, **overrides))


def save(model: Any, directory: Path, *, fused: bool = False, shard: str = "16KB") -> Path:
    """``save_pretrained`` into ``directory`` in several shards with an index; ``fused``:
    the model's own (3-D, fused) tensors instead of the original per-expert names."""
    model.save_pretrained(directory, max_shard_size=shard, save_original_format=not fused)
    return directory


# --- quantized checkpoints --------------------------------------------------------------

#: The FP8 block-wise config that DeepSeek-V3's and Qwen3's FP8 releases ship (transformers'
#: ``FineGrainedFP8Config``).
FP8_BLOCKWISE: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def write_fp8(model: Any, directory: Path) -> Path:
    """``model`` as an FP8 block-wise checkpoint, as those releases lay it out: every
    projection weight of its decoder layers (attention, dense MLP and per-expert) as
    float8_e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128 block (the block's
    largest magnitude over float8's), everything else as it was; :data:`FP8_BLOCKWISE` in
    its config. transformers cannot write one on a CPU (quantizing needs a GPU), so the
    ``safetensors`` library writes it."""
    import json

    from safetensors.torch import load_file, save_file

    save(model, directory, shard="1GB")
    shard = directory / "model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(shard).items():
        if ".layers." in name and name.endswith("proj.weight") and tensor.dim() == 2:
            weight, scale = _fp8_blocks(tensor, FP8_BLOCKWISE["weight_block_size"])
            tensors[name] = weight
            tensors[f"{name}_scale_inv"] = scale
        else:
            tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = FP8_BLOCKWISE
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _fp8_blocks(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in float8_e4m3fn and its float32 scale per block (``weight ~ fp8 * scale``),
    the last blocks of each dimension partial."""
    rows, cols = weight.shape
    down, across = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(down * block[0], across * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(down, block[0], across, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    scaled = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return scaled.to(torch.float8_e4m3fn).contiguous(), scale


#: compressed-tensors schemes, as llm-compressor's presets name them: (its format, weights,
#: input activations). W8A8: int8 weights, one scale per output channel, activations per
#: token at run time. W4A16: int4 weights, one scale per group of 16 inputs, packed eight to
#: an int32.
COMPRESSED: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "w8a8": (
        "int-quantized",
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    ),
    "w4a16": (
        "pack-quantized",
        dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
        None,
    ),
}


def write_compressed(model: Any, directory: Path, scheme: str) -> Path:
    """``model`` as a compressed-tensors checkpoint of ``scheme`` (:data:`COMPRESSED`),
    written by compressed-tensors' own API as llm-compressor writes one: the scheme applied
    to every ``Linear`` but ``lm_head``, each weight's scales computed from its minimum and
    maximum (what a min-max observer finds), then ``ModelCompressor`` compresses the model
    (int8 ``weight`` or int32 ``weight_packed`` and ``weight_shape``, beside
    ``weight_scale``), ``save_pretrained`` saves it and the compressor writes its
    ``quantization_config`` into config.json."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    fmt, weights, activations = COMPRESSED[scheme]
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**activations) if activations else None,
    )
    config = QuantizationConfig(
        config_groups={"group_0": group}, ignore=["lm_head"], quantization_status="frozen"
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            weight = module.weight.float()
            if args.group_size:
                weight = weight.unflatten(-1, (-1, args.group_size))
            scale, zero = calculate_qparams(weight.amin(dim=-1), weight.amax(dim=-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return directory

"""Tiny (or, for the benchmark, large) random Hugging Face models written at run time:
config, a word-level tokenizer and safetensors shards with an index, as ``save_pretrained``
lays them out, for vLLM to load with no hub.

Weights are transformers' own random initialisation (seeded), made in the model's dtype;
:func:`write_awq_model` and :func:`write_gptq_model` replace the decoder's linear layers by
4-bit ones, :func:`write_w8a8_model` by compressed-tensors int8 ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 250  # not a multiple of 64: vLLM pads the vocabulary, and zero-fills the padding


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

#: Per architecture: the transformers class, its config class and the tiny defaults.
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {**_COMMON, "intermediate_size": 128}),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {**_COMMON, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            **_COMMON,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
        },
    ),
    # Beyond the three every test runs: loaders that differ from Llama's and Mixtral's.
    # Tied embeddings (no lm_head in the checkpoint), per-head q/k norms.
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {**_COMMON, "intermediate_size": 128, "tie_word_embeddings": True},
    ),
    # DeepSeek-V3's (and GLM-5's) layout: latent attention (low-rank q and kv), a dense first
    # layer, routed experts beside a shared one, a float32 router bias.
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            **_COMMON,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            # The CPU build's latent attention takes DeepSeek's own latent width only
            # (kv_lora_rank + qk_rope_head_dim = 576).
            "q_lora_rank": 32,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
        },
    ),
    # A hybrid: a linear-attention layer (convolution, gated delta rule) and a full one,
    # both over experts.
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        {
            **_COMMON,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            # The CPU build's gated-delta-rule kernel takes Qwen3-Next's own head size only.
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "partial_rotary_factor": 0.5,
        },
    ),
    # Experts stored fused and transposed, with biases: vLLM rearranges them on the way.
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            **_COMMON,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
        },
    ),
}


def write_model(
    root: Path,
    arch: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    seed: int = 0,
    **config: Any,
) -> Path:
    """Write model ``arch`` (a key of :data:`CONFIGS`) into ``root``: ``shards`` files,
    with ``model.safetensors.index.json`` when more than one. ``config`` overrides the
    tiny defaults (the benchmark's sizes)."""
    import transformers

    class_name, config_name, defaults = CONFIGS[arch]
    model = random_model(class_name, config_name, {**defaults, **config}, dtype, seed)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    # save_pretrained writes the published layout (Mixtral's experts one tensor each), in
    # about ``shards`` files, with an index when more than one.
    model.save_pretrained(
        root, safe_serialization=True, max_shard_size=max(1, nbytes // shards + 1)
    )
    del model
    _tokenizer(root, transformers)
    return root


def random_model(
    class_name: str, config_name: str, config: dict[str, Any], dtype: torch.dtype, seed: int
) -> Any:
    """transformers' ``class_name`` with ``config``, its seeded random initialisation made
    in ``dtype`` (no float32 copy of a large model)."""
    import transformers

    cfg = getattr(transformers, config_name)(**config, bos_token_id=1, eos_token_id=2)
    cfg.dtype = dtype
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return getattr(transformers, class_name)(cfg)
    finally:
        torch.set_default_dtype(default)


def _tokenizer(root: Path, transformers: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(root)


#: The decoder's linear layers, which a quantized checkpoint quantizes (all else stays float).
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_awq_model(root: Path, *, group_size: int = 32, seed: int = 0) -> Path:
    """Write a tiny Llama as an AutoAWQ "gemm" checkpoint (4 bits, zero points): every
    decoder linear layer ``X`` as ``X.qweight`` (int32 ``[in, out / 8]``, eight 4-bit
    values each), ``X.qzeros`` (int32 ``[in / group, out / 8]``) and ``X.scales`` (float16
    ``[in / group, out]``), in place of ``X.weight``; embeddings, norms and the head stay
    float16, as AutoAWQ leaves them. The packed values are random (seeded): any 4-bit
    values are a valid model, and the scales keep the dequantized weights small (at most
    15 times a scale of 0.005 to 0.02), so the logits stay finite."""

    def linear(layer: str, out: int, inp: int) -> dict[str, torch.Tensor]:
        groups = inp // group_size
        return {
            f"{layer}.qweight": _packed(inp, out // 8),
            f"{layer}.qzeros": _packed(groups, out // 8),
            f"{layer}.scales": _scales(groups, out),
        }

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    return _write_4bit(root, linear, config, seed)


def write_gptq_model(root: Path, *, group_size: int = 32, seed: int = 0) -> Path:
    """Write a tiny Llama as a GPTQ checkpoint (4 bits, symmetric, no activation order), as
    AutoGPTQ and GPTQModel save it: every decoder linear layer ``X`` as ``X.qweight``
    (int32 ``[in / 8, out]``: packed along the input, unlike AWQ), ``X.qzeros`` (int32
    ``[in / group, out / 8]``), ``X.scales`` (float16 ``[in / group, out]``) and ``X.g_idx``
    (int32 ``[in]``, each input's group: in order, since there is no activation order);
    random packed values and small scales, as for :func:`write_awq_model`."""

    def linear(layer: str, out: int, inp: int) -> dict[str, torch.Tensor]:
        groups = inp // group_size
        return {
            f"{layer}.qweight": _packed(inp // 8, out),
            f"{layer}.qzeros": _packed(groups, out // 8),
            f"{layer}.scales": _scales(groups, out),
            f"{layer}.g_idx": (torch.arange(inp) // group_size).to(torch.int32),
        }

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
    }
    return _write_4bit(root, linear, config, seed)


def _write_4bit(
    root: Path,
    linear: Callable[[str, int, int], dict[str, torch.Tensor]],
    quantization_config: dict[str, Any],
    seed: int,
) -> Path:
    """A tiny float16 Llama whose decoder linear layers ``linear(layer, out, in)`` replaces,
    in one shard, with ``quantization_config`` in its config."""
    import transformers
    from safetensors.torch import save_file

    model = random_model(*CONFIGS["llama"], torch.float16, seed)
    cfg = model.config
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        layer, _, kind = name.rpartition(".")
        if kind == "weight" and layer.rpartition(".")[2] in QUANTIZED_LINEARS:
            tensors.update(linear(layer, *tensor.shape))
        else:
            tensors[name] = tensor.contiguous()
    del model
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    cfg.quantization_config = quantization_config
    cfg.save_pretrained(root)
    _tokenizer(root, transformers)
    return root


def write_w8a8_model(root: Path, *, seed: int = 0) -> Path:
    """Write a tiny Llama as a compressed-tensors W8A8 checkpoint (what llm-compressor's
    int8 scheme saves): every decoder linear layer ``X`` as ``X.weight`` (int8, rounded
    from the float weight) and ``X.weight_scale`` (bfloat16 ``[out, 1]``, one per output
    channel); activations are quantized per token at run time. Its config quantizes no
    KV cache, so vLLM's attention layers keep their own default KV-cache scales: a
    checkpoint without them is complete."""
    import json

    from safetensors.torch import load_file, save_file

    write_model(root, "llama", seed=seed)
    shard = root / "model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(shard)).items():
        layer, _, kind = name.rpartition(".")
        if kind == "weight" and layer.rpartition(".")[2] in QUANTIZED_LINEARS:
            scale = tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
            tensors[name] = (tensor.float() / scale).round().clamp(-127, 127).to(torch.int8)
            tensors[f"{layer}.weight_scale"] = scale.to(torch.bfloat16)
        else:
            tensors[name] = tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def _scales(groups: int, columns: int) -> torch.Tensor:
    return (torch.rand(groups, columns, dtype=torch.float32) * 0.015 + 0.005).half()


def _packed(rows: int, columns: int) -> torch.Tensor:
    """Random int32 words, each eight random 4-bit values."""
    return torch.randint(-(2**31), 2**31, (rows, columns), dtype=torch.int64).to(torch.int32)

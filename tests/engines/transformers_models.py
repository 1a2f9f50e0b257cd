"""Tiny random transformers models for the tests, built from configs (nothing is fetched):
each architecture asyncslab.transformers is proven on, saved as ``save_pretrained`` saves it
(per-expert tensors, as on the Hub) or fused (the model's own 3-D expert tensors)."""

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

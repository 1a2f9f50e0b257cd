"""Tiny (or, for the benchmark, large) random Hugging Face models written at run time:
config, a word-level tokenizer and safetensors shards with an index, as ``save_pretrained``
lays them out, for vLLM to load with no hub.

Weights are transformers' own random initialisation (seeded), made in the model's dtype.
"""

from __future__ import annotations

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
    cfg = getattr(transformers, config_name)(
        **{**defaults, **config}, bos_token_id=1, eos_token_id=2
    )
    cfg.dtype = dtype
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: no float32 copy of a large model
    try:
        model = getattr(transformers, class_name)(cfg)
    finally:
        torch.set_default_dtype(default)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    # save_pretrained writes the published layout (Mixtral's experts one tensor each), in
    # about ``shards`` files, with an index when more than one.
    model.save_pretrained(
        root, safe_serialization=True, max_shard_size=max(1, nbytes // shards + 1)
    )
    del model
    _tokenizer(root, transformers)
    return root


def _tokenizer(root: Path, transformers: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(root)

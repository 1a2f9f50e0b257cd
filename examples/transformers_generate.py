"""Load a transformers model with ``asyncslab.transformers.from_pretrained`` and generate a few
tokens: the same tokens as transformers' own ``from_pretrained``.

Run: ``python examples/transformers_generate.py [PATH or s3://bucket/prefix]`` (needs
``transformers``; without it the script says so and exits 0). Without a path nothing is
downloaded: a tiny random Qwen3-MoE (2 layers, 8 experts, hidden 64) is saved with
``save_pretrained`` into a temporary directory, in per-expert tensors as models are
published. asyncslab reads each expert straight into its slot of the model's fused
``gate_up_proj`` and ``down_proj`` parameters, where ``from_pretrained`` reads every tensor,
stacks each layer's experts and concatenates gate and up.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, never the hub

import torch  # noqa: E402


def tiny_model(directory: Path) -> Path:
    """A random Qwen3-MoE saved by transformers itself."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="200KB")
    return directory


def generate(model: Any, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, prompt.shape[1] :]]


def main(argv: list[str]) -> int:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: pip install transformers")
        return 0
    import asyncslab.transformers

    with tempfile.TemporaryDirectory() as tmp:
        source = argv[0] if argv else str(tiny_model(Path(tmp) / "qwen3-moe"))
        started = time.perf_counter()
        model = asyncslab.transformers.from_pretrained(source)
        took = time.perf_counter() - started
        count = sum(p.numel() for p in model.parameters())
        print(
            f"asyncslab.transformers.from_pretrained({source!r}): {type(model).__name__}, "
            f"{count:,} parameters, {took:.2f} s"
        )
        prompt = torch.tensor([[1, 17, 42, 99, 3]])
        tokens = generate(model, prompt)
        print(f"asyncslab:    {tokens}")
        if "://" in source:
            return 0  # transformers cannot read object storage: nothing to compare with
        ref = transformers.AutoModelForCausalLM.from_pretrained(source)
        expected = generate(ref, prompt)
        print(f"transformers: {expected}")
        same = tokens == expected and all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
        )
        print("identical parameters and tokens" if same else "MISMATCH")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

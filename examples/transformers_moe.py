"""Load a mixture-of-experts checkpoint written by ``transformers`` itself into per-layer
expert slabs, bind them into the model, and get the same logits as ``from_pretrained``.

Run: ``python examples/transformers_moe.py`` (needs ``transformers``; without it the script
says so and exits 0). Nothing is downloaded: the model is a tiny random Mixtral (2 layers,
4 experts, hidden 64, intermediate 32, vocab 128) saved with ``save_pretrained``.

What ``transformers`` 5.x writes is not what its modules hold. ``MixtralExperts`` keeps each
layer's experts fused as 3-D parameters, ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (per
expert: gate rows, then up rows) and ``mlp.experts.down_proj`` ``(E, H, I)``; but
``save_pretrained`` converts back to the published per-expert layout,
``model.layers.L.block_sparse_moe.experts.E.w{1,2,3}.weight`` (w1 = gate, w3 = up,
w2 = down), and ``from_pretrained`` renames and concatenates on the way in.

The plan absorbs both with a configured :class:`asyncslab.TieredMoE` (pattern for
``block_sparse_moe.experts.E.wN.weight``, fusion ``gate_up_proj = (w1, w3)``,
``down_proj = (w2,)``, schema ``weight: float32``, no markers, one group ``all``) and
``layout="expert_major"``: a fused projection's slab is ``backing[expert, shard]``, so the
``gate_up_proj`` slab ``(E, 2, I, H)`` holds, byte for byte, the parameter's ``(E, 2I, H)``
(expert e's gate rows, then its up rows) and binds as ``(slab, (), (E, 2I, H))``, a reshaped
view of the same memory. (The default ``layout="shard_major"``, ``(2, E, I, H)``, could not:
no strided view turns it into ``(E, 2I, H)``.) ``down_proj`` ``(E, H, I)``, the routers and
every dense weight bind one to one. Every parameter is then a view of the slabs; nothing is
copied, and the script checks it.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, never the hub

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from asyncslab import (  # noqa: E402
    Checkpoint,
    Dense,
    SlabSet,
    Target,
    TieredMoE,
    bind_module,
    load,
    plan,
)

#: Per-expert tensors as transformers saves Mixtral (and as Mixtral is published).
EXPERT_PATTERN = (
    r"(?P<prefix>model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts)"
    r"\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<suffix>weight)"
)
FUSION = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
_FUSED_PARAM = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER_PARAM = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


def tiny_config() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )


def expert_rule() -> TieredMoE:
    return TieredMoE(
        pattern=EXPERT_PATTERN,
        fusion=FUSION,
        schema={"weight": torch.float32},
        markers={},
        tier_suffix=None,
        layout="expert_major",  # (E, 2, I, H): the bytes of transformers' (E, 2I, H)
    )


def slab_target(name: str, slabs: SlabSet, config: Any) -> Target | None:
    """Module parameter name -> what it binds to (a slab, or a slab under another shape)."""
    if name in slabs.plan.slabs:  # dense weights, and experts if saved already fused
        return name
    m = _FUSED_PARAM.fullmatch(name)
    if m is not None:
        layer, fused = m.groups()
        slab = expert_slab(layer, fused)
        if fused == "gate_up_proj":  # slab (E, 2, I, H), parameter (E, 2I, H): same bytes
            experts, inter = config.num_local_experts, config.intermediate_size
            return (slab, (), (experts, 2 * inter, config.hidden_size))
        return slab
    m = _ROUTER_PARAM.fullmatch(name)
    if m is not None:
        return f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
    return None


def expert_slab(layer: int | str, fused: str) -> str:
    """TieredMoE's slab name, ``{prefix}.{group}.{fused}.{suffix}``, for the one group."""
    return f"model.layers.{layer}.block_sparse_moe.experts.all.{fused}.weight"


def compare(slabs: SlabSet, checkpoint: Checkpoint) -> tuple[int, int, float]:
    identical, worst = 0, 0.0
    for shard in checkpoint.files:
        with safe_open(str(shard.path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                want, got = f.get_tensor(name), slabs.view(name)
                if got.dtype == want.dtype and torch.equal(got, want):
                    identical += 1
                worst = max(worst, (got.double() - want.double()).abs().max().item())
    return identical, len(checkpoint.tensors), worst


async def run(root: Path) -> None:
    import transformers
    from transformers import MixtralForCausalLM

    transformers.utils.logging.disable_progress_bar()
    config = tiny_config()
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(root)
    checkpoint = Checkpoint.open(root)
    per_expert = sorted(n for n in checkpoint.tensors if re.fullmatch(EXPERT_PATTERN, n))
    layout = (
        f"per-expert ({len(per_expert)} tensors like {per_expert[0]!r})"
        if per_expert
        else "fused 3-D experts"
    )
    print(
        f"checkpoint: transformers {transformers.__version__} save_pretrained, "
        f"{len(checkpoint.tensors)} tensors, {checkpoint.total_bytes} bytes; layout {layout}"
    )
    p = plan(checkpoint, [expert_rule(), Dense()])
    experts = {n: s for n, s in p.slabs.items() if s.labels.get("kind") == "experts"}
    print(
        f"plan: {len(p.slabs)} slabs, {p.nbytes} bytes; expert slabs: "
        + ", ".join(f"{n} {tuple(s.shape)}" for n, s in list(experts.items())[:2])
        + (f" and {len(experts) - 2} more" if len(experts) > 2 else "")
    )
    started = time.perf_counter()
    slabs = await load(checkpoint, p)
    took = time.perf_counter() - started
    try:
        stats = slabs.statistics()
        print(
            f"asyncslab load: {stats.tensors_landed} tensors, {stats.bytes_landed} bytes in "
            f"{took * 1e3:.1f} ms"
        )
        started = time.perf_counter()
        for shard in checkpoint.files:
            load_file(str(shard.path))
        print(f"safetensors load_file (mmap): {(time.perf_counter() - started) * 1e3:.1f} ms")
        identical, total, worst = compare(slabs, checkpoint)
        print(f"bit-identical: {identical}/{total} tensors; max abs diff {worst:g}")
        if identical != total:
            raise SystemExit("MISMATCH: asyncslab and safetensors disagree")

        model = MixtralForCausalLM(config).eval()
        # strict: a parameter left unbound, or a shape that does not fit, is an error.
        views = bind_module(model, slabs, lambda n: slab_target(n, slabs, config))
        params = dict(model.named_parameters())
        backing = next(iter(views.values())).untyped_storage().data_ptr()  # one allocation
        zero_copy = [
            n
            for n, t in params.items()
            if t.data_ptr() == views[n].data_ptr() and t.untyped_storage().data_ptr() == backing
        ]
        if len(zero_copy) != len(params):
            raise SystemExit(
                f"parameters not views of the slabs: {sorted(set(params) - set(zero_copy))}"
            )
        gate_up = slabs.plan.slabs[expert_slab(0, "gate_up_proj")]
        print(
            f"bound zero-copy: {len(zero_copy)}/{len(params)} parameters are views of the slabs "
            f"(gate_up_proj: slab {tuple(gate_up.shape)} as "
            f"{tuple(params['model.layers.0.mlp.experts.gate_up_proj'].shape)})"
        )
        reference = MixtralForCausalLM.from_pretrained(root, local_files_only=True).eval()
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
        with torch.no_grad():
            ours, theirs = model(ids).logits, reference(ids).logits
        print(
            f"logits: {tuple(ours.shape)}; max abs diff vs MixtralForCausalLM.from_pretrained: "
            f"{(ours - theirs).abs().max().item():g}; identical: {torch.equal(ours, theirs)}"
        )
    finally:
        await slabs.aclose()


def main() -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("skipped: transformers is not installed (pip install transformers)")
        return 0
    with tempfile.TemporaryDirectory(prefix="asyncslab-mixtral-") as tmp:
        asyncio.run(run(Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

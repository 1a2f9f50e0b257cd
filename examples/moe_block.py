"""A small tiered mixture-of-experts block whose expert weights ARE views of asyncslab slabs.

For one MoE layer, the planner puts the experts of each tier group ``g`` (``"K3"``, ``"K4"``,
...) into stacked slabs ``<prefix>.<g>.w13.<suffix>`` of shape ``(2, n_g, *item)`` (gate and
up fused) and ``<prefix>.<g>.w2.<suffix>`` of shape ``(n_g, *item)``. :class:`TieredMoEBlock`
has one parameter per such slab (``w13_<g>``, ``w13_suh_<g>``, ``w13_svh_<g>``, ``w2_<g>``,
...) plus the router, and :meth:`TieredMoEBlock.bind` points them at the slabs with
:func:`asyncslab.bind_module` — zero-copy: the parameters share the slabs' memory.

The synthetic checkpoints hold random int16 "trellis" codes, not real EXL3 data, so
:func:`dequantize` is a cheap deterministic *stand-in* for EXL3 decoding (real arithmetic on
every code and scale, but not the real codebook). What matters here is that every expert
computes from its own bytes: the forward pass finds expert ``e`` at
``partition.locate(e) == (group, offset)`` inside its tier's slab.

:func:`reference_forward` computes the same from per-expert tensors read the old way
(``safe_open(...).get_tensor`` one by one, tiers rebuilt with ``torch.stack``), deriving the
tiers from the trellis shapes itself, so a test comparing the two checks the loader's
partition and slot placement, not just its bytes. Both run the same arithmetic in the same
order, so their outputs are bit-identical.

Used by ``examples/server.py`` and ``tests/examples/test_server.py``; importable from other examples
(``examples/`` is on ``sys.path`` when a script in it runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from asyncslab import Plan, SlabSet, bind_module
from asyncslab.rules import ExpertPartition

__all__ = [
    "TieredMoEBlock",
    "checksum",
    "dequantize",
    "make_input",
    "moe_forward",
    "read_layer_tensors",
    "reference_forward",
]

#: Placed suffixes of an EXL3-like expert projection.
SUFFIXES = ("trellis", "suh", "svh")
#: Fused projection -> its shards in order (as the default TieredMoE rule fuses them).
FUSION = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
_TILE = 16

#: (gate, up, down), each dequantised to ``(in, out)`` float32.
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- arithmetic


def _finite(t: torch.Tensor, bound: float) -> torch.Tensor:
    """float32, with NaN/inf zeroed and values clamped: pattern-filled synthetic checkpoints
    (``fill="pattern"``, above ~256 MiB) hold arbitrary bit patterns, NaNs included."""
    return torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_(-bound, bound)


def dequantize(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """Stand-in for EXL3 decoding (NOT the real trellis codebook): an ``(in, out)`` float32
    weight from a ``(in/16, out/16, 16*K)`` int16 trellis and its ``suh`` (in) / ``svh``
    (out) scales.

    Each 16x16 tile takes its 256 values cyclically from the tile's ``16*K`` codes (scaled
    to [-1, 1)), then rows are scaled by ``suh`` and columns by ``svh``.
    """
    rows, cols, length = trellis.shape
    pick = torch.arange(_TILE * _TILE, device=trellis.device) % length
    codes = trellis.float() * (1.0 / 32768.0)
    tiles = codes[..., pick].reshape(rows, cols, _TILE, _TILE)
    weight = tiles.permute(0, 2, 1, 3).reshape(rows * _TILE, cols * _TILE)
    return _finite(suh, 4.0)[:, None] * weight * _finite(svh, 4.0)[None, :]


def _expert_weights(
    w13: torch.Tensor,
    w13_suh: torch.Tensor,
    w13_svh: torch.Tensor,
    w2: torch.Tensor,
    w2_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    offset: int,
) -> ExpertWeights:
    """Expert at ``offset`` of a tier's stacked tensors (w13: ``(2, n, ...)``, w2: ``(n, ...)``)."""
    gate = dequantize(w13[0, offset], w13_suh[0, offset], w13_svh[0, offset])
    up = dequantize(w13[1, offset], w13_suh[1, offset], w13_svh[1, offset])
    down = dequantize(w2[offset], w2_suh[offset], w2_svh[offset])
    return gate, up, down


def moe_forward(
    x: torch.Tensor, router: torch.Tensor, weights_of: Callable[[int], ExpertWeights]
) -> torch.Tensor:
    """Top-1 routed SwiGLU experts: token ``t`` goes to ``argmax(x[t] @ router.T)``, whose
    output is scaled by its softmax probability. ``x`` is ``(tokens, hidden)`` float32."""
    logits = x @ _finite(router, 1e4).t()
    prob, expert = torch.softmax(logits, dim=-1).max(dim=-1)
    out = torch.zeros_like(x)
    for e in torch.unique(expert).tolist():
        rows = (expert == e).nonzero(as_tuple=True)[0]
        gate, up, down = weights_of(int(e))
        h = x[rows]
        y = (F.silu(h @ gate) * (h @ up)) @ down
        out[rows] = y * prob[rows, None]
    return out


def make_input(tokens: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Deterministic ``(tokens, hidden)`` float32 activations (same in every process)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g, dtype=torch.float32)


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: equal only for bit-identical results."""
    t = t.detach().cpu().contiguous()
    n = t.numel() * t.element_size()
    raw = bytes((ctypes.c_ubyte * n).from_address(t.data_ptr())) if n else b""
    return hashlib.sha256(raw).hexdigest()


# --------------------------------------------------------------------------- the block


class TieredMoEBlock(nn.Module):
    """One MoE layer computing straight from its slabs.

    Build it from a plan with :meth:`from_plan` (parameters are shape/dtype placeholders on
    the ``meta`` device: nothing is allocated), then :meth:`bind` it to a :class:`SlabSet`
    once the layer's unit is complete (e.g. from ``on_unit_ready``).
    """

    def __init__(
        self,
        layer: int,
        partition: ExpertPartition,
        slab_of: Mapping[str, str],
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> None:
        super().__init__()
        self.layer = layer
        self.partition = partition
        self.unit = f"layers.{layer}"
        #: parameter name -> slab name, as bind_module takes it.
        self.slab_of = dict(slab_of)
        for name, (shape, dtype) in specs.items():
            placeholder = torch.empty(shape, dtype=dtype, device="meta")
            self.register_parameter(name, nn.Parameter(placeholder, requires_grad=False))
        self.bound = False

    @classmethod
    def from_plan(cls, plan: Plan, layer: int) -> TieredMoEBlock:
        partitions = plan.extras.get("partitions", {})
        if layer not in partitions:
            raise ValueError(
                f"layer {layer} has no experts in this plan (MoE layers: {sorted(partitions)})"
            )
        partition: ExpertPartition = partitions[layer]
        # Any expert slab of the layer gives the prefix: "<prefix>.<group>.<fused>.<suffix>".
        spec = next(
            s
            for s in plan.slabs.values()
            if s.labels.get("kind") == "experts" and s.labels.get("layer") == str(layer)
        )
        layout = spec.labels.get("layout", "shard_major")
        if layout != "shard_major":
            # forward() indexes w13[0, slot] (gate) and w13[1, slot] (up): shard-major only.
            raise ValueError(
                f"layer {layer}: expert slabs are {layout}; this block computes with "
                "shard_major slabs (TieredMoE's default layout)"
            )
        tail = f".{spec.labels['group']}.{spec.labels['projection']}.{spec.labels['suffix']}"
        prefix = spec.name.removesuffix(tail)
        router = prefix.removesuffix(".experts") + ".gate.weight"
        slab_of: dict[str, str] = {}
        for group in partition.groups:
            if not group.isidentifier():
                raise ValueError(f"group name {group!r} cannot name a parameter")
            for fused in FUSION:
                for suffix in SUFFIXES:
                    param = (
                        f"{fused}_{group}" if suffix == "trellis" else f"{fused}_{suffix}_{group}"
                    )
                    slab_of[param] = f"{prefix}.{group}.{fused}.{suffix}"
        slab_of["router"] = router
        missing = [s for s in slab_of.values() if s not in plan.slabs]
        if missing:
            raise ValueError(f"layer {layer}: plan has no slabs {missing[:5]}")
        n_router = plan.slabs[router].shape[0]
        if partition.experts != tuple(range(n_router)):
            raise ValueError(
                f"layer {layer}: router has {n_router} rows, partition has experts "
                f"{partition.experts[:8]}..."
            )
        specs = {p: (plan.slabs[s].shape, plan.slabs[s].dtype) for p, s in slab_of.items()}
        return cls(layer, partition, slab_of, specs)

    def bind(self, slabs: SlabSet) -> dict[str, torch.Tensor]:
        """Point every parameter at its slab (zero-copy); the layer's unit must be complete."""
        views = bind_module(self, slabs, self.slab_of, strict=True)
        self.bound = True
        return views

    def expert_weights(self, expert: int) -> ExpertWeights:
        group, offset = self.partition.locate(expert)
        p = self._parameters
        return _expert_weights(
            p[f"w13_{group}"],  # type: ignore[arg-type]
            p[f"w13_suh_{group}"],  # type: ignore[arg-type]
            p[f"w13_svh_{group}"],  # type: ignore[arg-type]
            p[f"w2_{group}"],  # type: ignore[arg-type]
            p[f"w2_suh_{group}"],  # type: ignore[arg-type]
            p[f"w2_svh_{group}"],  # type: ignore[arg-type]
            offset,
        )

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bound:
            raise RuntimeError(f"layer {self.layer} is not bound to slabs yet; call bind()")
        return moe_forward(x, self._parameters["router"], self.expert_weights)  # type: ignore[arg-type]

    @property
    def hidden(self) -> int:
        return int(self._parameters["router"].shape[1])  # type: ignore[union-attr]


# --------------------------------------------------------------------------- the old way

_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


def read_layer_tensors(checkpoint: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """One MoE layer's router and expert tensors, read the old way: every ``*.safetensors``
    file opened with ``safe_open`` and each tensor copied out with ``get_tensor``."""
    root = Path(checkpoint)
    files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
    prefix = f"model.layers.{layer}.mlp."
    wanted = re.compile(
        re.escape(prefix) + r"(gate\.weight|experts\.\d+\.[a-z_]+_proj\.(trellis|suh|svh))"
    )
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if wanted.fullmatch(name):
                    tensors[name] = f.get_tensor(name)
    if prefix + "gate.weight" not in tensors:
        raise KeyError(f"no MoE router {prefix}gate.weight in {root}")
    return tensors


@torch.no_grad()
def reference_forward(
    x: torch.Tensor, tensors: Mapping[str, torch.Tensor], layer: int | None = None
) -> torch.Tensor:
    """The block's output computed from per-expert tensors (see :func:`read_layer_tensors`).

    Tiers are rebuilt here independently of asyncslab: experts grouped by the bit width
    their gate trellis shape says (``last dim / 16``), ordered by id inside a tier, and
    stacked into fresh tensors with ``torch.stack`` as engines do when loading tensor by
    tensor.
    """
    if layer is None:
        layers = {int(m.group(1)) for n in tensors if (m := _ROUTER.fullmatch(n))}
        if len(layers) != 1:
            raise ValueError(f"pass layer=: tensors hold routers of layers {sorted(layers)}")
        layer = layers.pop()
    p = f"model.layers.{layer}.mlp"
    router = tensors[f"{p}.gate.weight"]
    n_experts = router.shape[0]

    def t(expert: int, proj: str, suffix: str) -> torch.Tensor:
        return tensors[f"{p}.experts.{expert}.{proj}.{suffix}"]

    bits = {e: t(e, "gate_proj", "trellis").shape[-1] // 16 for e in range(n_experts)}
    tiers: dict[int, tuple[list[int], dict[str, torch.Tensor]]] = {}
    for k in sorted(set(bits.values())):
        members = sorted(e for e, b in bits.items() if b == k)
        stacked: dict[str, torch.Tensor] = {}
        for suffix in SUFFIXES:
            stacked[f"w13.{suffix}"] = torch.stack(
                [
                    torch.stack([t(e, "gate_proj", suffix), t(e, "up_proj", suffix)])
                    for e in members
                ],
                dim=1,
            )
            stacked[f"w2.{suffix}"] = torch.stack([t(e, "down_proj", suffix) for e in members])
        tiers[k] = (members, stacked)

    def weights_of(expert: int) -> ExpertWeights:
        members, s = tiers[bits[expert]]
        return _expert_weights(
            s["w13.trellis"],
            s["w13.suh"],
            s["w13.svh"],
            s["w2.trellis"],
            s["w2.suh"],
            s["w2.svh"],
            members.index(expert),
        )

    return moe_forward(x, router, weights_of)

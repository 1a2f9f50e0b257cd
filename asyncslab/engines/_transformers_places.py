"""Where each checkpoint tensor goes in a transformers model, found by transformers' own
conversion mapping and without a byte of payload.

transformers 5 renames checkpoint keys and fuses them with the model's own list of weight
transforms (``transformers.conversion_mapping.get_model_conversion_mapping``): each key is
renamed by ``core_model_loading.rename_source_key``, the keys a ``WeightConverter`` collects
are grouped per target in its own (natural) order, then its operations run on them:
``MergeModulelist(dim)`` stacks a pattern's tensors, ``Concatenate(dim)`` joins the patterns.
Both only place bytes, so here they are run on shapes instead of tensors: a stack's ``i``-th
tensor lands at index ``i`` of ``dim``, a concatenation's at its running offset along
``dim``. The result is, per checkpoint tensor, a parameter and the view of it the tensor
fills (:class:`Place`). Every other operation (a transpose, a chunk, a permutation, a
quantizer's), and a change of dtype, is not a placement: its group is left to run through
transformers' own converter on the real bytes (:class:`Converted`).

Coverage follows from the construction and is checked here, before any read: a stack has
exactly one tensor per index, a concatenation's parts add up to the parameter, and every
parameter has its group; a missing, extra, misshapen or mistyped tensor is an asyncslab error
naming it. A quantized checkpoint (a ``quantization_config``) has no places at all in a model
built without transformers' quantizer: :func:`refuse_quantized` refuses it from its config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import (
    CoverageError,
    DtypeMismatchError,
    PlanError,
    ShapeMismatchError,
    UnmatchedTensorError,
)

__all__ = ["Converted", "Place", "Places", "Shape", "places", "refuse_quantized"]


class Shape(Protocol):
    """What is needed of a checkpoint tensor here: its shape and dtype (a ``TensorInfo``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True, slots=True)
class Place:
    """Checkpoint tensor ``tensor`` fills ``target`` (a state-dict name) at the view made by
    ``steps``, in order: ``("select", dim, index)`` or ``("narrow", dim, start, length)``."""

    tensor: str
    target: str
    steps: tuple[tuple[Any, ...], ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (the target) this checkpoint tensor fills."""
        for step in self.steps:
            if step[0] == "select":
                tensor = tensor.select(step[1], step[2])
            else:
                tensor = tensor.narrow(step[1], step[2], step[3])
        return tensor


@dataclass(frozen=True, slots=True)
class Converted:
    """Checkpoint tensors that reach ``target`` through transformers' own ``converter``
    (``None``: a plain copy, cast to the target's dtype), for the reason ``why``.
    ``tensors`` are per source pattern, in the order the converter collects them."""

    target: str
    converter: Any
    tensors: Mapping[str, tuple[str, ...]]
    why: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for ns in self.tensors.values() for n in ns)


@dataclass(frozen=True, slots=True)
class Places:
    """Every checkpoint tensor's fate: ``placed`` (read straight into its view),
    ``converted`` (through transformers' code), ``skipped`` (keys the model ignores on load).
    ``missing_buffers`` are persistent buffers no tensor writes: the model initialises them
    itself, as ``from_pretrained`` does. ``missing_tied`` are tied weights absent from the
    checkpoint whose partner is there: tied to it afterwards."""

    placed: tuple[Place, ...]
    converted: tuple[Converted, ...]
    skipped: tuple[str, ...]
    missing_buffers: tuple[str, ...]
    missing_tied: tuple[str, ...] = ()


# --- the converter's operations, run on shapes ------------------------------------------


@dataclass(frozen=True, slots=True)
class _Leaf:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Stack:
    dim: int
    children: tuple[_Node, ...]
    pattern: str


@dataclass(frozen=True, slots=True)
class _Cat:
    dim: int
    children: tuple[_Node, ...]


_Node = _Leaf | _Stack | _Cat


class _NotPlacement(Exception):
    """An operation that computes rather than places; its group goes to transformers."""


def _simulate(converter: Any, collected: Mapping[str, list[_Leaf]]) -> _Node:
    """The node a converter's operations build from ``collected`` (pattern -> leaves), as
    its ``convert`` would build the tensor (``WeightConverter.convert`` and the ops'
    ``convert`` in transformers' ``core_model_loading``)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, _Node | list[_Leaf]] = dict(collected)
    for op in converter.operations:
        # Exact types: a subclass (a quantizer's) may compute as well as place.
        if type(op) is MergeModulelist:
            size = len(state)
            merged: dict[str, _Node | list[_Leaf]] = {}
            for pattern, value in state.items():
                key = op.get_target_pattern(size, pattern, converter.target_patterns)
                merged[key] = (
                    _Stack(op.dim, tuple(value), pattern) if isinstance(value, list) else value
                )
            state = merged
        elif type(op) is Concatenate:
            parts: list[_Node] = []
            for pattern in converter.source_patterns:
                if pattern in state:
                    value = state.pop(pattern)
                    parts.extend(value if isinstance(value, list) else [value])
            state = {op.get_target_pattern(converter.target_patterns): _Cat(op.dim, tuple(parts))}
        else:
            raise _NotPlacement(f"transformers' {type(op).__name__} is not a placement")
    if len(state) != 1:
        raise _NotPlacement(f"{len(state)} targets from one converter")
    (value,) = state.values()
    if isinstance(value, list):
        if len(value) != 1:
            raise _NotPlacement(f"{len(value)} tensors and no operation to join them")
        return value[0]
    return value


def _shape(node: _Node) -> tuple[int, ...]:
    """The node's shape; raises for parts that the operation could not join."""
    if isinstance(node, _Leaf):
        return node.shape
    shapes = [_shape(c) for c in node.children]
    if not shapes:
        raise _NotPlacement("an operation with no tensors")
    if isinstance(node, _Stack):
        first = shapes[0]
        for child, shape in zip(node.children, shapes, strict=True):
            if shape != _majority(shapes):
                raise ShapeMismatchError(
                    f"shape {list(shape)}, its siblings under {node.pattern!r} are "
                    f"{list(_majority(shapes))}: transformers stacks them into one parameter",
                    tensor=_first_leaf(child),
                    expected=_majority(shapes),
                    got=shape,
                )
        dim = _dim(node.dim, len(first) + 1)
        return (*first[:dim], len(shapes), *first[dim:])
    first = shapes[0]
    dim = _dim(node.dim, len(first))
    for child, shape in zip(node.children, shapes, strict=True):
        if (
            len(shape) != len(first)
            or shape[:dim] + shape[dim + 1 :] != first[:dim] + first[dim + 1 :]
        ):
            raise ShapeMismatchError(
                f"shape {list(shape)} cannot be concatenated along dim {dim} with "
                f"{list(first)} ({_first_leaf(node.children[0])!r})",
                tensor=_first_leaf(child),
                expected=first,
                got=shape,
            )
    return (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1 :])


def _majority(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    return max(set(shapes), key=shapes.count)


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _first_leaf(node: _Node) -> str:
    while not isinstance(node, _Leaf):
        node = node.children[0]
    return node.name


def _leaves(node: _Node) -> list[str]:
    if isinstance(node, _Leaf):
        return [node.name]
    return [n for c in node.children for n in _leaves(c)]


def _resolve(
    node: _Node, target: str, shape: tuple[int, ...], steps: tuple[tuple[Any, ...], ...]
) -> list[Place]:
    """Each leaf of ``node`` and the view of ``target`` (of ``shape`` there) it fills."""
    if isinstance(node, _Leaf):
        if node.shape != shape:
            raise ShapeMismatchError(
                f"shape {list(node.shape)}, the model expects {list(shape)} for {target!r}",
                tensor=node.name,
                target=target,
                expected=shape,
                got=node.shape,
            )
        return [Place(node.name, target, steps)]
    if isinstance(node, _Stack):
        dim = _dim(node.dim, len(shape))
        if len(node.children) != shape[dim]:
            raise _count_error(node, target, shape[dim])
        inner = shape[:dim] + shape[dim + 1 :]
        out: list[Place] = []
        for i, child in enumerate(node.children):
            out.extend(_resolve(child, target, inner, (*steps, ("select", dim, i))))
        return out
    dim = _dim(node.dim, len(shape))
    sizes = [_shape(c)[dim] for c in node.children]
    if sum(sizes) != shape[dim]:
        raise ShapeMismatchError(
            f"{', '.join(map(repr, map(_first_leaf, node.children)))} and their siblings "
            f"concatenate to {sum(sizes)} along dim {dim}, {target!r} has {shape[dim]}",
            tensor=_first_leaf(node.children[0]),
            target=target,
            expected=shape[dim],
            got=sum(sizes),
        )
    out = []
    at = 0
    for child, size in zip(node.children, sizes, strict=True):
        part = (*shape[:dim], size, *shape[dim + 1 :])
        out.extend(_resolve(child, target, part, (*steps, ("narrow", dim, at, size))))
        at += size
    return out


def _count_error(node: _Stack, target: str, expected: int) -> CoverageError:
    """A stack of the wrong number of tensors, naming the members missing or extra."""
    names = [_first_leaf(c) for c in node.children]
    member = re.compile(re.escape(node.pattern.strip(".")).replace(r"\*", r"(\d+)") + "$")
    found: dict[int, str] = {}
    for name in names:
        m = member.search(name)
        if m and m.groups():
            found[int(m.group(1))] = name
    missing = [i for i in range(expected) if i not in found]
    extra = sorted(i for i in found if i >= expected)
    example = names[0] if names else ""
    if missing and example and found:
        index, like = next(iter(found.items()))
        start, end = member.search(like).span(1)  # type: ignore[union-attr]
        first = like[:start] + str(missing[0]) + like[end:]
        return CoverageError(
            f"{target!r} stacks {expected} tensors of {node.pattern!r}, the checkpoint has "
            f"{len(names)}: missing index {missing[:8]}" + ("..." if len(missing) > 8 else ""),
            tensor=first,
            slab=target,
            missing=missing,
        )
    return CoverageError(
        f"{target!r} stacks {expected} tensors of {node.pattern!r}, the checkpoint has "
        f"{len(names)}" + (f": unexpected index {extra[:8]}" if extra else ""),
        tensor=found[extra[0]] if extra else example,
        slab=target,
        expected=expected,
        got=len(names),
    )


# --- the whole model --------------------------------------------------------------------


def places(
    model: Any,
    tensors: Mapping[str, Shape],
    conversions: Sequence[Any],
    *,
    dtype_of: Callable[[str, torch.Tensor], torch.dtype],
    dtype: torch.dtype,
    cast: bool,
) -> Places:
    """Where every checkpoint tensor in ``tensors`` goes in ``model`` (built on the meta
    device), renamed and grouped by ``conversions`` (``get_model_conversion_mapping``'s
    list) exactly as ``convert_and_load_state_dict_in_model`` does. ``dtype_of`` gives a
    target's dtype once loaded (the model's ``dtype_plan`` may keep one in float32);
    ``cast``: a checkpoint tensor of another dtype is cast (asked for), else refused unless
    its target is kept in another dtype than the model's ``dtype`` on purpose (a float32
    router bias in a bfloat16 model), which transformers casts to.

    Raises, before any read: :class:`UnmatchedTensorError` for checkpoint tensors the model
    has no place for, :class:`CoverageError` for a parameter no tensor (or a wrong number
    of tensors) fills, :class:`ShapeMismatchError` and :class:`DtypeMismatchError`.
    Marks the conversions it used as transformers does (``was_used``), for saving."""
    state = model.state_dict()
    groups, also, skipped = _grouped(model, tensors, conversions, state)
    missing_buffers, missing_tied = _uncovered(model, state, groups, also)
    placed: list[Place] = []
    converted: list[Converted] = []
    for target, (converter, collected) in groups.items():
        meta = state[target]
        want = dtype_of(target, meta)
        found = _place(target, converter, collected, meta, tensors, want, dtype, cast)
        if isinstance(found, Converted):
            converted.append(found)
        else:
            placed.extend(found)
    return Places(
        tuple(placed), tuple(converted), tuple(skipped), tuple(missing_buffers), tuple(missing_tied)
    )


_Groups = dict[str, tuple[Any, dict[str, list[str]]]]


def _grouped(
    model: Any, tensors: Mapping[str, Shape], conversions: Sequence[Any], state: dict[str, Any]
) -> tuple[_Groups, dict[str, str], list[str]]:
    """Per target, its converter (``None``: a plain rename) and its checkpoint tensors per
    source pattern, in natural order; the other targets of converters that make several
    (a Chunk's) -> the first; the tensors the model ignores on load."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    prefix = model.base_model_prefix
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    ignored = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ]
    groups: _Groups = {}
    also: dict[str, str] = {}
    unmatched: list[str] = []
    skipped: list[str] = []
    for name in sorted(tensors, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, prefix, state)
        if target not in state and name in state:
            target, pattern = rename_source_key(
                name, [], [], base_model_prefix=prefix, meta_state_dict=state
            )
        if target not in state:
            (skipped if any(p.search(name) for p in ignored) else unmatched).append(name)
            continue
        converter = by_pattern[pattern] if pattern is not None else None
        held, collected = groups.setdefault(target, (converter, {}))
        if held is not converter or (converter is None and collected):
            other = next(n for ns in collected.values() for n in ns)
            raise CoverageError(
                f"{name!r} and {other!r} both map to {target!r}: a byte may come from one "
                "checkpoint tensor only",
                tensor=name,
                slab=target,
            )
        collected.setdefault(pattern or name, []).append(name)
        if converter is not None:
            first = converter.target_patterns[0]
            for other in converter.target_patterns[1:]:
                also[target.replace(first, other)] = target
    if unmatched:
        raise UnmatchedTensorError(
            f"{len(unmatched)} checkpoint tensor(s) have no place in "
            f"{type(model).__name__}: {unmatched[:5]}" + ("..." if len(unmatched) > 5 else ""),
            tensor=unmatched[0],
            unmatched=unmatched,
        )
    return groups, also, skipped


def _uncovered(
    model: Any, state: Mapping[str, Any], groups: _Groups, also: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """The persistent buffers and tied weights no tensor writes (the model initialises or
    ties them); raises for a parameter no tensor writes."""
    buffers = {n for n, _ in model.named_buffers()}
    # target -> source; either may be absent when the other is there (from_pretrained ties
    # whichever is loaded to the other, and unties two that differ).
    tied: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    partner = {**{s: t for t, s in tied.items()}, **tied}
    missing_buffers: list[str] = []
    missing_tied: list[str] = []
    for key in state:
        if key in groups or key in also:
            continue
        if key in partner and partner[key] in groups:
            missing_tied.append(key)
        elif key in buffers:
            missing_buffers.append(key)
        else:
            guess = _by_analogy(key, groups)
            raise CoverageError(
                f"parameter {key!r} {list(state[key].shape)} comes from no checkpoint tensor"
                + (f"; by analogy, expected {guess!r}" if guess else ""),
                tensor=guess,
                slab=key,
            )
    return missing_buffers, missing_tied


def _place(
    target: str,
    converter: Any,
    collected: Mapping[str, list[str]],
    meta: torch.Tensor,
    tensors: Mapping[str, Shape],
    want: torch.dtype,
    dtype: torch.dtype,
    cast: bool,
) -> list[Place] | Converted:
    """One target's tensors and their views of it, or the group left to transformers."""
    leaves = {p: [_Leaf(n, tuple(tensors[n].shape)) for n in ns] for p, ns in collected.items()}
    try:
        node = (
            _simulate(converter, leaves) if converter is not None else leaves[next(iter(leaves))][0]
        )
        found = _resolve(node, target, tuple(meta.shape), ())
    except _NotPlacement as err:
        return Converted(target, converter, _frozen(collected), str(err))
    odd = [n for n in _leaves(node) if tensors[n].dtype != want]
    if odd:
        got = tensors[odd[0]].dtype
        if not cast and want == dtype:
            raise DtypeMismatchError(
                f"dtype {got}, the model's {target!r} is {want}; asyncslab casts only when "
                "asked (dtype=...)",
                tensor=odd[0],
                target=target,
                expected=want,
                got=got,
            )
        return Converted(target, converter, _frozen(collected), f"cast from {got} to {want}")
    if not all(p.view(meta).is_contiguous() for p in found):
        return Converted(target, converter, _frozen(collected), "not one byte run in the parameter")
    return found


def _frozen(collected: Mapping[str, list[str]]) -> Mapping[str, tuple[str, ...]]:
    return {p: tuple(ns) for p, ns in collected.items()}


_NUMBER = re.compile(r"\d+")


def _by_analogy(key: str, groups: _Groups) -> str | None:
    """The checkpoint name a missing ``key`` would have, from a sibling (the same name but
    for its numbers: another layer's) whose tensors were found."""
    shape = _NUMBER.sub("#", key)
    mine = _NUMBER.findall(key)
    for other, (_, collected) in groups.items():
        if other == key or _NUMBER.sub("#", other) != shape:
            continue
        theirs = _NUMBER.findall(other)
        name = next(n for ns in collected.values() for n in ns)
        for t, m in zip(theirs, mine, strict=True):
            if t != m:
                name = re.sub(rf"(?<![\d]){t}(?![\d])", m, name, count=1)
        return name
    return None


# --- quantized checkpoints: no places without transformers' quantizer --------------------


#: Why a method's checkpoint needs transformers' quantizer (as of transformers 5.19); any
#: other method is named by its quantizer's class.
_QUANTIZER_WORK: Mapping[str, str] = {
    "fp8": (
        "its float8 weights and block scales (weight_scale_inv) need transformers' "
        "FineGrainedFP8 quantizer: FP8 layers on a GPU that computes in FP8, every weight "
        "dequantized to bfloat16 elsewhere"
    ),
    "compressed-tensors": (
        "its compressed weights and scales need transformers' CompressedTensors quantizer: "
        "layers that hold them compressed and decompress them at the first forward (or at "
        "load)"
    ),
}


def _quantization(config: Any) -> Mapping[str, Any] | None:
    """The config's ``quantization_config`` as a dict, found as transformers'
    ``get_hf_quantizer`` finds it (the config's, or if that is empty its decoder's text
    config's); ``None`` where there is none. An empty one is found too: transformers refuses
    it for naming no method."""
    found = getattr(config, "quantization_config", None)
    if not found and callable(getattr(config, "get_text_config", None)):
        found = getattr(config.get_text_config(decoder=True), "quantization_config", None)
    if found is None:
        return None
    if isinstance(found, Mapping):
        return found
    # A QuantizationConfigMixin: the config of a model transformers loaded, passed as config=.
    as_dict = getattr(found, "to_dict", None)
    return (
        as_dict() if callable(as_dict) else {"quant_method": getattr(found, "quant_method", None)}
    )


def _quant_method(quantization: Mapping[str, Any]) -> str | None:
    """The method as transformers' quantizer mapping names it (bitsandbytes' by its bits, as
    ``AutoHfQuantizer`` does); ``None`` for a config that names none."""
    for bits in ("4bit", "8bit"):
        if quantization.get(f"load_in_{bits}"):
            return f"bitsandbytes_{bits}"
    method = quantization.get("quant_method")
    return str(getattr(method, "value", method)) if method is not None else None


def refuse_quantized(config: Any, where: str) -> None:
    """Refuse a quantized checkpoint, from its config alone. asyncslab builds the model
    without transformers' quantizer, so the checkpoint's tensors (float8 weights and their
    scales, packed int4) have no place in it, or worse, a place of another meaning; loading
    it as ``from_pretrained`` does needs the quantizer's layers and weight transforms.
    Raises :class:`PlanError` naming ``where`` (the config's path) and the method; its
    ``details`` hold ``method``, ``format`` (compressed-tensors'), ``expected`` and ``got``."""
    quantization = _quantization(config)
    if quantization is None:
        return
    method = _quant_method(quantization)
    fmt = quantization.get("format")  # compressed-tensors' layout, where it says one
    fmt = fmt if isinstance(fmt, str) else None
    details = {"method": method, "format": fmt, "expected": None, "got": method}
    if method is None:
        raise PlanError(
            "quantization_config names no quant_method, which transformers' from_pretrained "
            "refuses too (expected no quantization_config, or one naming its method). No "
            "weight was read",
            file=where,
            **details,
        )
    named = f"{method!r} (format {fmt!r})" if fmt else repr(method)
    raise PlanError(
        f"quantization_config with quant_method {named}: asyncslab.transformers takes "
        f"unquantized checkpoints only (expected no quantization_config); {_work(method)}. "
        "Load it with transformers' own from_pretrained. No weight was read",
        file=where,
        **details,
    )


def _work(method: str) -> str:
    """Why a checkpoint quantized with ``method`` needs transformers' quantizer."""
    work = _QUANTIZER_WORK.get(method)
    if work is not None:
        return work
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    quantizer = AUTO_QUANTIZER_MAPPING.get(method)
    if quantizer is None:
        return (
            "transformers has no quantizer for it (it would skip the config with a warning); "
            "asyncslab does not guess"
        )
    return (
        f"it needs transformers' {quantizer.__name__}, which replaces layers or transforms weights"
    )

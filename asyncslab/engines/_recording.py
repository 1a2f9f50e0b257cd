"""Where an engine's own weight loaders put each checkpoint tensor, found without its bytes.

An engine fuses, shards and pads weights in code of its own (vLLM: a ``weight_loader`` per
parameter, a ``load_weights`` per model). Rather than a table of names per architecture,
:func:`capture` runs that code once on *stand-ins* — tensors of each checkpoint tensor's
shape and dtype whose memory is never read — under a dispatch mode that intercepts every
``copy_`` out of a stand-in: instead of copying, it records which bytes of the stand-in go to
which bytes of which destination (a parameter's storage). Views (``narrow``, ``slice``,
``unbind``, ...) run for real, on the stand-in, so a copy's source and destination are
plain strided views whose geometry is the answer.

What is not a byte-for-byte copy is *transformed* and recorded as such, with why: a copy
that converts dtype, an operation that computes from the stand-in (its result is tracked as
derived from it), a value read (``.item()``: the loader branched on garbage), a copy into a
temporary, a copy too fragmented to be worth reading run by run (a transpose). The loader
of the engine must then be run again on the real tensor; nothing is guessed.

Writes into destinations that do not come from a stand-in (vLLM zero-fills the padding of
a vocabulary) run for real while recording and are recorded as *fills*.

A loader that reads a destination's values (vLLM's MoE loader compares an expert's input
scale with the one an earlier tensor wrote there) reads, while recorded, bytes no copy has
changed: what it does with the real ones cannot be known. Every tensor that writes bytes it
reads so is transformed too (:data:`READ_BACK`), and goes through the loader, in order.
"""

from __future__ import annotations

import bisect
import itertools
import math
import mmap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError

__all__ = ["Capture", "Fill", "Run", "Write", "capture", "MIN_RUN_BYTES", "READ_BACK"]

aten = torch.ops.aten

#: A byte copy is read run by run (one contiguous range of source and destination each);
#: runs shorter than this (a transpose's, one element long) are left to the engine.
MIN_RUN_BYTES = 16
#: Nor is a copy of more runs than this read run by run.
MAX_RUNS = 1 << 22
#: Why a tensor is transformed when the loader reads the bytes it writes.
READ_BACK = "the loader reads back bytes it writes"


@dataclass(frozen=True, slots=True)
class Run:
    """``nbytes`` bytes of checkpoint tensor ``tensor`` from byte ``src`` on, copied as they
    are to byte ``dst`` of destination ``target`` (an index into ``Capture.targets``)."""

    tensor: str
    src: int
    nbytes: int
    target: int
    dst: int


@dataclass(frozen=True, slots=True)
class Write:
    """Bytes ``[start, end)`` of destination ``target`` written from ``tensor``, not as a
    byte copy (see :class:`Capture`)."""

    tensor: str
    target: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Fill:
    """Bytes ``[start, end)`` of destination ``target`` written by the loader itself, from
    no checkpoint tensor (``op``: what wrote them); done while recording."""

    op: str
    target: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Capture:
    """What one run of an engine's loader over stand-ins did.

    ``targets`` are the destination storages as ``(name, flat byte view)``: the first
    parameter (or buffer) seen on each storage names it, byte offsets count from the
    storage's start. ``runs`` are byte copies; ``writes`` and ``transformed`` (tensor ->
    why) the tensors whose bytes the engine changes on the way; ``fills`` what it wrote of
    its own; ``untouched`` the tensors it took without writing them anywhere (it skips
    them), in order.
    """

    targets: tuple[tuple[str, torch.Tensor], ...]
    runs: tuple[Run, ...]
    writes: tuple[Write, ...]
    fills: tuple[Fill, ...]
    transformed: Mapping[str, str]
    yielded: tuple[str, ...]
    untouched: tuple[str, ...]
    ops: Mapping[str, int] = field(default_factory=dict)
    #: The tensors given to the loader when it wrote a fill (see :class:`Fill`).
    filling: frozenset[str] = frozenset()


def capture(
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], Any],
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    targets: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
) -> Capture:
    """Run ``load`` (an engine's ``load_weights``) on stand-ins of ``tensors`` (name, dtype,
    shape), recording where each lands among ``targets`` (the engine's parameters and
    buffers, by name). Stand-ins live on ``device``, as the tensors a checkpoint reader
    would hand the engine. Raises :class:`CaptureError` if ``load`` raises, naming the
    tensor it was given last."""
    recorder = _Recorder(targets)
    given = list(tensors)
    make = _Reservation(given).take if torch.device(device).type == "cpu" else None

    def stand_ins() -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in given:
            recorder.current = name
            # Never read, nor written: its pages stay unbacked (virtual memory only). Made
            # outside the mode, which would otherwise see (and pay for) the allocation.
            with _disable_current_modes():
                if make is not None:
                    tensor = make(shape, dtype)
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
            recorder.stand_in(name, tensor)
            recorder.yielded.append(name)
            yield name, tensor
        recorder.current = None

    try:
        with recorder:
            load(stand_ins())
    except Exception as err:
        raise CaptureError(
            f"the engine's weight loader failed on it ({type(err).__name__}: {err})",
            tensor=recorder.current,
        ) from err
    return recorder.result()


class _Reservation:
    """Host stand-ins carved out of one private anonymous mapping, never touched: one
    ``mmap`` for all of them instead of one each (and a ``munmap`` each after), a share of
    recording a model of many tensors. Each stand-in still has a storage of its own
    (``frombuffer`` at its own offset), which is how the recorder tells them apart."""

    _ALIGN = 64

    def __init__(self, given: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        total = sum(self._aligned(math.prod(shape) * dtype.itemsize) for _, dtype, shape in given)
        self._map = mmap.mmap(-1, max(total, self._ALIGN), flags=mmap.MAP_PRIVATE)
        self._at = 0

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self._ALIGN) * self._ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._at)
        self._at += self._aligned(count * dtype.itemsize)
        return flat.view(shape)


@dataclass(slots=True)
class _Origin:
    names: tuple[str, ...]
    #: The tensor's byte offset of the storage's first byte, for a stand-in (or a plain
    #: contiguous copy of one); None for a tensor computed from stand-ins.
    base: int | None
    itemsize: int = 0


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, targets: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current: str | None = None
        self.yielded: list[str] = []
        self._targets: list[tuple[str, torch.Tensor]] = []
        self._target_of: dict[int, int] = {}
        self._given: list[tuple[str, torch.Tensor, int]] = []
        for name, tensor in targets:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            self._given.append((name, tensor, tensor.data_ptr()))
            if ptr in self._target_of or storage.nbytes() == 0:
                continue
            self._target_of[ptr] = len(self._targets)
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            self._targets.append((name, flat))
        self._origins: dict[int, _Origin] = {}
        self._keep: list[torch.Tensor] = []  # stand-ins and derived tensors: their pointers
        self.runs: list[Run] = []
        self.writes: list[Write] = []
        self.fills: list[Fill] = []
        self.transformed: dict[str, str] = {}
        self.written: set[str] = set()
        self.ops: dict[str, int] = {}
        self.filling: set[str] = set()
        # Per target: the byte runs recorded so far, to notice a fill over one of them.
        self._claimed: dict[int, list[tuple[int, int, str]]] = {}
        # Per target: the byte spans the loader read the values of, and with which op.
        self._read: dict[int, list[tuple[int, int, str]]] = {}

    # --- bookkeeping -----------------------------------------------------------------

    def stand_in(self, name: str, tensor: torch.Tensor) -> None:
        self._keep.append(tensor)
        if tensor.numel():
            self._origins[_storage_ptr(tensor)] = _Origin((name,), 0, tensor.element_size())

    def _origin(self, tensor: Any) -> _Origin | None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return None
        return self._origins.get(_storage_ptr(tensor))

    def _transform(self, names: Iterable[str], why: str) -> None:
        for name in names:
            self.transformed.setdefault(name, why)

    def result(self) -> Capture:
        for name, tensor, data_ptr in self._given:
            if tensor.data_ptr() != data_ptr:
                raise CaptureError(
                    f"the engine's loader replaced the memory of {name!r} instead of writing "
                    "into it: asyncslab cannot load this model in place"
                )
        untouched = tuple(n for n in self.yielded if n not in self.written)
        if self._read:
            self._transform_read_back()
        return Capture(
            targets=tuple(self._targets),
            runs=tuple(r for r in self.runs if r.tensor not in self.transformed),
            writes=tuple(self.writes)
            + tuple(
                Write(r.tensor, r.target, r.dst, r.dst + r.nbytes)
                for r in self.runs
                if r.tensor in self.transformed
            ),
            fills=tuple(self.fills),
            transformed=dict(self.transformed),
            yielded=tuple(self.yielded),
            untouched=untouched,
            ops=dict(self.ops),
            filling=frozenset(self.filling),
        )

    # --- the dispatch ----------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = _op(func)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            origin = self._origin(src)
            if origin is not None:
                self._count(op)
                self._copy(dst, src, origin)
                return dst
        leaves = _leaves(args, kwargs)
        origins = [o for o in map(self._origin, leaves) if o is not None]
        if not origins:
            out = func(*args, **kwargs)
            if op.mutates_first:
                self._maybe_fill(op.name, args)
            elif not (op.is_view or op.makes_new):
                self._maybe_read(op.name, leaves)
            return out
        self._count(op)
        names = tuple(dict.fromkeys(itertools.chain.from_iterable(o.names for o in origins)))
        if (
            func in _COPIES
            and len(origins) == 1
            and origins[0].base is not None
            and isinstance(args[0], torch.Tensor)
            and args[0].is_contiguous()
            and _same_dtype(func, args, kwargs)
        ):
            return self._stand_in_copy(args[0], origins[0], _device(func, args, kwargs))
        if not (op.is_view or op.mutates_first or op.makes_new):
            self._maybe_read(op.name, leaves)
        out = func(*args, **kwargs)
        if func in _VALUE_READS or not isinstance(out, (torch.Tensor, tuple, list)):
            self._transform(names, f"the loader reads its values ({op.name})")
            return out
        if op.mutates_first and self._origin(args[0]) is not None:
            # In place (``mul_``): the stand-in, and every view of it, now stands for other
            # bytes than the checkpoint's.
            self._transform(names, f"the loader changes it in place ({op.name})")
            return out
        if op.is_view:  # the common case (narrow, unbind): its origin is the input's
            return out
        inputs = {_storage_ptr(o) for o in leaves if o.numel()}
        results, _ = tree_flatten(out)
        for result in results:
            if not isinstance(result, torch.Tensor) or not result.numel():
                continue
            ptr = _storage_ptr(result)
            if ptr in inputs:  # a view after all: its storage (and origin) is the input's
                continue
            self._transform(names, f"the loader computes from it ({op.name})")
            self._keep.append(result)
            self._origins[ptr] = _Origin(names, None)
        return out

    def _stand_in_copy(
        self, src: torch.Tensor, origin: _Origin, device: torch.device
    ) -> torch.Tensor:
        """A contiguous copy of a stand-in (to the target device, say): a stand-in too,
        made, never filled."""
        out = torch.empty(src.shape, dtype=src.dtype, device=device)
        start = origin.base
        assert start is not None
        base = start + int(src.storage_offset()) * src.element_size()
        self._keep.append(out)
        if out.numel():
            self._origins[_storage_ptr(out)] = _Origin(origin.names, base, src.element_size())
        return out

    def _count(self, op: _Op) -> None:
        self.ops[op.name] = self.ops.get(op.name, 0) + 1

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, origin: _Origin) -> None:
        names = origin.names
        self.written.update(names)
        target = self._target_of.get(_storage_ptr(dst))
        if target is None:
            # Into a temporary (or another stand-in): what the engine does with it next
            # comes from that; it is derived.
            self._transform(names, "the loader copies it into a temporary")
            if dst.numel():
                self._keep.append(dst)
                self._origins[_storage_ptr(dst)] = _Origin(names, None)
            return
        why = None
        if origin.base is None:
            why = "the loader computes from it before the copy"
        elif src.dtype != dst.dtype:
            why = f"the copy converts {src.dtype} to {dst.dtype}"
        elif tuple(src.shape) != tuple(dst.shape):
            why = f"the copy broadcasts {list(src.shape)} to {list(dst.shape)}"
        runs = None
        if why is None and origin.base is not None:
            itemsize = src.element_size()
            runs = _runs(
                dst.shape,
                itemsize,
                origin.base + int(src.storage_offset()) * itemsize,
                src.stride(),
                int(dst.storage_offset()) * itemsize,
                dst.stride(),
            )
            if runs is None:
                why = "the copy is not contiguous enough to read as byte runs"
        if runs is not None:
            (name,) = names
            claimed = self._claimed.setdefault(target, [])
            for s, d, n in runs:
                self.runs.append(Run(name, s, n, target, d))
                claimed.append((d, d + n, name))
            return
        assert why is not None
        self._transform(names, why)
        for start, end in _spans(dst):
            for name in names:
                self.writes.append(Write(name, target, start, end))

    def _maybe_read(self, op: str, leaves: list[Any]) -> None:
        """Note the destination bytes an op that computes from its inputs read."""
        for leaf in leaves:
            if not leaf.numel():
                continue
            target = self._target_of.get(_storage_ptr(leaf))
            if target is not None:
                spans = self._read.setdefault(target, [])
                spans.extend((start, end, op) for start, end in _spans(leaf))

    def _transform_read_back(self) -> None:
        # Per target, the spans read, sorted by start with the furthest end so far: a
        # write's overlap is then one bisection (an MoE layer's loader reads a slot per
        # expert, hundreds, and writes there as many times).
        read: dict[int, tuple[list[int], list[int], list[str]]] = {}
        for target, spans in self._read.items():
            spans.sort()
            reach, ends = 0, []
            for _, end, _ in spans:
                reach = max(reach, end)
                ends.append(reach)
            read[target] = ([a for a, _, _ in spans], ends, [op for _, _, op in spans])
        writes = [(r.target, r.dst, r.dst + r.nbytes, r.tensor) for r in self.runs]
        writes += [(w.target, w.start, w.end, w.tensor) for w in self.writes]
        for target, start, end, name in writes:
            found = read.get(target)
            if found is None:
                continue
            starts, ends, ops = found
            # The last span starting before this write's end; one reaching past its start
            # at or before it reads some of its bytes.
            i = bisect.bisect_left(starts, end) - 1
            if i >= 0 and ends[i] > start:
                j = bisect.bisect_right(ends, start, 0, i + 1)
                # Over any other reason: the overlaps' resolution must hand the loader
                # every such tensor (_overwrites), which it tells by this one.
                self.transformed[name] = f"{READ_BACK} ({ops[j]})"

    def _maybe_fill(self, op: str, args: tuple[Any, ...]) -> None:
        """Record what an in-place op (``op``) the loader ran for real wrote into a
        destination."""
        if not args or not isinstance(args[0], torch.Tensor):
            return
        dst = args[0]
        if not dst.numel():
            return
        target = self._target_of.get(_storage_ptr(dst))
        if target is None:
            return
        if self.current is not None:
            self.filling.add(self.current)
        for start, end in _spans(dst):
            self.fills.append(Fill(op, target, start, end))
            # Done now, before any read: bytes a tensor was recorded to fill earlier would
            # end up with the tensor's bytes, not the fill's. Leave those to the engine.
            for a, b, name in self._claimed.get(target, ()):
                if a < end and start < b:
                    self._transform((name,), f"the loader overwrites part of it ({op})")


_COPIES = frozenset({aten._to_copy.default, aten.clone.default})
_VALUE_READS = frozenset(
    {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
)


def _leaves(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
    """The tensors among an op's arguments (one level of lists or tuples deep, as aten
    schemas nest them, so ``tree_flatten``'s general walk is not needed): this runs for
    every op the loader dispatches, where ``tree_flatten`` would be a large share of
    recording a model (figures in docs/performance.md)."""
    out = []
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


@dataclass(frozen=True, slots=True)
class _Op:
    name: str
    #: In place on its first argument (``fill_``, ``mul_``).
    mutates_first: bool
    #: Its results alias its inputs (``slice``, ``unbind``).
    is_view: bool
    #: Makes a tensor from its input's metadata alone (``new_zeros``, ``empty_like``).
    makes_new: bool = False


def _op(func: Any) -> _Op:
    """What the dispatch asks of an op, worked out once per op: it runs for every op the
    loader dispatches, and the schema walk is a share of recording worth saving."""
    known = _OPS.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        name = str(getattr(func, "__name__", func))
        base = name.partition(".")[0]
        known = _OPS[func] = _Op(
            name=name,
            mutates_first=first is not None and first.is_write,
            is_view=bool(getattr(func, "is_view", False)),
            makes_new=base.startswith(("new_", "empty")) or base.endswith("_like"),
        )
    return known


_OPS: dict[Any, _Op] = {}


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s storage starts: its identity here. Arithmetic on two ints rather
    than ``untyped_storage()``, which makes a Python object per call."""
    return int(tensor.data_ptr()) - int(tensor.storage_offset()) * tensor.element_size()


def _same_dtype(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    dtype = kwargs.get("dtype")
    layout = kwargs.get("memory_format")
    return (dtype is None or dtype == args[0].dtype) and layout in (
        None,
        torch.contiguous_format,
        torch.preserve_format,
    )


def _device(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.device:
    device = kwargs.get("device")
    return torch.device(device) if device is not None else args[0].device


def _runs(
    shape: Iterable[int],
    itemsize: int,
    src: int,
    src_strides: Iterable[int],
    dst: int,
    dst_strides: Iterable[int],
) -> list[tuple[int, int, int]] | None:
    """The ``(src byte, dst byte, nbytes)`` runs copying a strided view into another of
    the same shape, or None where they would be too many or too short."""
    dims = [(n, a, b) for n, a, b in zip(shape, src_strides, dst_strides, strict=True) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return []
    inner = 1
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:
        inner *= dims.pop()[0]
    nbytes = inner * itemsize
    count = math.prod(n for n, _, _ in dims)
    if dims and (nbytes < MIN_RUN_BYTES or count > MAX_RUNS):
        return None
    runs = []
    for index in itertools.product(*(range(n) for n, _, _ in dims)):
        s = src + itemsize * sum(i * a for i, (_, a, _) in zip(index, dims, strict=True))
        d = dst + itemsize * sum(i * b for i, (_, _, b) in zip(index, dims, strict=True))
        runs.append((s, d, nbytes))
    return runs


def _spans(view: torch.Tensor) -> list[tuple[int, int]]:
    """The byte ranges of its storage that a strided view covers, merged."""
    itemsize = view.element_size()
    offset = int(view.storage_offset())
    runs = _runs(view.shape, itemsize, 0, view.stride(), offset * itemsize, view.stride())
    if runs is None:  # very fragmented: element by element
        runs = []
        dims = [(n, s) for n, s in zip(view.shape, view.stride(), strict=True) if n != 1]
        for index in itertools.product(*(range(n) for n, _ in dims)):
            at = offset + sum(i * s for i, (_, s) in zip(index, dims, strict=True))
            runs.append((0, at * itemsize, itemsize))
    spans: list[tuple[int, int]] = []
    for _, d, n in sorted(runs, key=lambda r: r[1]):
        if spans and spans[-1][1] >= d:
            spans[-1] = (spans[-1][0], max(spans[-1][1], d + n))
        else:
            spans.append((d, d + n))
    return spans

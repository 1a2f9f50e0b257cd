"""The memory of a :class:`~._slabs.SlabSet`'s slabs (:class:`SlabMemory`): its one
allocation, or the tensors it was given, and where the routes of the plan being loaded land
in it (the :class:`~._sink.Sink` each load writes through).

Allocated once, never moved: loads write in place, so every pointer stays valid across
resets and reloads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._failures import first_line
from ..errors import LoadError, PlanError
from ..planning import Plan, route_column
from ._sink import Reads, Sink
from ._tracker import Tracker

__all__ = ["SlabMemory", "device_for", "slab_layout"]


class SlabMemory:
    """The slabs of ``plan`` on ``device``: views of one allocation of asyncslab's own, or
    ``tensors`` given (one per slab, written in place, never freed here). Per load it keeps
    the plan being loaded (:attr:`run_plan`, same slab layout), its tracker and its reads."""

    run_plan: Plan
    tracker: Tracker
    # Per route of the run plan: the byte tensor its slab lies in, and where in it the slab
    # starts.
    _route_bytes: list[torch.Tensor]
    _route_base: list[int]

    def __init__(
        self, plan: Plan, device: torch.device, tensors: Mapping[str, torch.Tensor] | None
    ) -> None:
        self.plan = plan
        self.device = device
        # The slab tensors made so far; the given tensors' bytes, per slab (None where the
        # slabs are views of one allocation of asyncslab's own); each slab's offset in the
        # backing.
        self._tensors, self._given, self._offset, self.backing = _memory(plan, tensors, device)
        #: Units whose given tensors were let go of (:meth:`release`).
        self.released: set[str] = set()
        self.adopt(plan)

    def tensor(self, name: str) -> torch.Tensor:
        """Slab ``name`` (made when first asked for: a view of the backing)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            spec = self.plan.slabs[name]
            start = self._offset[name]
            tensor = self.backing[start : start + spec.nbytes].view(spec.dtype).view(spec.shape)
            self._tensors[name] = tensor
        return tensor

    def adopt(self, plan: Plan) -> None:
        """Load ``plan`` (of the same slab layout) from now on: its routes, a tracker."""
        self.run_plan = plan
        slabs = route_column(plan.routes, "slab")
        self._route_base = list(map(self._offset.__getitem__, slabs))
        if self._given is None:
            self._route_bytes = [self.backing] * len(slabs)
        else:
            self._route_bytes = list(map(self._given.__getitem__, slabs))
        self.tracker = Tracker(plan)
        # Per unit, its slabs and the run plan's routes into them (for release, when asked).
        self._units: dict[str, tuple[list[str], list[int]]] | None = None
        # Plans are immutable and the slabs stay put, so a reload with the same options
        # reuses its reads, destinations included.
        self.read_plans: dict[tuple[str, int, int], Reads] = {}

    @property
    def given(self) -> bool:
        """Whether the slabs are tensors given (an engine's), not an allocation of its own."""
        return self._given is not None

    def release(self, unit: str) -> None:
        """Let go of the given tensors of ``unit``'s slabs: the engine that lent them frees
        their memory once it drops them too (its processing replacing a layer's weights while
        later layers load). Only for given tensors, and only once no read writes into them."""
        assert self._given is not None, "an allocation of asyncslab's own is freed whole"
        if self._units is None:
            # Once per plan, not a pass over every slab and route per layer (on the loop).
            self._units = {}
            for name, spec in self.plan.slabs.items():
                self._units.setdefault(spec.unit, ([], []))[0].append(name)
            for route, of in enumerate(route_column(self.run_plan.routes, "unit")):
                self._units.setdefault(of, ([], []))[1].append(route)
        slabs, routes = self._units.get(unit, ((), ()))
        for name in slabs:
            self._tensors.pop(name, None)
            self._given.pop(name, None)
        # The sink's per-route list is this one: its copies see the entries go too.
        released = torch.empty(0, dtype=torch.uint8, device=self.device)
        for route in routes:
            self._route_bytes[route] = released
        self.released.add(unit)

    def sink(self) -> Sink:
        """Where a load of the run plan lands, counted by the tracker."""
        backing = self.backing if self._given is None else None
        return Sink(
            self.run_plan,
            self.device,
            self._route_bytes,
            self._route_base,
            self.tracker,
            backing=backing,
        )

    def free(self) -> None:
        """Let go of every slab (views still held elsewhere keep their memory)."""
        self._tensors.clear()
        self._given = None
        self._route_bytes = []
        self.backing = torch.empty(0, dtype=torch.uint8, device=self.device)


def device_for(
    device: str | torch.device | None, tensors: Mapping[str, torch.Tensor] | None
) -> torch.device:
    """The device the slabs go on: ``device``, else the given tensors', else the CPU."""
    if device is None:
        device = _device_of(tensors) if tensors else "cpu"
    chosen = torch.device(device)
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {chosen} is not supported (cpu or cuda)")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {chosen} requested, but CUDA is not available")
    if chosen.type == "cuda" and chosen.index is None:
        # "cuda" means the current device when the slabs are made; pinned here, as the
        # copies run on I/O threads, whose current device is device 0 (on several GPUs
        # their streams, events and registrations would be on the wrong one;
        # test_cuda_device_without_an_index_is_the_current_one).
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _memory(
    plan: Plan, tensors: Mapping[str, torch.Tensor] | None, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, int], torch.Tensor]:
    """The slabs' memory, as :class:`SlabSet` keeps it: the slab tensors made so far, the
    given tensors' bytes per slab (``None`` for an allocation of asyncslab's own), each
    slab's offset in the backing, and the backing."""
    if tensors is None:
        offsets, backing = _allocate(plan, device)
        return {}, None, offsets, backing
    # An engine's own tensors (its parameters, or views of them): written in place, never
    # reallocated; the SlabSet gates access to them as to its own slabs.
    given = _given_bytes(plan, tensors, device)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    return dict(tensors), given, dict.fromkeys(plan.slabs, 0), empty


def slab_layout(plan: Plan, device: torch.device) -> tuple[dict[str, int], int, list[str]]:
    """Where each slab starts in the one allocation that holds them all, the allocation's
    size, and the zero-size slabs. Offsets are multiples of 64 bytes on a CPU (a cache
    line), 256 on CUDA (the alignment its allocator gives a tensor of its own)."""
    align = 256 if device.type == "cuda" else 64
    offsets: dict[str, int] = {}
    empty: list[str] = []
    total = 0
    for name, spec in plan.slabs.items():
        total = -(-total // align) * align
        offsets[name] = total
        nbytes = spec.nbytes
        total += nbytes
        if nbytes == 0:
            empty.append(name)
    return offsets, total, empty


def _allocate(plan: Plan, device: torch.device) -> tuple[dict[str, int], torch.Tensor]:
    """Every slab's offset in one allocation, and the allocation."""
    # One allocation holds every slab; slab tensors are views of it, made when first asked
    # for. An allocation per slab (with its views and a buffer for reads) costs a fixed
    # overhead per slab, which a plan of hundreds of thousands of small tensors multiplies
    # into seconds (figures in docs/performance.md).
    offsets, total, empty = slab_layout(plan, device)
    try:
        backing = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    except RuntimeError as err:
        raise LoadError(
            f"cannot allocate {total} bytes for {len(plan.slabs)} slabs on "
            f"{device}: {first_line(err)}"
        ) from err
    for name in empty:
        spec = plan.slabs[name]
        # A zero-size shape whose other dimensions pass 2**63 is valid in a header but not
        # in torch (a view would not notice): refuse it now.
        try:
            torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        except (RuntimeError, TypeError) as err:
            raise LoadError(
                f"cannot make slab {name!r} of shape {list(spec.shape)} "
                f"({spec.dtype}): {first_line(err)}",
                slab=name,
            ) from err
    return offsets, backing


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(tensors.values())).device


def _given_bytes(
    plan: Plan, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each given slab tensor's bytes, after checking that the tensors are the plan's slabs
    exactly: every slab one, of its dtype and shape, contiguous, on ``device``, and no two
    sharing a byte (each byte is written once; two slabs in one would be a race)."""
    missing = [name for name in plan.slabs if name not in tensors]
    extra = [name for name in tensors if name not in plan.slabs]
    if missing or extra:
        what = f"no tensor for slab {missing[0]!r}" if missing else f"{extra[0]!r} is no slab"
        raise PlanError(
            f"tensors= must hold one tensor per slab of the plan: {what} "
            f"({len(missing)} missing, {len(extra)} not in the plan)",
            slab=(missing or extra)[0],
        )
    spans: list[tuple[int, int, str]] = []
    given: dict[str, torch.Tensor] = {}
    for name, spec in plan.slabs.items():
        tensor = tensors[name]
        got = (tensor.dtype, tuple(tensor.shape))
        if got != (spec.dtype, spec.shape):
            raise PlanError(
                f"tensor for slab {name!r} is {got[0]} {list(got[1])}, the plan's slab "
                f"{spec.dtype} {list(spec.shape)}",
                slab=name,
                expected=(spec.dtype, spec.shape),
                got=got,
            )
        if tensor.device != device:
            raise PlanError(
                f"tensor for slab {name!r} is on {tensor.device}, not {device}", slab=name
            )
        if not tensor.is_contiguous():
            raise PlanError(
                f"tensor for slab {name!r} is not contiguous: reads write its bytes in order",
                slab=name,
            )
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        given[name] = flat
        if spec.nbytes:
            spans.append((flat.data_ptr(), flat.data_ptr() + spec.nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise PlanError(
                f"the tensors for slabs {first!r} and {second!r} share memory: a byte would "
                "be written twice",
                slab=second,
            )
    return given

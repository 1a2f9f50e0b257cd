"""The one byte-for-byte check of a load: every route's destination against what the
safetensors library reads for that tensor (the CLI's ``--verify``, the benchmarks, the
tests, ``asyncslab.testing.verify_slabs``)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..loading import SlabSet
from ..planning import Plan, Route

__all__ = ["ReferenceUnreadable", "Stopped", "VerifyResult", "sample_routes", "verify_slabs"]

# What verify_slabs compares: a SlabSet; its slab tensors by name; or, per route, the
# tensor its bytes landed in (its slot, or just its bytes).
Destination = SlabSet | Mapping[str, torch.Tensor] | Callable[[Route], torch.Tensor]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """``tensors``: routes compared; ``mismatches``: their tensor names; ``details``: what
    differed, one line each."""

    tensors: int
    mismatches: tuple[str, ...]
    details: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tensors": self.tensors,
            "mismatches": list(self.mismatches),
            "details": list(self.details),
            "seconds": self.seconds,
        }

    def describe(self) -> str:
        if self.ok:
            return f"all {self.tensors:,} routed tensors match safetensors byte for byte"
        more = f" and {len(self.details) - 1} more" if len(self.details) > 1 else ""
        return (
            f"{len(self.mismatches):,} of {self.tensors:,} routed tensors differ from "
            f"safetensors: {self.details[0]}{more}"
        )


class ReferenceUnreadable(RuntimeError):
    """The safetensors library could not read a tensor that was loaded."""


class Stopped(Exception):
    """Verification abandoned (``stop`` was set): nobody waits for its result any more."""


def sample_routes(plan: Plan, k: int) -> list[Route]:
    """``k`` routes evenly spread over the plan; every route for ``k`` < 0."""
    routes = plan.routes
    if k < 0:
        return list(routes)
    if not routes or k == 0:
        return []
    step = max(1, len(routes) // k)
    return [routes[i] for i in range(0, len(routes), step)][:k]


def verify_slabs(
    plan: Plan,
    slabs: Destination,
    *,
    routes: Sequence[Route] | None = None,
    stop: threading.Event | None = None,
) -> VerifyResult:
    """Compare each route of ``plan`` (or ``routes``) with ``safe_open(...).get_tensor``:
    the bytes the route carries (the whole tensor, or its slice: a rank's rows, an element
    run) as raw bytes, so NaN payloads and signed zeros count; for a whole tensor in a
    ``SlabSet`` also its slot's dtype and shape. ``stop`` set: raise :class:`Stopped`
    before the next tensor (its caller was interrupted)."""
    started = time.perf_counter()
    chosen = plan.routes if routes is None else routes
    by_file: dict[Path, list[Route]] = defaultdict(list)
    for route in chosen:
        by_file[route.file].append(route)
    where = _destination(plan, slabs)
    mismatches: list[str] = []
    details: list[str] = []
    # Most tensors are a few KiB to a few MiB: waking a pool of threads for each
    # comparison costs more than the comparison itself (figures in docs/performance.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for file, file_routes in by_file.items():
            for route, expected in _read_reference(file, file_routes):
                if stop is not None and stop.is_set():
                    raise Stopped
                why = _compare(route, expected, where, slabs)
                if why is not None:
                    mismatches.append(route.tensor)
                    details.append(f"{route.tensor!r} ({why})")
    finally:
        torch.set_num_threads(threads)
    return VerifyResult(
        tensors=len(chosen),
        mismatches=tuple(mismatches),
        details=tuple(details),
        seconds=time.perf_counter() - started,
    )


def _destination(plan: Plan, slabs: Destination) -> Callable[[Route], torch.Tensor]:
    """Per route, the bytes it landed in."""
    if callable(slabs) and not isinstance(slabs, SlabSet):
        return lambda route: _raw(slabs(route))
    slab = slabs.slab if isinstance(slabs, SlabSet) else slabs.__getitem__
    cache: dict[str, torch.Tensor] = {}

    def where(route: Route) -> torch.Tensor:
        whole = cache.get(route.slab)
        if whole is None:
            whole = cache[route.slab] = _raw(slab(route.slab))
        return whole[route.dst_offset : route.dst_offset + route.nbytes]

    return where


def _compare(
    route: Route,
    expected: torch.Tensor,
    where: Callable[[Route], torch.Tensor],
    slabs: Destination,
) -> str | None:
    if isinstance(slabs, SlabSet) and route.shape is None and route.slice_start == 0:
        got = slabs.view(route.tensor)
        if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
            return (
                f"slot holds {got.dtype} {list(got.shape)}, safetensors reads "
                f"{expected.dtype} {list(expected.shape)}"
            )
    a = where(route)
    if a.device.type != "cpu":
        a = a.cpu()
    b = _raw(expected)[route.slice_start : route.slice_start + route.nbytes]
    if not _same_bytes(a, b):
        if a.numel() != b.numel():
            return f"{a.numel()} bytes landed, safetensors reads {b.numel()}"
        first = int((a != b).nonzero()[0, 0])
        return f"bytes differ, first at byte {first} of {b.numel()}"
    return None


def _read_reference(file: Path, routes: Sequence[Route]) -> Iterator[tuple[Route, torch.Tensor]]:
    """Each route with its tensor as the safetensors library reads it (zero-copy views of
    the mapped file)."""
    from safetensors import safe_open

    route: Route | None = None
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for route in routes:
                yield route, handle.get_tensor(route.tensor)
    except Exception as err:  # safetensors' own SafetensorError derives from Exception only
        what = f"tensor {route.tensor!r} of " if route is not None else ""
        raise ReferenceUnreadable(
            f"the safetensors library cannot read {what}{file}: {err}"
        ) from err


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality of two uint8 vectors, compared in the widest aligned integer words
    (comparing int64 words is several times faster than bytes, and just as exact)."""
    if a.numel() != b.numel():
        return False
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if a.numel() % size == 0 and a.storage_offset() % size == 0 == b.storage_offset() % size:
            return torch.equal(a.view(word), b.view(word))
    return torch.equal(a, b)

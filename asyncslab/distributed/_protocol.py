"""The plumbing of a rank's protocol thread: its collectives, each failure one exception,
and its calls onto the event loop, which may have gone.

A collective that raises means a rank died, hung past the group's timeout, or left: the
caller turns :class:`CollectiveFailed` into the load's verdict. A call onto the loop that
cannot be made (the awaiting coroutine gave up, or the loop closed) raises
:class:`Abandoned`: the thread stops touching the loop but still finishes its collectives,
since the other ranks wait for it in them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._chunks import POLL_S

__all__ = [
    "ABORTED",
    "CANCELLED",
    "FAILED",
    "OK",
    "Abandoned",
    "CollectiveFailed",
    "broadcast",
    "call_in_loop",
    "describe",
    "gather",
]

#: A rank's outcome in the agreement.
OK, FAILED, ABORTED, CANCELLED = "ok", "failed", "aborted", "cancelled"


class CollectiveFailed(Exception):
    """A collective raised: a rank died, hung past the group's timeout, or left."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.error = error


class Abandoned(Exception):
    """The awaiting coroutine gave up (timeout); stop touching the event loop."""


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def gather(group: Any, world: int, obj: dict[str, Any], step: str) -> list[dict[str, Any]]:
    """Every rank's ``obj``, in rank order."""
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as err:
        raise CollectiveFailed(step, err) from err
    return out


def broadcast(tensor: torch.Tensor, owner: int, group: Any, step: str) -> None:
    """``tensor`` from rank ``owner`` of ``group`` to every rank of it."""
    src = owner if group is None else dist.get_global_rank(group, owner)
    try:
        dist.broadcast(tensor, src=src, group=group)
    except Exception as err:
        raise CollectiveFailed(step, err) from err


def call_in_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], abandoned: Callable[[], bool]
) -> Any:
    """Run ``fn`` on ``loop`` (after everything queued before it) and return its result;
    :class:`Abandoned` once ``abandoned()`` says nobody awaits the load any more, or the
    loop has closed."""
    if abandoned():
        raise Abandoned
    cf: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            cf.set_result(fn())
        except BaseException as err:
            cf.set_exception(err)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # the loop is closed
        raise Abandoned from None
    while True:
        try:
            return cf.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            if abandoned():
                raise Abandoned from None

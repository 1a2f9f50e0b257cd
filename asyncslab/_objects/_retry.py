"""A ranged GET retried after a transient failure (a response cut short, a dropped
connection, a 5xx), within one deadline.

The waits between attempts are exponential backoff with decorrelated jitter, as Rust's
object_store (obstore's core) waits between its own retries: each wait is drawn uniformly
between ``base`` and three times the previous one (the first: three times ``base``), at most
``cap``. Many GETs failing together (a server restarting under ``request_concurrency``
threads, or under every rank of a group) then come back spread out rather than in lockstep,
and a long outage still backs off as fast as doubling would.

The deadline (``read_timeout``) bounds the attempts and the waits together: the waits take at
most half of it (fewer where the backoff's worst case is less), and each attempt an equal
share of the rest, enforced by the client (obstore's limit on the whole request; for a
presigned GET, the same limit on every wait of its socket). A server that stops answering
fails the GET within ``read_timeout``, however the waits fell.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import FileChangedError, ReadError, ReadTimeoutError
from ._client import failure_kind
from ._location import ObjectLocation
from ._pinning import changed, current_etag
from ._settings import redacted

__all__ = ["Retries", "retried"]

_T = TypeVar("_T")

#: Where the waits' randomness comes from unless a caller gives its own.
_RANDOM = random.Random()


@dataclass(frozen=True, slots=True)
class Retries:
    """How a GET is retried: ``attempts`` in all, each limited to ``attempt_timeout``
    seconds (None: unlimited), and between them waits of ``base`` to ``cap`` seconds that
    take ``waits`` seconds at most together (see the module's docstring)."""

    attempts: int
    attempt_timeout: float | None
    waits: float
    base: float = 0.05
    cap: float = 1.0

    @classmethod
    def within(
        cls, retries: int, deadline: float | None, base: float = 0.05, cap: float = 1.0
    ) -> Retries:
        """``retries`` retries after the first attempt, all of them and the waits between
        them within ``deadline`` seconds (None: none)."""
        attempts = retries + 1
        worst = sum(min(cap, base * 3.0**k) for k in range(1, attempts))
        if deadline is None:
            return cls(attempts, None, worst, base, cap)
        waits = min(worst, deadline / 2)
        return cls(attempts, (deadline - waits) / attempts, waits, base, cap)

    def delays(self, rng: random.Random) -> Iterator[float]:
        """The waits before each retry (``attempts - 1`` of them), drawn from ``rng``:
        decorrelated jitter, in all at most :attr:`waits`."""
        previous, left = self.base, self.waits
        for _ in range(self.attempts - 1):
            previous = min(self.cap, rng.uniform(self.base, previous * 3.0))
            wait = min(previous, left)
            left -= wait
            yield wait


def retried(
    attempt: Callable[[], _T],
    store: Any,
    location: ObjectLocation,
    offset: int,
    nbytes: int,
    retries: Retries,
    *,
    rng: random.Random | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> _T:
    """``attempt()``'s result (a GET of ``nbytes`` at ``offset`` of ``location``), retried
    as ``retries`` says after a transient failure; a changed, missing or refused object ends
    at once (``store``: to look up a changed object's ETag). ``rng`` and ``sleep``: where
    the waits are drawn from and how they are waited."""
    delays = retries.delays(_RANDOM if rng is None else rng)
    last: Exception | None = None
    kind = "transient"
    for number in range(retries.attempts):
        if number:
            sleep(next(delays))
        try:
            return attempt()
        except FileChangedError:
            raise
        except Exception as err:
            kind = failure_kind(err)
            if kind == "changed" or kind == "missing":
                raise changed(location, current_etag(store, location.key)) from None
            if kind == "denied":
                raise ReadError(
                    f"GET of {_span(offset, nbytes)} refused: access denied "
                    f"({redacted(str(err), location.store)})",
                    file=location.path,
                    offset=offset,
                ) from None
            last = err
    raise _failed(location, offset, nbytes, retries, kind, last)


def _span(offset: int, nbytes: int) -> str:
    return f"bytes {offset}-{offset + nbytes - 1}"


def _failed(
    location: ObjectLocation,
    offset: int,
    nbytes: int,
    retries: Retries,
    kind: str,
    last: Exception | None,
) -> ReadError:
    why = redacted(str(last), location.store)
    span, attempts, timeout = _span(offset, nbytes), retries.attempts, retries.attempt_timeout
    if kind == "timeout":
        each = "" if timeout is None else f" of at most {timeout:.3g} s each, within read_timeout"
        return ReadTimeoutError(
            f"GET of {span} timed out ({attempts} attempts{each}): the server stopped "
            f"answering ({why})",
            file=location.path,
            offset=offset,
            nbytes=nbytes,
        )
    return ReadError(
        f"GET of {span} failed after {attempts} attempts: {why}",
        file=location.path,
        offset=offset,
        nbytes=nbytes,
    )

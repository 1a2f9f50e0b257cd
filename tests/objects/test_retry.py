"""A GET's retries (``_objects/_retry``): waits drawn as decorrelated jitter from a seeded
random source, never slept here (a recording ``sleep`` stands in), all within the deadline."""

from __future__ import annotations

import random
from typing import Any

import pytest

from asyncslab._objects import ObjectLocation, Retries, StoreSpec
from asyncslab._objects._retry import retried
from asyncslab.errors import FileChangedError, ReadError, ReadTimeoutError

LOCATION = ObjectLocation(StoreSpec("s3", "models"), "m/x.safetensors", '"v1"')


def test_the_waits_are_decorrelated_jitter_between_base_and_cap() -> None:
    """Each wait lies in [base, cap] and is at most three times the one before (the first:
    three times base); a seed gives the same waits again, and another seed others."""
    retries = Retries.within(12, None, base=0.05, cap=1.0)
    waits = list(retries.delays(random.Random(7)))
    assert len(waits) == 12
    previous = retries.base
    for wait in waits:
        assert retries.base <= wait <= retries.cap
        assert wait <= previous * 3
        previous = wait
    assert waits == list(retries.delays(random.Random(7)))
    assert waits != list(retries.delays(random.Random(8)))
    assert len(set(waits)) > 1  # jittered: not one fixed schedule


def test_the_waits_grow_retry_by_retry_on_average() -> None:
    """Backoff still: over many seeds, the mean wait grows with each of the first retries,
    and most sequences of twelve reach the cap."""
    retries = Retries.within(12, None, base=0.05, cap=1.0)
    runs = [list(retries.delays(random.Random(seed))) for seed in range(200)]
    means = [sum(run[k] for run in runs) / len(runs) for k in range(12)]
    assert means[0] < means[1] < means[2] < means[3] < means[4]
    assert means[4] > 4 * means[0]
    assert sum(retries.cap in run for run in runs) > len(runs) / 2


def test_the_waits_follow_the_formula_with_the_draws_given() -> None:
    """Each wait is ``min(cap, uniform(base, previous * 3))``: with a source drawing the top
    of every range, the waits triple from base up to the cap."""

    class Top(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return b

    retries = Retries.within(5, None, base=0.1, cap=2.0)
    assert list(retries.delays(Top())) == pytest.approx([0.3, 0.9, 2.0, 2.0, 2.0])


@pytest.mark.parametrize("deadline", [0.2, 1.0, 2.0, 60.0])
@pytest.mark.parametrize("retries", [0, 1, 3, 10])
@pytest.mark.parametrize("seed", range(5))
def test_the_attempts_and_waits_together_stay_within_the_deadline(
    deadline: float, retries: int, seed: int
) -> None:
    """Every attempt at its limit and every wait drawn: the sum is at most the deadline,
    and the waits at most half of it."""
    plan = Retries.within(retries, deadline)
    assert plan.attempts == retries + 1
    assert plan.attempt_timeout is not None
    assert plan.attempt_timeout > 0
    waits = list(plan.delays(random.Random(seed)))
    assert sum(waits) <= min(plan.waits, deadline / 2) + 1e-12
    assert plan.attempts * plan.attempt_timeout + sum(waits) <= deadline + 1e-9


def _failing(errors: list[Exception]) -> Any:
    calls = []

    def attempt() -> str:
        calls.append(len(calls))
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "body"

    return attempt, calls


def test_a_transient_failure_is_retried_after_the_drawn_waits() -> None:
    attempt, calls = _failing([ConnectionResetError("reset"), ConnectionResetError("reset")])
    slept: list[float] = []
    plan = Retries.within(3, 60.0)
    got = retried(attempt, None, LOCATION, 0, 16, plan, rng=random.Random(3), sleep=slept.append)
    assert got == "body"
    assert len(calls) == 3
    assert slept == list(plan.delays(random.Random(3)))[:2]


def test_retries_end_after_the_last_attempt_naming_the_range() -> None:
    attempt, calls = _failing([ConnectionResetError("reset")] * 5)
    slept: list[float] = []
    with pytest.raises(ReadError, match=r"GET of bytes 8-23 failed after 3 attempts: reset"):
        retried(attempt, None, LOCATION, 8, 16, Retries.within(2, 10.0), sleep=slept.append)
    assert len(calls) == 3
    assert len(slept) == 2


def test_a_timeout_says_each_attempts_share_of_the_deadline() -> None:
    attempt, _ = _failing([TimeoutError("operation timed out")] * 2)
    plan = Retries.within(1, 2.0)
    with pytest.raises(ReadTimeoutError, match=r"2 attempts of at most 0\.925 s each"):
        retried(attempt, None, LOCATION, 0, 16, plan, sleep=lambda s: None)


def test_a_refused_or_changed_object_is_not_retried() -> None:
    attempt, calls = _failing([PermissionError("403 Forbidden")])
    with pytest.raises(ReadError, match="access denied"):
        retried(attempt, None, LOCATION, 0, 16, Retries.within(3, 10.0), sleep=lambda s: None)
    assert len(calls) == 1
    changed = FileChangedError("changed", file=LOCATION.path)
    attempt, calls = _failing([changed])
    with pytest.raises(FileChangedError):
        retried(attempt, None, LOCATION, 0, 16, Retries.within(3, 10.0), sleep=lambda s: None)
    assert len(calls) == 1

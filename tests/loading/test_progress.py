"""What a load reports through its progress callback while it runs and when it ends: the
figures a progress bar or a health check shows. The tests of the behaviour an adversarial
pass found missing failed before its fix (see docs/robustness.md); the two about a callback
failing guard the new calls."""

from __future__ import annotations

import asyncio
import gc
import io
import itertools
import math
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

import asyncslab
from asyncslab import Checkpoint, LoadOptions, LoadStatistics, SlabSet, plan
from asyncslab._units import format_duration
from asyncslab.cli._progress import ProgressBar
from asyncslab.loading import _copy as copy_module
from asyncslab.loading._read import pread_scatter
from asyncslab.testing import SyntheticCheckpoint

pytestmark = pytest.mark.timeout(60)

# One thread, many small reads: the reads before a stalled one have all landed when it stalls.
ONE_BY_ONE = LoadOptions(read_size=4 << 10, coalesce_gap=0, io_workers=1, progress_interval=0.1)
STAGED = replace(ONE_BY_ONE, transfer="staged", staging_bytes=4 << 10, staging_buffers=1)
HANG_S = 60.0  # a hang guard only


class Stall:
    """The fifth read of a load stalls until the test calls :meth:`release` (or fails,
    ``fail=True``); records the bytes the reads before it returned. The stall lasts until
    the test has seen what it waits for, not a fixed second that a loaded machine may
    spend elsewhere."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> None:
        self.before: list[int] = []
        self._reached = threading.Event()
        self._release = threading.Event()
        calls = itertools.count()

        def read(*args: Any, **kwargs: Any) -> int:
            i = next(calls)
            if i == 4:
                self._reached.set()
                if fail:
                    raise asyncslab.errors.ReadError("injected EIO", file=kwargs["path"])
                assert self._release.wait(HANG_S), "the stall was never released"
            n = pread_scatter(*args, **kwargs)
            if i < 4:
                self.before.append(n)
            return n

        monkeypatch.setattr(copy_module, "pread_scatter", read)

    @property
    def stalled(self) -> bool:
        """The fifth read is in its thread and not yet released."""
        return self._reached.is_set() and not self._release.is_set()

    def release(self) -> None:
        self._release.set()

    async def reached(self) -> None:
        assert await asyncio.to_thread(self._reached.wait, HANG_S)


def recorder() -> tuple[list[tuple[float, LoadStatistics]], Callable[[LoadStatistics], None]]:
    seen: list[tuple[float, LoadStatistics]] = []
    return seen, lambda stats: seen.append((time.perf_counter(), stats))


@pytest.mark.asyncio
@pytest.mark.parametrize("options", [ONE_BY_ONE, STAGED], ids=["direct", "staged"])
async def test_the_latest_figures_go_out_while_a_read_stalls(
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    options: LoadOptions,
) -> None:
    # Only the first landing of each interval was reported: through a stalled read, the
    # callback was not called at all, and the figures it had last were those of the first
    # read (1.6 % shown while 44.6 % had landed, in the probe that found it).
    ckpt = Checkpoint.open(small_checkpoint.root)
    stall = Stall(monkeypatch)
    seen, record = recorder()
    stalled: list[LoadStatistics] = []  # the calls made while the read stalled

    def current(s: LoadStatistics) -> bool:
        return s.bytes_read == sum(stall.before)

    def progress(stats: LoadStatistics) -> None:
        record(stats)
        if stall.stalled:
            stalled.append(stats)
            # Released once four calls came with the figures of every read before the
            # stall: with the bug (no call during a stall, or stale figures) it never is.
            if sum(map(current, stalled)) >= 4:
                stall.release()

    async with SlabSet(plan(ckpt)) as slabs:
        await slabs.load(ckpt, options=options, progress=progress)
    # From the first call with the four earlier reads counted (a call already queued when
    # the last of them landed may come before it), as the old 0.3 s into the stall did.
    first = next(i for i, s in enumerate(stalled) if current(s))
    during = stalled[first:]
    assert len(during) >= 3  # at every interval, not once
    assert {s.bytes_read for s in during} == {sum(stall.before)}
    assert {s.state for s in during} == {"loading"}
    elapsed = [s.elapsed_s for s in during]
    assert elapsed == sorted(set(elapsed))  # the stall shows: time goes on
    assert seen[-1][1].state == "complete"


@pytest.mark.asyncio
async def test_the_last_read_is_reported_before_slow_unit_callbacks(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # Every read had landed, then a unit callback ran for a while: the callback kept the
    # figures of the first read until the load ended.
    ckpt = Checkpoint.open(small_checkpoint.root)
    p = plan(ckpt)
    seen, progress = recorder()
    done: list[str] = []

    async def on_unit(unit: str, slabs: SlabSet) -> None:
        done.append(unit)
        if len(done) == len(p.units):
            await asyncio.sleep(0.5)

    options = replace(ONE_BY_ONE, io_workers=4, progress_interval=10.0)
    async with SlabSet(p) as slabs:
        await slabs.load(ckpt, options=options, on_unit_ready=on_unit, progress=progress)
    states = [(s.state, s.bytes_landed) for _, s in seen]
    assert states[-2:] == [("loading", p.nbytes), ("complete", p.nbytes)]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["failed", "cancelled"])
async def test_the_last_call_says_how_the_load_ended(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Only a load that completed had a final call: a bar (or a health check fed by the
    # callback) went on showing "loading" with an ETA after a failure.
    ckpt = Checkpoint.open(small_checkpoint.root)
    stall = Stall(monkeypatch, fail=how == "failed")
    seen, progress = recorder()
    async with SlabSet(plan(ckpt)) as slabs:
        task = slabs.start(ckpt, options=ONE_BY_ONE, progress=progress)
        if how == "cancelled":
            await stall.reached()
            task.cancel()
            stall.release()  # the drain waits for it; a cancelled load lands nothing more
        expected = asyncio.CancelledError if how == "cancelled" else asyncslab.errors.ReadError
        with pytest.raises(expected):
            await task
        final = slabs.statistics()
    last = seen[-1][1]
    assert last.state == final.state == how
    # The final figures (a failing read stops the landing of reads it overtook: <=).
    assert last.bytes_landed == final.bytes_landed <= sum(stall.before)
    assert last.elapsed_s == final.elapsed_s
    assert last.eta_s is None
    assert {s.state for _, s in seen[:-1]} <= {"loading"}
    if how == "failed":
        assert "injected EIO" in (last.error or "")


@pytest.mark.asyncio
async def test_a_callback_failing_on_the_final_report_does_not_hide_the_error(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(small_checkpoint.root)
    Stall(monkeypatch, fail=True)

    def progress(stats: LoadStatistics) -> None:
        if stats.state != "loading":
            raise ValueError("display gone")

    async with SlabSet(plan(ckpt)) as slabs:
        with pytest.raises(asyncslab.errors.ReadError, match="injected EIO"):
            await slabs.load(ckpt, options=ONE_BY_ONE, progress=progress)
        assert slabs.state == "failed"


@pytest.mark.asyncio
async def test_a_callback_failing_between_landings_fails_the_load(
    small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Called from the interval's timer (nothing landing during the stall), not from a
    # landing: the error must still end the load, as one raised on a landing does.
    ckpt = Checkpoint.open(small_checkpoint.root)
    stall = Stall(monkeypatch)
    calls: list[tuple[bool, int]] = []  # (stalled, bytes_read) of each call

    def progress(stats: LoadStatistics) -> None:
        calls.append((stall.stalled, stats.bytes_read))
        # A call during the stall with the same figures as the call before it, also during
        # the stall: nothing landed in between, so the interval's timer made it (the old
        # test took any call 0.3 s into a one-second stall for one).
        if len(calls) >= 2 and calls[-2] == calls[-1] == (True, sum(stall.before)):
            stall.release()  # the failed load's drain waits for the stalled read
            raise ValueError("display gone")

    async with SlabSet(plan(ckpt)) as slabs:
        with pytest.raises(asyncslab.LoadError, match="display gone") as info:
            await slabs.load(ckpt, options=ONE_BY_ONE, progress=progress)
        assert isinstance(info.value.__cause__, ValueError)
        assert slabs.state == "failed"
        assert not slabs.complete


@pytest.mark.asyncio
async def test_an_async_progress_callback_is_refused_before_the_load(
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    # It was called without being awaited: the load succeeded, the callback never ran, and
    # the only sign was a "coroutine was never awaited" warning.
    ckpt = Checkpoint.open(small_checkpoint.root)

    async def progress(stats: LoadStatistics) -> None:
        pass

    class Display:
        async def __call__(self, stats: LoadStatistics) -> None:
            pass

    async with SlabSet(plan(ckpt)) as slabs:
        for callback in (progress, Display()):
            with pytest.raises(TypeError, match="async function"):
                slabs.start(ckpt, progress=callback)
            with pytest.raises(TypeError, match="async function"):
                await slabs.load(ckpt, progress=callback)
        assert slabs.state == "empty"  # nothing began
        # A plain function handing back a coroutine is found at its first call.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(asyncslab.LoadError, match="plain function") as info:
                await slabs.load(ckpt, progress=lambda stats: progress(stats))
            gc.collect()
        assert isinstance(info.value.__cause__, TypeError)
        assert not [w for w in caught if "never awaited" in str(w.message)]
        await slabs.load(ckpt)  # usable after


def stats(landed: int, needed: int, elapsed: float, state: str = "loading") -> LoadStatistics:
    return LoadStatistics(
        state=state,  # type: ignore[arg-type]
        device="cpu",
        files=1,
        tensors=1,
        tensors_landed=0,
        units=1,
        units_complete=0,
        bytes_total=needed,
        bytes_needed=needed,
        bytes_read=landed,
        bytes_landed=landed,
        reads=1,
        elapsed_s=elapsed,
        staging_budget=0,
        staging_peak=0,
    )


def test_no_eta_until_a_percent_has_landed_and_a_second_passed() -> None:
    # 1 MiB of 100 GiB after a slow first read gave "ETA 28h43m".
    assert stats(1 << 20, 100 << 30, 1.01).eta_s is None
    assert stats(50, 100, 0.5).eta_s is None
    assert stats(2, 100, 1.0).eta_s == pytest.approx(49.0)
    assert stats(50, 100, 2.0).eta_s == pytest.approx(2.0)
    assert stats(50, 100, 2.0, state="failed").eta_s is None
    assert stats(0, 100, 5.0).eta_s is None


@pytest.mark.parametrize("interval", [-0.1, math.nan, math.inf])
def test_an_interval_that_is_no_interval_is_refused(interval: float) -> None:
    # A negative one re-armed the timer at once, forever: the loop spun.
    with pytest.raises(ValueError, match="progress_interval"):
        LoadOptions(progress_interval=interval)


# --------------------------------------------------------------------------- rates and the bar


def partial(landed: int, needed: int, total: int, elapsed: float) -> LoadStatistics:
    """A load of ``needed`` of a checkpoint's ``total`` bytes (one rank's share)."""
    return replace(stats(landed, needed, elapsed), bytes_total=total)


def test_eta_of_a_partial_load_counts_only_the_bytes_it_needs() -> None:
    """A rank loading half a checkpoint: an ETA over every byte of the checkpoint showed
    three times the time left (the half the rank never reads counted as still to come)."""
    assert partial(50, 100, 200, 2.0).eta_s == pytest.approx(2.0)


def test_rate_is_in_gigabytes_not_gibibytes() -> None:
    """The bar says "GB/s": a rate in GiB/s would understate it by 7 %."""
    assert stats(10**9, 10**9, 1.0).gbps == pytest.approx(1.0)
    assert stats(3 * 10**9, 4 * 10**9, 2.0).gbps == pytest.approx(1.5)


class Clock:
    """A fake ``time.monotonic``: moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    """What a terminal receives."""

    def isatty(self) -> bool:
        return True


class BrokenStream(io.StringIO):
    """A closed pipe: every write fails; counts the attempts."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def frames(text: str) -> list[str]:
    """The lines rich's terminal bar drew, in order, without their escape codes (each
    redraw goes back to the line's start with ``\r``)."""
    return [f for f in ANSI.sub("", text).rstrip("\n").split("\r") if f]


def test_a_partial_load_fully_landed_shows_100_percent() -> None:
    """A rank that landed all of its share (half the checkpoint) is done: measured against
    the whole checkpoint, the bar stopped at 50 % and the log's last line said so."""
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=False, clock=Clock())
    bar(partial(100, 100, 200, 1.0))
    bar.finish()
    line = stream.getvalue()
    assert "100.0%" in line
    assert "50.0%" not in line


@pytest.mark.parametrize("plain", [False, True], ids=["rich", "plain"])
def test_the_bar_never_overflows_past_100_percent(plain: bool) -> None:
    """More landed than expected (a figure from a retried read, a rounding): the bar is
    full, not longer than its frame and not over 100 %."""
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=True, plain=plain, width=200, clock=Clock())
    bar(stats(150, 100, 1.0))
    bar.finish()
    if plain:
        (frame,) = stream.getvalue().splitlines()
        assert "[" + "#" * 24 + "]" in frame
        assert frame.count("#") == 24
    else:
        frame = frames(stream.getvalue())[-1]
        assert frame.count("━") == 24  # rich's bar, its 24 cells and no more
    assert "100.0%" in frame
    assert "150.0%" not in frame


def test_a_shorter_redraw_blanks_the_rest_of_the_longer_line() -> None:
    """On a terminal each frame overwrites the last one in place: a shorter frame not padded
    left the tail of the longer one on screen, after the new text. rich erases the line
    (``ESC [2K``) before each redraw."""
    stream = Tty()
    bar = ProgressBar(stream, width=200, clock=Clock())
    assert bar.tty
    bar(replace(stats(10, 100, 2.0), units=100, units_complete=99))
    (long,) = frames(stream.getvalue())
    bar(replace(stats(20, 100, 0.5), units=100, units_complete=1))  # no ETA yet: "--"
    first, second = frames(stream.getvalue())
    assert first == long
    assert stream.getvalue().split("\r")[1].startswith("\x1b[2K")
    assert len(second.rstrip(" ")) < len(long.rstrip(" "))
    assert "ETA --" in second


@pytest.mark.parametrize("plain", [False, True], ids=["rich", "plain"])
def test_finishing_a_terminal_bar_that_drew_nothing_writes_nothing(plain: bool) -> None:
    """A load that reported nothing (it failed at once): finish() must not leave an empty
    line in the user's terminal (nor hide its cursor)."""
    stream = Tty()
    ProgressBar(stream, plain=plain, width=200, clock=Clock()).finish()
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("tty", "plain"), [(True, False), (True, True), (False, False)], ids=["tty", "plain", "log"]
)
def test_nothing_is_written_after_finish(tty: bool, plain: bool) -> None:
    """A late snapshot (the loader's last call racing the CLI's finish()) drew a bar after
    the line was ended, in the middle of whatever the CLI printed next."""
    stream = io.StringIO()
    clock = Clock()
    bar = ProgressBar(stream, tty=tty, plain=plain, width=200, clock=clock)
    bar(stats(10, 100, 0.5))
    bar.finish()
    written = stream.getvalue()
    clock.now += 10.0
    bar(stats(50, 100, 2.0))
    bar(stats(100, 100, 3.0, state="complete"))
    bar.finish()
    assert stream.getvalue() == written


@pytest.mark.parametrize(
    ("tty", "plain"), [(True, False), (True, True), (False, False)], ids=["tty", "plain", "log"]
)
def test_a_failing_stream_is_written_once_then_left_alone(tty: bool, plain: bool) -> None:
    """A closed pipe (``asyncslab load | head``): the first failed write disables the bar;
    retrying on every snapshot raised and swallowed an error ten times a second, and no
    error reaches the load (nor rich's handler of a broken pipe, which exits)."""
    stream = BrokenStream()
    clock = Clock()
    bar = ProgressBar(stream, tty=tty, plain=plain, width=200, clock=clock)
    for i in range(1, 6):
        clock.now += 2.0
        bar(stats(i * 10, 100, float(i)))
    bar(stats(100, 100, 6.0, state="complete"))
    bar.finish()
    assert stream.writes == 1


def test_a_log_line_is_printed_when_exactly_one_interval_has_passed() -> None:
    """Snapshots that arrive exactly ``interval`` apart (a loader ticking on the same
    period) must each print: a strict ``>`` printed none of them until the final line."""
    stream = io.StringIO()
    clock = Clock()
    bar = ProgressBar(stream, tty=False, interval=0.5, clock=clock)
    clock.now += 0.5
    bar(stats(10, 100, 0.5))
    assert stream.getvalue().count("\n") == 1
    clock.now += 0.5
    bar(stats(20, 100, 1.0))
    assert stream.getvalue().count("\n") == 2
    clock.now += 0.25
    bar(stats(30, 100, 1.25))  # within the interval: held back
    assert stream.getvalue().count("\n") == 2


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (9.5, "9.50s"),
        (59, "59s"),
        (60, "1m00s"),
        (61, "1m01s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
    ],
)
def test_durations_change_unit_at_the_minute_and_the_hour(seconds: float, shown: str) -> None:
    """A bar counting down showed "60s" for a minute, between "1m01s" and "59s"."""
    assert format_duration(seconds) == shown


@pytest.mark.parametrize("seconds", [math.nan, -1.0, None])
def test_an_unknown_duration_is_shown_as_dashes(seconds: float | None) -> None:
    """An ETA of NaN (a rate from no time) must show "--", not raise out of the bar and
    fail the load it reports on."""
    assert format_duration(seconds) == "--"


def test_an_infinite_duration_is_shown_as_dashes() -> None:
    """An endless ETA (a rate of zero) is as unknown as NaN: it must show "--", not raise
    (it raised OverflowError)."""
    assert format_duration(math.inf) == "--"


@pytest.mark.parametrize(
    ("seconds", "shown"), [(9.994, "9.99s"), (9.999, "10s"), (59.4, "59s"), (59.6, "1m00s")]
)
def test_a_duration_that_rounds_up_takes_the_next_unit(seconds: float, shown: str) -> None:
    """Rounded for display after the unit was chosen, 59.6 s read "60s" beside "1m00s" for
    60 s, and 9.999 s "10.00s": the unit follows the rounded value."""
    assert format_duration(seconds) == shown

"""The progress bar of a load on the command line, fed by load snapshots (the loader calls
``progress(stats)`` at most once per ``LoadOptions.progress_interval``, and once at the end).

With rich installed (``pip install 'asyncslab[cli]'``) a terminal gets rich's bar, redrawn in
place. Without rich, with ``plain=True``, and anywhere else (a CI log, a pipe): plain lines,
at most one per ``interval`` seconds plus a final one, so that a log of a long load stays
short and a fast load prints one line; on a terminal each line draws the bar in ``#``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any, TextIO, cast

from .._units import format_bytes, format_duration
from ..loading import LoadStatistics
from ._tables import isatty

__all__ = ["ProgressBar"]

_CELLS = 24  # of the bar


class ProgressBar:
    """Progress of one load on ``stream`` (default ``sys.stderr``); call it with snapshots.

    ``tty`` overrides the terminal detection; ``plain=True`` keeps to plain lines on a
    terminal too (as without rich); ``interval`` is the least time between two plain lines;
    ``width`` is rich's line width (default: the terminal's). Writing errors (a closed pipe)
    disable the bar rather than break the load it reports on. Call :meth:`finish` once the
    load has ended, also when it failed, so the next output starts on a fresh line.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        plain: bool = False,
        interval: float = 1.0,
        label: str = "loading",
        width: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = _Guarded(stream if stream is not None else sys.stderr)
        self.tty = isatty(self._stream.stream) if tty is None else bool(tty)
        self._rich = None if plain or not self.tty else _RichBar.create(self._stream, width)
        self._interval = interval
        self._label = label
        self._clock = clock
        self._last_print = clock()
        self._pending: LoadStatistics | None = None  # last snapshot not yet printed
        self._finished = False

    def __call__(self, stats: LoadStatistics) -> None:
        self.update(stats)

    def update(self, stats: LoadStatistics) -> None:
        if self._stream.broken or self._finished:
            return
        if self._rich is not None:
            self._rich.show(self._head(stats), self._fraction(stats), self.render(stats))
            return
        now = self._clock()
        if stats.state != "loading" or now - self._last_print >= self._interval:
            self._last_print = now
            self._pending = None
            self._stream.write(self.render(stats, bar=self.tty, head=True) + "\n")
        else:
            self._pending = stats

    def finish(self) -> None:
        """End the bar's line: rich's last frame, or the last unprinted snapshot."""
        if self._finished:
            return
        self._finished = True
        if self._stream.broken:
            return
        if self._rich is not None:
            self._rich.stop()
        elif self._pending is not None:
            self._stream.write(self.render(self._pending, bar=self.tty, head=True) + "\n")
        self._pending = None

    def render(self, stats: LoadStatistics, *, bar: bool = False, head: bool = False) -> str:
        """One line: ``[label] [[bar]] pct done/total rate ETA units``."""
        total = stats.bytes_needed or stats.bytes_total
        done = stats.bytes_landed
        fraction = self._fraction(stats)
        parts = [self._head(stats)] if head else []
        if bar:
            filled = int(fraction * _CELLS)
            parts.append("[" + "#" * filled + "-" * (_CELLS - filled) + "]")
        parts.append(f"{fraction * 100:5.1f}%")
        parts.append(f"{format_bytes(done, unit_of=total)}/{format_bytes(total)}")
        parts.append(f"{stats.gbps:6.2f} GB/s")
        if stats.state == "loading":
            parts.append(f"ETA {format_duration(stats.eta_s)}")
        else:
            parts.append(f"in {format_duration(stats.elapsed_s)}")
        parts.append(f"units {stats.units_complete}/{stats.units}")
        return "  ".join(parts)

    def _head(self, stats: LoadStatistics) -> str:
        return f"{self._label:<8}" if stats.state == "loading" else f"{stats.state:<8}"

    @staticmethod
    def _fraction(stats: LoadStatistics) -> float:
        total = stats.bytes_needed or stats.bytes_total
        if not total:
            return 1.0 if stats.state != "loading" else 0.0
        return min(1.0, stats.bytes_landed / total)


class _Guarded:
    """The bar's stream, a write error (a closed pipe) turned into ``broken``: after the
    first failed write nothing more is written, and no error reaches the load. rich writes
    through it too."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.broken = False
        self.encoding = getattr(stream, "encoding", None) or "utf-8"  # rich reads it

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):
                self.broken = True
        return len(text)

    def flush(self) -> None:
        pass  # each write flushes

    def isatty(self) -> bool:
        return isatty(self.stream)


class _RichBar:
    """rich's progress bar, started by the first snapshot (a load that reported nothing
    leaves the terminal as it was); redrawn on each snapshot, by no thread of its own."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress
        self._task: Any = None

    @classmethod
    def create(cls, stream: _Guarded, width: int | None) -> _RichBar | None:
        """``None`` without rich."""
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn
        except ImportError:
            return None
        console = Console(
            file=cast(IO[str], stream), force_terminal=True, width=width, highlight=False
        )
        progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(bar_width=_CELLS),
            TextColumn("{task.fields[figures]}", markup=False),
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        return cls(progress)

    def show(self, head: str, fraction: float, figures: str) -> None:
        if self._task is None:
            self._task = self._progress.add_task(
                head, total=1.0, completed=fraction, figures=figures
            )
            self._progress.start()  # draws the first frame
        else:
            self._progress.update(self._task, description=head, completed=fraction, figures=figures)
            self._progress.refresh()

    def stop(self) -> None:
        if self._task is not None:
            self._progress.stop()  # the last frame, then a newline

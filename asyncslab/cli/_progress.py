"""Terminal output for the command line: a progress bar fed by load snapshots and a table
(sizes and durations are written by ``asyncslab._units``).

Dependency-free on purpose: the CLI runs on servers and in CI where nothing beyond the
package's own requirements is installed. The bar takes :class:`~asyncslab.LoadStatistics`
snapshots (the loader calls ``progress(stats)`` at most once per
``LoadOptions.progress_interval``, and once at the end):

* on a terminal it redraws one line in place with ``\\r``;
* anywhere else (a CI log, a pipe) it prints at most one line per ``interval`` seconds plus
  a final line, so a log of a long load stays short and a fast load prints one line.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TextIO

from .._units import format_bytes, format_duration

__all__ = ["ProgressBar", "format_table"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str] | None = None,
    *,
    align: str | None = None,
    indent: str = "",
) -> str:
    """Plain-text table: columns separated by two spaces, a dashed rule under the headers.

    ``align`` has one character per column, ``"l"`` or ``"r"``; by default a column whose
    cells are all numbers is right-aligned and every other column left-aligned. Ints are
    printed as they are; floats with three significant decimals.
    """
    n_cols = max([len(headers or ())] + [len(r) for r in rows]) if (rows or headers) else 0
    if align is None:
        align = "".join(
            "r" if rows and all(_is_number(r[c]) for r in rows if c < len(r)) else "l"
            for c in range(n_cols)
        )
    if len(align) != n_cols or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {n_cols} characters of 'l'/'r', got {align!r}")

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return "" if value is None else str(value)

    text_rows = [[cell(v) for v in r] + [""] * (n_cols - len(r)) for r in rows]
    head = list(headers) + [""] * (n_cols - len(headers)) if headers is not None else None
    widths = [
        max([len(r[c]) for r in text_rows] + ([len(head[c])] if head else [0]))
        for c in range(n_cols)
    ]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(cells, widths, align, strict=True)
        ]
        return (indent + "  ".join(parts)).rstrip()

    out = []
    if head is not None:
        out.append(line(head))
        out.append(indent + "  ".join("-" * w for w in widths))
    out.extend(line(r) for r in text_rows)
    return "\n".join(out)


class Snapshot(Protocol):
    """What the bar reads from a :class:`~asyncslab.LoadStatistics`."""

    @property
    def state(self) -> str: ...
    @property
    def bytes_landed(self) -> int: ...
    @property
    def bytes_needed(self) -> int: ...
    @property
    def bytes_total(self) -> int: ...
    @property
    def units(self) -> int: ...
    @property
    def units_complete(self) -> int: ...
    @property
    def elapsed_s(self) -> float: ...
    @property
    def gbps(self) -> float: ...
    @property
    def eta_s(self) -> float | None: ...


class ProgressBar:
    """Progress of one load on ``stream`` (default ``sys.stderr``); call it with snapshots.

    ``tty`` overrides the terminal detection; ``interval`` is the least time between two
    lines when not on a terminal. Writing errors (a closed pipe) disable the bar rather
    than break the load it reports on. Call :meth:`finish` once the load has ended, also
    when it failed, so the next output starts on a fresh line.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        interval: float = 1.0,
        label: str = "loading",
        width: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        if tty is None:
            try:
                tty = self._stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty = bool(tty)
        self._interval = interval
        self._label = label
        self._width = width
        self._clock = clock
        self._last_print = clock()
        self._drawn = 0  # characters of the line currently on screen (terminal mode)
        self._pending: Snapshot | None = None  # last snapshot not yet printed (log mode)
        self._finished = False
        self._broken = False

    def __call__(self, stats: Snapshot) -> None:
        self.update(stats)

    def update(self, stats: Snapshot) -> None:
        if self._broken or self._finished:
            return
        final = stats.state != "loading"
        if self.tty:
            self._draw(self.render(stats, bar=True))
            return
        now = self._clock()
        if final or now - self._last_print >= self._interval:
            self._last_print = now
            self._pending = None
            self._write(self.render(stats, bar=False) + "\n")
        else:
            self._pending = stats

    def finish(self) -> None:
        """End the line: a newline after a redrawn line, or the last unprinted snapshot."""
        if self._finished:
            return
        self._finished = True
        if self._broken:
            return
        if self.tty:
            if self._drawn:
                self._write("\n")
        elif self._pending is not None:
            self._write(self.render(self._pending, bar=False) + "\n")
        self._pending = None

    def render(self, stats: Snapshot, *, bar: bool) -> str:
        """One line: ``label [bar] pct done/total rate ETA units``."""
        total = stats.bytes_needed or stats.bytes_total
        done = stats.bytes_landed
        fraction = min(1.0, done / total) if total else (1.0 if stats.state != "loading" else 0.0)
        parts = [f"{self._label:<8}" if stats.state == "loading" else f"{stats.state:<8}"]
        if bar:
            cells = 24
            filled = int(fraction * cells)
            parts.append("[" + "#" * filled + "-" * (cells - filled) + "]")
        parts.append(f"{fraction * 100:5.1f}%")
        parts.append(f"{format_bytes(done, unit_of=total)}/{format_bytes(total)}")
        parts.append(f"{stats.gbps:6.2f} GB/s")
        if stats.state == "loading":
            parts.append(f"ETA {format_duration(stats.eta_s)}")
        else:
            parts.append(f"in {format_duration(stats.elapsed_s)}")
        parts.append(f"units {stats.units_complete}/{stats.units}")
        return "  ".join(parts)

    def _draw(self, text: str) -> None:
        width = self._width or shutil.get_terminal_size(fallback=(100, 24)).columns
        text = text[: max(10, width - 1)]
        pad = max(0, self._drawn - len(text))
        self._drawn = len(text)
        self._write("\r" + text + " " * pad)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            self._broken = True

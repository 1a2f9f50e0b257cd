"""The command line's tables: plain text (columns two spaces apart, a dashed rule under the
headers), or, printed on a terminal with rich installed (``pip install 'asyncslab[cli]'``),
rich's table. Off a terminal (a pipe, a CI log, a script reading the output) the text is
always the plain one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["format_table", "isatty"]


def isatty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal; a closed or fd-less stream is not."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def format_table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str] | None = None,
    *,
    align: str | None = None,
    indent: str = "",
    terminal: TextIO | None = None,
) -> str:
    """A table: plain text, or rich's when ``terminal`` (the stream it is printed on) is a
    terminal and rich is installed.

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
    text_rows = [[_cell(v) for v in r] + [""] * (n_cols - len(r)) for r in rows]
    head = list(headers) + [""] * (n_cols - len(headers)) if headers is not None else None
    if terminal is not None and isatty(terminal):
        rendered = _rich_table(text_rows, head, align, indent, terminal)
        if rendered is not None:
            return rendered
    return _plain_table(text_rows, head, align, indent)


def _plain_table(rows: list[list[str]], head: list[str] | None, align: str, indent: str) -> str:
    widths = [
        max([len(r[c]) for r in rows] + ([len(head[c])] if head else [0]))
        for c in range(len(align))
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
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _rich_table(
    rows: list[list[str]], head: list[str] | None, align: str, indent: str, terminal: TextIO
) -> str | None:
    """rich's rendering of the table for ``terminal`` (its width and colours), not yet
    printed; ``None`` without rich. Name/value rows (no headers) are a grid, names bold."""
    try:
        from rich import box
        from rich.console import Console, JustifyMethod
        from rich.padding import Padding
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return None
    if head is None:
        table = Table.grid(padding=(0, 2), pad_edge=False)
    else:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for c, a in enumerate(align):
        justify: JustifyMethod = "right" if a == "r" else "left"
        table.add_column(
            Text(head[c]) if head is not None else "",
            justify=justify,
            style="bold" if head is None and c == 0 else None,
        )
    for r in rows:
        table.add_row(*(Text(v) for v in r))  # Text: a "[" in a path is no markup
    console = Console(file=terminal, force_terminal=True, highlight=False)
    with console.capture() as captured:
        console.print(Padding(table, (0, 0, 0, len(indent)), expand=False))
    return captured.get().rstrip("\n")

"""What every subcommand of the command line shares: the usage error, its output lines, the
event loop a load runs on and the process's peak memory."""

from __future__ import annotations

import os
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, TextIO, TypeVar

from .. import _os
from .._units import format_bytes

__all__ = [
    "PROG",
    "UsageError",
    "bytes_exact",
    "jsonable",
    "out",
    "run_async",
    "stderr_line",
]

PROG = "asyncslab"
_T = TypeVar("_T")


class UsageError(Exception):
    """Bad command line; reported as one line, exit code 2."""


def out(text: str = "", stream: TextIO | None = None) -> None:
    print(text, file=stream if stream is not None else sys.stdout, flush=True)


def stderr_line(text: str) -> None:
    line = text.replace("\r", " ").replace("\n", " ")
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def bytes_exact(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)"


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on uvloop when it is installed (servers use it), else on asyncio."""
    _fill_closed_std_fds()
    return _os.run(coro)


def _fill_closed_std_fds() -> None:
    """Open /dev/null on a closed fd 0, 1 or 2 (`asyncslab load ... <&-`): the loop's own fds
    would take those numbers, and libuv aborts the process (an assertion) on closing one."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)

"""``examples/server.py`` with its load held midway until the test lets it go, so that a
test sees the load under way, part of its bytes landed, for sure: a paced load alone
leaves that to how busy the machine is.

    PYTHONPATH=examples python tests/examples/held_server.py HOLD_AFTER_READS SERVER_ARGS...

The first ``HOLD_AFTER_READS`` reads run; every later one waits until a line arrives on
stdin (or stdin closes: a test that dies lets the server go). Closing the slabs also lets
the reads go, since a shutdown during the load waits for every read: the load is
cancelled before anything read after that lands (``landed`` drops what arrives once the
load's task is cancelling, and ``aclose`` cancels before it first awaits)."""

from __future__ import annotations

import runpy
import sys
import threading
from pathlib import Path
from typing import Any

from asyncslab import SlabSet
from asyncslab.loading import _copy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def hold(after: int) -> None:
    gate = threading.Event()
    lock = threading.Lock()
    started = [0]
    real = _copy.pread_scatter

    def held_read(*args: Any, **kwargs: Any) -> int:
        with lock:
            started[0] += 1
            late = started[0] > after
        if late:
            gate.wait()
        return real(*args, **kwargs)

    def release_on_stdin() -> None:
        sys.stdin.readline()
        gate.set()

    real_aclose = SlabSet.aclose

    async def aclose(self: SlabSet) -> None:
        gate.set()
        await real_aclose(self)

    _copy.pread_scatter = held_read  # type: ignore[assignment]
    SlabSet.aclose = aclose  # type: ignore[method-assign]
    threading.Thread(target=release_on_stdin, name="held-server-gate", daemon=True).start()


if __name__ == "__main__":
    hold(int(sys.argv[1]))
    sys.argv = [str(EXAMPLES / "server.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""The command line on a terminal (a pseudo-terminal here): the README's demo, installed
without extras, shows a progress bar of plain lines; with rich (the ``cli`` extra) it shows
rich's bar and tables. Off a terminal the output stays plain (the other tests of the command
line read it through pipes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pty = pytest.importorskip("pty")  # POSIX only
fcntl = pytest.importorskip("fcntl")
termios = pytest.importorskip("termios")

pytestmark = pytest.mark.timeout(120)

# Makes rich unimportable in the child, as on a machine that installed no extra.
_NO_RICH = """
import importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rich":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
"""
_MAIN = "from asyncslab.cli._main import main\nsys.exit(main(sys.argv[1:]))\n"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_a_terminal(argv: list[str], *, rich: bool, cwd: Path) -> str:
    """Run the command with stdout and stderr on one pseudo-terminal of 120 columns; what
    the terminal received."""
    import struct

    code = "import sys\n" + ("" if rich else _NO_RICH) + _MAIN
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        cwd=cwd,
        env=env,
    )
    os.close(follower)
    received = bytearray()
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, received.decode(errors="replace")[-3000:]
    return received.decode()


def test_the_readme_demo_without_rich_shows_a_bar_of_plain_lines(tmp_path: Path) -> None:
    text = on_a_terminal(["demo", "--size", "2MiB", "--dir", "demo"], rich=False, cwd=tmp_path)
    assert "\x1b" not in text  # no escape codes: plain lines
    assert "\r\n" in text  # (the terminal's line discipline turns each \n into \r\n)
    lines = text.replace("\r\n", "\n").splitlines()
    bars = [line for line in lines if re.search(r"\[[#-]{24}\]", line)]
    assert bars, text
    assert bars[-1].startswith("complete")
    assert "[" + "#" * 24 + "]  100.0%" in bars[-1]
    assert len(bars) <= 3  # at most one line a second: a 2 MiB load takes well under one
    assert "  ----" in text  # the plain tables' rule
    assert "OK: all" in lines[-1]


def test_the_demo_with_rich_shows_rich_s_bar_and_tables(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    text = on_a_terminal(["demo", "--size", "2MiB", "--dir", "demo"], rich=True, cwd=tmp_path)
    assert "\x1b[" in text
    plain = ANSI.sub("", text).replace("\r\n", "\n")
    bar = re.compile(r"\d%  .* GB/s  .*units \d+/\d+")
    frames = [f for line in plain.split("\n") for f in line.split("\r") if bar.search(f)]
    assert frames, plain
    assert "━" in frames[-1]  # rich's bar
    assert frames[-1].startswith("complete")
    assert "100.0%" in frames[-1]
    assert "#" * 24 not in plain
    assert "─" in plain  # rich's rule under a table's headers
    assert "OK: all" in plain.splitlines()[-1]

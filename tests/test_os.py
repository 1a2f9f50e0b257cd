"""The operating system's side (``asyncslab/_os.py``): libc's calls looked up once and
working, resident memory in bytes on every platform, and coroutines run on uvloop where it
is installed."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncslab import _os

LINUX = sys.platform.startswith("linux")

# Run in a fresh interpreter: this process's peak is whatever the tests before it reached,
# which touching a few MiB here need not pass. Started from a small one in between: on Linux
# a process started by fork and exec keeps, as its peak, the resident memory of the one
# that forked it (a pytest process grown large, here). A first block takes the memory held
# past whatever the imports held for a moment, so that the second one grows the peak.
_LAUNCH = (
    "import subprocess, sys; "
    "sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"
)
_TOUCH = """
import json
from asyncslab import _os

first = b"\\x01" * (%d << 20)  # written, so every page is resident
before = _os.peak_rss()
second = b"\\x02" * (%d << 20)
after = _os.peak_rss()
print(json.dumps({"before": before, "after": after, "status": _os.proc_status()}))
"""


def test_peak_rss_is_in_bytes_and_grows_with_memory_touched() -> None:
    mib = 128
    run = subprocess.run(
        [sys.executable, "-c", _LAUNCH, _TOUCH % (mib, mib)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    if got["before"] is None:
        pytest.skip("this platform does not report peak resident memory")
    growth = got["after"] - got["before"]
    # In bytes: ru_maxrss left in KiB (Linux) would grow by ~128 Ki, scaled once too often
    # (macOS) by ~128 Gi. Half: the peak before may lie a little above the memory then held.
    assert mib << 19 <= growth <= mib << 21, got
    assert 16 << 20 < got["after"] < 64 << 30  # an interpreter with torch, not a machine
    if LINUX:
        status = got["status"]
        assert status["VmRSS"] >= 2 * mib << 20, status
        assert status["VmHWM"] >= status["VmRSS"], status
        # The same peak, read two ways, in the same unit.
        assert abs(status["VmHWM"] - got["after"]) < 16 << 20, got


def test_proc_status_is_zero_where_there_is_no_proc() -> None:
    status = _os.proc_status()
    assert set(status) == {"VmRSS", "VmHWM", "RssAnon", "RssFile"}
    if not Path("/proc/self/status").exists():
        assert set(status.values()) == {0}
    else:
        assert status["VmRSS"] > 0


def test_libc_is_opened_once_and_each_call_looked_up_once() -> None:
    if sys.platform == "win32":
        assert _os.libc() is None
        return
    assert _os.libc() is _os.libc()
    assert _os.libc_preadv() is _os.libc_preadv()
    assert _os.libc_madvise() is _os.libc_madvise()


@pytest.mark.skipif(not LINUX, reason="madvise and mincore: Linux")
def test_libc_lookups_are_callables_that_work(tmp_path: Path) -> None:
    preadv, madvise, mincore = _os.libc_preadv(), _os.libc_madvise(), _os.libc_mincore()
    assert callable(preadv)
    assert callable(madvise)
    assert callable(mincore)
    mapper = _os.libc_mmap()
    assert callable(mapper.mmap)
    assert callable(mapper.munmap)
    assert _os.PAGE == mmap.PAGESIZE
    path = tmp_path / "pages"
    data = os.urandom(3 * _os.PAGE)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        # preadv: one iovec entry, at an offset.
        buffer = (ctypes.c_ubyte * 100)()
        iov = (ctypes.c_size_t * 2)(ctypes.addressof(buffer), 100)
        assert preadv(fd, ctypes.addressof(iov), 1, 5) == 100
        assert bytes(buffer) == data[5:105]
        # mmap, then mincore and madvise on the mapping.
        size = len(data)
        address = mapper.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address is not None
        assert address != _os.MAP_FAILED, os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * 3)()
            assert mincore(address, size, vector) == 0
            assert ctypes.string_at(address, size) == data
            assert madvise(address, size, 3) == 0  # MADV_WILLNEED: any kernel knows it
        finally:
            assert mapper.munmap(address, size) == 0
    finally:
        os.close(fd)


def test_a_failed_call_leaves_its_errno() -> None:
    preadv = _os.libc_preadv()
    if preadv is None:
        pytest.skip("no libc preadv here")
    iov = (ctypes.c_size_t * 2)(0, 0)
    assert preadv(-1, ctypes.addressof(iov), 1, 0) == -1
    assert ctypes.get_errno() == errno.EBADF


def test_mapping_is_refused_off_linux() -> None:
    if LINUX:
        assert isinstance(_os.libc_mmap(), _os.Mmap)
    else:
        with pytest.raises(OSError, match="mapped loads need Linux"):
            _os.libc_mmap()


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_run_runs_on_uvloop_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert _os.run(_loop_type()) is uvloop.Loop
    assert _os.loop_name() == "uvloop"


def test_run_runs_on_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    loop = _os.run(_loop_type())
    assert issubclass(loop, asyncio.BaseEventLoop)
    assert "uvloop" not in loop.__module__
    assert _os.loop_name() == "asyncio"

"""The example inference server (``examples/server.py``) as a real process on a real ASGI stack:
``/health`` answers throughout a background load with monotonic progress, ``/forward``
computes from slab views exactly what the old tensor-by-tensor way computes, and a signal
during the load shuts down cleanly. Also, in-process: the example MoE block's weights are
zero-copy views of the slabs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import asyncslab  # noqa: E402
import asyncslab.testing  # noqa: E402
from asyncslab import Checkpoint, SlabSet, plan  # noqa: E402
from asyncslab.testing import SyntheticCheckpoint, spec_for_size, write_synthetic  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
import moe_block  # noqa: E402 - examples/ is on the tests' path (pyproject's pythonpath)
from server import PACED_READ_SIZE  # noqa: E402

from support.ports import free_port  # noqa: E402

SIZE = 8 << 20
RATE_MB_PER_S = 8  # an 8 MiB checkpoint loads in about a second, in 64 KiB reads
# A held server (tests/examples/held_server.py) reads this many before it waits for the test: at
# most 8 paced reads (512 KiB) of the 8 MiB land, so a test sees the load under way.
HOLD_AFTER_READS = 8
# Hang guards only: a correct run on a loaded machine (a torch import on a busy core takes
# a while) is far within them.
UP_TIMEOUT = 60.0  # process start (torch import) until /health answers
LOAD_TIMEOUT = 60.0
EXIT_TIMEOUT = 30.0
HTTP_TIMEOUT = 30.0
LATENCY_SANITY_S = 30.0  # catches an event loop blocked for good, not a timing claim
HEALTH_KEYS: dict[str, type | tuple[type, ...]] = {
    "state": str,
    "ready": bool,
    "bytes_done": int,
    "bytes_total": int,
    "units_complete": int,
    "units_total": int,
    "gbps": (int, float),
    "elapsed_s": (int, float),
    "layer": (int, type(None)),
    "layer_bound": bool,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """An ~8 MiB tiered MoE checkpoint, shared read-only by the tests of this module."""
    return write_synthetic(tmp_path_factory.mktemp("served"), spec_for_size(SIZE))


class Server:
    """``examples/server.py`` in a subprocess; output goes to files (a pipe nobody drains
    could fill up and stall the server)."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, out: Path, err: Path) -> None:
        self.proc = proc  # stdin a pipe for a held server, else none
        self.url = url
        self.out_path = out
        self.err_path = err

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def describe(self) -> str:
        return f"--- server stdout ---\n{self.stdout}\n--- server stderr ---\n{self.stderr}"

    def release(self) -> None:
        """Let a held server's load go on."""
        assert self.proc.stdin is not None, "not a held server"
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server did not exit within {timeout} s\n{self.describe()}")


@contextmanager
def run_server(
    checkpoint: Path,
    tmp_path: Path,
    *,
    rate_mb_per_s: float = RATE_MB_PER_S,
    loop: str = "uvloop",
    held: bool = False,
) -> Iterator[Server]:
    """The server; ``held``: its load waits after HOLD_AFTER_READS reads for
    :meth:`Server.release` (or its shutdown)."""
    port = free_port()
    out, err = tmp_path / f"server-{port}.out", tmp_path / f"server-{port}.err"
    script = (
        [str(ROOT / "tests" / "examples" / "held_server.py"), str(HOLD_AFTER_READS)]
        if held
        else [str(EXAMPLES / "server.py")]
    )
    cmd = [
        sys.executable,
        *script,
        "--checkpoint",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-mb-per-s",
        str(rate_mb_per_s),
        "--loop",
        loop,
    ]
    with out.open("wb") as fout, err.open("wb") as ferr:
        stdin = subprocess.PIPE if held else subprocess.DEVNULL
        # examples/ first on the path, as for any script of that folder (the held server
        # runs examples/server.py from its own file).
        path = os.pathsep.join([str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=stdin, stdout=fout, stderr=ferr)
    server = Server(proc, f"http://127.0.0.1:{port}", out, err)
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=EXIT_TIMEOUT)
        if proc.stdin is not None:
            proc.stdin.close()


def check_health(status: int, body: Any) -> dict[str, Any]:
    """One /health answer is well-formed and its status agrees with its state."""
    assert isinstance(body, dict), body
    for key, kind in HEALTH_KEYS.items():
        assert isinstance(body.get(key), kind), (key, body)
    assert body["eta_s"] is None or isinstance(body["eta_s"], (int, float)), body
    assert 0 <= body["bytes_done"] <= body["bytes_total"], body
    assert 0 <= body["units_complete"] <= body["units_total"], body
    if status == 200:
        assert body["state"] == "complete", body
        assert body["ready"] is True, body
        assert body["bytes_done"] == body["bytes_total"], body
        assert body["units_complete"] == body["units_total"], body
    elif status == 503:
        assert body["state"] in ("starting", "loading"), body
        assert body["ready"] is False, body
    else:
        assert status == 500, (status, body)
        assert body["state"] == "failed", body
        assert body["error"], body
    return body


def wait_up(client: httpx.Client, server: Server) -> tuple[int, dict[str, Any], float]:
    """First /health answer, once the server listens (connection refused until then)."""
    deadline = time.monotonic() + UP_TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}\n{server.describe()}")
        try:
            t0 = time.perf_counter()
            r = client.get("/health")
            return r.status_code, check_health(r.status_code, r.json()), time.perf_counter() - t0
        except httpx.TransportError:
            time.sleep(0.05)
    pytest.fail(f"server did not answer /health within {UP_TIMEOUT} s\n{server.describe()}")


def wait_mid_load(
    client: httpx.Client, server: Server, answers: list[tuple[int, dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Poll a held server until its load is under way: some bytes landed, the rest held."""
    answers = [] if answers is None else answers
    status, body, _ = wait_up(client, server)
    answers.append((status, body))
    deadline = time.monotonic() + LOAD_TIMEOUT
    while not (status == 503 and body["bytes_done"] > 0):
        assert status == 503, f"a held load is not loading: {status} {body}"
        assert time.monotonic() < deadline, f"no progress in {LOAD_TIMEOUT} s\n{server.describe()}"
        time.sleep(0.01)
        r = client.get("/health")
        status, body = r.status_code, check_health(r.status_code, r.json())
        answers.append((status, body))
    assert body["bytes_done"] <= HOLD_AFTER_READS * PACED_READ_SIZE < body["bytes_total"], body
    return body


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_health_during_load_then_forward_matches_old_way(
    checkpoint: SyntheticCheckpoint,
    tmp_path: Path,
    loop: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    p = plan(Checkpoint.open(checkpoint.root))
    layer = min(p.extras["partitions"])
    with (
        run_server(checkpoint.root, tmp_path, loop=loop, held=True) as server,
        httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client,
    ):
        answers: list[tuple[int, dict[str, Any]]] = []
        wait_mid_load(client, server, answers)
        # Held under way: /forward must refuse.
        forward_while_loading = client.post("/forward", json={"tokens": 4})
        server.release()
        worst = 0.0
        deadline = time.monotonic() + LOAD_TIMEOUT
        after_ready = 0
        while after_ready < 3:  # a few more polls once ready: 200 must stay 200
            assert time.monotonic() < deadline, (
                f"not ready in {LOAD_TIMEOUT} s\n{server.describe()}"
            )
            time.sleep(0.02)
            t0 = time.perf_counter()
            r = client.get("/health")
            worst = max(worst, time.perf_counter() - t0)
            body = check_health(r.status_code, r.json())
            answers.append((r.status_code, body))
            after_ready += r.status_code == 200

        with capsys.disabled():
            print(
                f"\n[{loop}] /health: {len(answers)} answers, worst latency "
                f"{worst * 1e3:.1f} ms during a {body['elapsed_s']:.2f} s load"
            )
        assert worst < LATENCY_SANITY_S, f"/health took {worst:.2f} s: event loop blocked?"

        statuses = [s for s, _ in answers]
        assert set(statuses) <= {200, 503}, statuses
        first_ready = statuses.index(200)
        assert all(s == 200 for s in statuses[first_ready:]), statuses
        loading = [b for s, b in answers[:first_ready] if s == 503]
        assert any(0 < b["bytes_done"] < b["bytes_total"] for b in loading), (
            "no 503 with partial progress seen before 200"
        )
        done = [b["bytes_done"] for _, b in answers]
        units = [b["units_complete"] for _, b in answers]
        assert done == sorted(done), "bytes_done went backwards"
        assert units == sorted(units), "units_complete went backwards"
        assert {b["bytes_total"] for _, b in answers} == {p.nbytes}
        assert {b["units_total"] for _, b in answers} == {len(p.units)}

        assert forward_while_loading.status_code == 503, forward_while_loading.text
        assert forward_while_loading.json()["state"] == "loading"

        r = client.post("/forward", json={"tokens": 16, "seed": 3, "include_output": True})
        assert r.status_code == 200, r.text
        got = r.json()
        again = client.get("/forward", params={"tokens": 16, "seed": 3})
        assert again.status_code == 200, again.text
        assert again.json()["sha256"] == got["sha256"]
        assert client.get("/forward", params={"tokens": "x"}).status_code == 400
        # Each of these was a 500 with a traceback in the server's log (found by probing).
        for body in (
            b'{"tokens": Infinity}',
            b'{"tokens": 1e400}',
            b'{"tokens": true}',
            b'{"tokens": 8.5}',
            b'{"tokens": 8, "seed": 18446744073709551616}',
            b"[" * 100_000,
        ):
            bad = client.post("/forward", content=body)
            assert bad.status_code == 400, (body[:40], bad.text)

        # The same block computed the old way, in this process, from the same files.
        tensors = moe_block.read_layer_tensors(checkpoint.root, layer)
        x = moe_block.make_input(16, tensors[f"model.layers.{layer}.mlp.gate.weight"].shape[1], 3)
        expected = moe_block.reference_forward(x, tensors)
        output = torch.tensor(got["output"], dtype=torch.float32)
        assert got["layer"] == layer
        assert got["shape"] == list(expected.shape)
        assert torch.equal(output, expected), (output - expected).abs().max()
        assert got["sha256"] == moe_block.checksum(expected)
        assert got["sum"] == pytest.approx(float(expected.double().sum()), rel=1e-12)

        server.proc.send_signal(signal.SIGINT)
        assert server.wait_exit(EXIT_TIMEOUT) == 0, server.describe()
        assert "Traceback" not in server.stdout + server.stderr, server.describe()
        assert "load complete" in server.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "loop"), [(signal.SIGINT, "uvloop"), (signal.SIGTERM, "asyncio")])
def test_signal_during_load_cancels_cleanly(
    checkpoint: SyntheticCheckpoint, tmp_path: Path, sig: signal.Signals, loop: str
) -> None:
    with run_server(checkpoint.root, tmp_path, loop=loop, held=True) as server:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            wait_mid_load(client, server)
        t0 = time.monotonic()
        server.proc.send_signal(sig)
        rc = server.wait_exit(EXIT_TIMEOUT)
        took = time.monotonic() - t0
    log = server.stdout + server.stderr
    assert rc == 0, server.describe()
    assert "Traceback" not in log, server.describe()
    assert "shutdown during the load: cancelled" in server.stdout, server.describe()
    assert "I/O threads left: 0" in server.stdout, server.describe()
    assert f"stopped by {sig.name}" in server.stdout, server.describe()
    assert "load complete" not in server.stdout, "the load finished before the signal"
    print(f"{sig.name} during the load: exited 0 after {took:.2f} s")


@pytest.mark.slow
def test_sigterm_while_generating_the_checkpoint_removes_it(tmp_path: Path) -> None:
    # uvicorn's handlers come later: SIGTERM killed the process and left the checkpoint.
    cmd = [sys.executable, str(EXAMPLES / "server.py"), "--size", "256MiB", "--port", "1"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + LOAD_TIMEOUT
    while not list(tmp_path.glob("asyncslab-server-*/*.safetensors")):
        assert time.monotonic() < deadline, "generation never started"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=EXIT_TIMEOUT * 3)
    assert proc.returncode == 130, (out, err)
    assert b"interrupted" in err
    assert b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def run_script(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``examples/server.py`` run to its end (it is expected not to serve)."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "server.py"), *args],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT + LOAD_TIMEOUT,
    )


def assert_refused(done: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """Exit code 2, one line on stderr saying why, and no server started."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("server: error: "), done.stderr
    for phrase in phrases:
        assert phrase in done.stderr, (phrase, done.stderr)
    assert "Started server" not in done.stdout + done.stderr


def malformed_file(root: Path) -> Path:
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\x01\x02\x03\x04")
    return root


def empty_dir(root: Path) -> Path:
    root.mkdir()
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "phrase"),
    [(empty_dir, "MissingFileError"), (malformed_file, "model.safetensors")],
)
def test_a_checkpoint_that_cannot_be_planned_exits_2_before_serving(
    tmp_path: Path, make: Any, phrase: str
) -> None:
    # It used to start serving and answer /health with 500 until killed.
    bad = make(tmp_path / "bad")
    done = run_script(["--checkpoint", str(bad), "--port", str(free_port())], tmp_path)
    assert_refused(done, phrase, str(bad))


@pytest.mark.slow
def test_a_layer_that_is_not_an_moe_layer_exits_2(
    checkpoint: SyntheticCheckpoint, tmp_path: Path
) -> None:
    args = ["--checkpoint", str(checkpoint.root), "--layer", "0", "--port", str(free_port())]
    assert_refused(run_script(args, tmp_path), "--layer 0 is not an MoE layer")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "phrase"),
    [
        pytest.param(
            "cuda",
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        ("meta", "not supported"),
        ("cuda:x", "cuda:x"),
    ],
)
def test_a_device_that_is_not_there_exits_2_before_generating(
    tmp_path: Path, device: str, phrase: str
) -> None:
    # --device cuda without CUDA generated the whole 256 MiB checkpoint, then served 500s.
    done = run_script(["--device", device, "--port", str(free_port())], tmp_path)
    assert_refused(done, f"--device {device}", phrase)
    assert list(tmp_path.iterdir()) == [], "a checkpoint was generated"


@pytest.mark.slow
@pytest.mark.parametrize("package", ["uvicorn", "starlette"])
def test_without_its_packages_the_script_says_why_and_exits_0(tmp_path: Path, package: str) -> None:
    # It ended in a ModuleNotFoundError traceback (exit 1), unlike the other examples.
    shadow = tmp_path / "shadow"
    (shadow / package).mkdir(parents=True)
    (shadow / package / "__init__.py").write_text(
        f"raise ModuleNotFoundError('hidden by the test', name={package!r})\n"
    )
    path = os.pathsep.join([str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = run_script(["--port", str(free_port())], tmp_path, env={"PYTHONPATH": path})
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.count("\n") == 1, done.stdout
    assert done.stdout.startswith(f"skipped: {package} is not installed"), done.stdout
    assert "pip install" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == [shadow], "a checkpoint was generated"


@pytest.mark.slow
def test_slabs_that_cannot_be_allocated_report_500_with_every_key(tmp_path: Path) -> None:
    """A failure at startup, after planning (here: a slab torch cannot make; on a GPU, out
    of memory), is served as a failed load: /health 500 with every key."""
    written = write_synthetic(tmp_path / "ckpt", spec_for_size(SIZE))
    # A valid header (zero bytes) that no torch tensor can have: planned, then refused at
    # allocation.
    header = b'{"z":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'
    (written.root / "z.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    index_path = written.root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["z"] = "z.safetensors"
    index_path.write_text(json.dumps(index))
    with (
        run_server(written.root, tmp_path) as server,
        httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client,
    ):
        status, body, _ = wait_up(client, server)  # every key checked, layer ones included
        assert status == 500, body
        assert "cannot make slab 'z'" in body["error"], body
        assert body["layer"] is None
        assert body["layer_bound"] is False
        forward = client.get("/forward")
        assert forward.status_code == 500, forward.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(EXIT_TIMEOUT) == 0, server.describe()
    assert "Traceback" not in server.stdout + server.stderr, server.describe()


@pytest.mark.slow
def test_failed_load_reports_500(tmp_path: Path) -> None:
    written = write_synthetic(tmp_path / "ckpt", spec_for_size(SIZE))
    last = written.files[-1]
    with (
        run_server(written.root, tmp_path, held=True) as server,
        httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client,
    ):
        wait_mid_load(client, server)
        # Truncated after planning, before its tail is read: a short read breaks the load.
        os.truncate(last, last.stat().st_size // 2)
        server.release()
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            assert time.monotonic() < deadline, server.describe()
            r = client.get("/health")
            body = check_health(r.status_code, r.json())
            if r.status_code != 503:
                break
            time.sleep(0.02)
        assert r.status_code == 500, body
        assert last.name in body["error"], body
        forward = client.get("/forward")
        assert forward.status_code == 500, forward.text
        assert last.name in forward.json()["error"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(EXIT_TIMEOUT) == 0, server.describe()
    assert "load failed" in server.stdout
    log = server.stdout + server.stderr
    assert "never retrieved" not in log, server.describe()
    assert "Traceback" not in log, server.describe()


@pytest.mark.asyncio
async def test_block_weights_are_slab_views(checkpoint: SyntheticCheckpoint) -> None:
    """In-process: binding from on_unit_ready makes every parameter a view of its slab (same
    memory), and the block's forward equals the old way's bit for bit."""
    p = plan(Checkpoint.open(checkpoint.root), tier_map=checkpoint.tier_map_path)
    blocks = {
        layer: moe_block.TieredMoEBlock.from_plan(p, layer) for layer in p.extras["partitions"]
    }
    by_unit = {b.unit: b for b in blocks.values()}
    bound_while_loading: list[str] = []

    async def on_unit_ready(unit: str, slabs: SlabSet) -> None:
        if unit in by_unit:
            by_unit[unit].bind(slabs)
            if slabs.state == "loading":
                bound_while_loading.append(unit)

    async with SlabSet(p) as slabs:
        await slabs.start(Checkpoint.open(checkpoint.root), on_unit_ready=on_unit_ready)
        # on_unit_ready runs inside the load (its task group awaits the callbacks): every
        # block was bound while the load was still running, as a server binds.
        assert set(bound_while_loading) == set(by_unit)
        for block in blocks.values():
            assert block.bound
            for name, param in block.named_parameters():
                slab = slabs.slab(block.slab_of[name])
                assert param.data_ptr() == slab.data_ptr(), name
                assert param.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
                assert param.shape == slab.shape
                assert param.dtype == slab.dtype
        # Forward of the first and last MoE layers (the server test covers one more).
        for layer in (min(blocks), max(blocks)):
            x = moe_block.make_input(24, blocks[layer].hidden, seed=layer)
            expected = moe_block.reference_forward(
                x, moe_block.read_layer_tensors(checkpoint.root, layer)
            )
            assert torch.equal(blocks[layer](x), expected), layer


def test_the_block_refuses_expert_major_slabs(tmp_path: Path) -> None:
    # It indexes w13[0, slot] and w13[1, slot]: on expert-major slabs it computed wrong
    # outputs (and, for some layers, indexed out of range).
    spec = asyncslab.testing.SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32)
    ckpt = asyncslab.testing.write_synthetic(tmp_path, spec)
    rules = [asyncslab.TieredMoE(layout="expert_major"), asyncslab.Dense()]
    p = asyncslab.plan(asyncslab.Checkpoint.open(ckpt.root), rules=rules)
    with pytest.raises(ValueError, match="expert_major; this block computes with shard_major"):
        moe_block.TieredMoEBlock.from_plan(p, 1)

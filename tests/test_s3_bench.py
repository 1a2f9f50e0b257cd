"""``benchmarks/s3_bench.py``: the emulated remote links it runs through (a kernel relay or
the tests' proxy, each with a latency and a rate per connection), and its quick mode end to
end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import s3_bench
from support.s3server import FaultProxy, SeaweedServer, SpliceLink

ROOT = Path(__file__).resolve().parent.parent


def _store(server: SeaweedServer, endpoint: str) -> Any:
    from obstore.store import S3Store

    options: Any = server.options(endpoint)
    return S3Store("models", config=options, client_options={"allow_http": True})


def test_the_proxy_adds_its_latency_and_caps_the_rate(s3_server: SeaweedServer) -> None:
    """Each request waits ``latency_s``; a response goes out at ``rate`` at most. Bounds from
    below only (a busy machine only makes it slower)."""
    import obstore

    key = "shaping/blob"
    obstore.put(s3_server.store(), key, bytes(600_000))
    with FaultProxy(s3_server.endpoint, latency_s=0.2) as proxy:
        store = _store(s3_server, proxy.endpoint)
        began = time.perf_counter()
        obstore.get_range(store, key, start=0, length=10)
        assert time.perf_counter() - began >= 0.2
    with FaultProxy(s3_server.endpoint, rate=1e6) as proxy:
        store = _store(s3_server, proxy.endpoint)
        began = time.perf_counter()
        data = obstore.get(store, key).bytes()
        elapsed = time.perf_counter() - began
    assert len(data) == 600_000
    assert elapsed >= 0.6  # 600 kB at 1 MB/s


def test_the_splice_link_adds_its_latency_caps_the_rate_and_keeps_its_connections(
    s3_server: SeaweedServer,
) -> None:
    """The kernel relay passes every byte on unchanged, holds each request ``latency_s`` and
    each connection's responses to ``rate``, and keeps a connection for the next request.
    Bounds from below only. One ``http.client`` connection on a presigned URL: obstore's pool
    may open another connection when it races a request with the return of the last one."""
    import http.client
    import urllib.parse
    from datetime import timedelta

    import obstore

    key = "shaping/spliced"
    blob = os.urandom(600_000)
    obstore.put(s3_server.store(), key, blob)
    with SpliceLink(s3_server.endpoint, latency_s=0.2) as link:
        url = urllib.parse.urlsplit(
            obstore.sign(_store(s3_server, link.endpoint), "GET", key, timedelta(minutes=5))
        )
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
        try:
            for i, at in enumerate((7, 0, 1000, 599_990)):
                began = time.perf_counter()
                headers = {"Range": f"bytes={at}-{at + 9}"}
                conn.request("GET", f"{url.path}?{url.query}", headers=headers)
                response = conn.getresponse()
                assert (response.status, response.read()) == (206, blob[at : at + 10]), i
                assert time.perf_counter() - began >= 0.2, i
        finally:
            conn.close()
        assert link.connections == 1
    with SpliceLink(s3_server.endpoint, rate=1e6) as link:
        store = _store(s3_server, link.endpoint)
        began = time.perf_counter()
        data = obstore.get(store, key).bytes()
        elapsed = time.perf_counter() - began
    assert bytes(data) == blob
    assert elapsed >= 0.6  # 600 kB at 1 MB/s


def test_the_raw_bound_is_the_one_with_the_lower_median_not_each_rounds_minimum() -> None:
    """Two raw bounds as fast as asyncslab but each noisy in its own rounds: against the bound
    with the lower median, paired, asyncslab takes 1.0x; against the faster bound of each
    round it would seem slower (the minimum of two noisy times is biased low), and that
    statistic is shown beside the target, not judged."""
    bench = s3_bench
    times = {  # round: (asyncslab, raw-bound, raw-bound-threads)
        0: (2.0, 2.0, 1.8),
        1: (2.1, 1.9, 2.1),
        2: (2.2, 2.2, 2.0),
        3: (2.0, 1.8, 2.0),
        4: (1.9, 1.9, 2.2),
    }
    runs = [
        {
            "round": r,
            "link": "local",
            "model": "m",
            "contender": c,
            "result": {"seconds": t, "bytes": 1, "peak_growth": 0},
        }
        for r, row in times.items()
        for c, t in zip(("asyncslab", *bench.BOUNDS), row, strict=True)
    ]
    runs.append(  # a failed round counts for neither side
        {
            "round": 5,
            "link": "local",
            "model": "m",
            "contender": "raw-bound",
            "result": {"error": "x"},
        }
    )
    # raw-bound's median (1.9 s) is the lower: asyncslab over it, per round.
    assert bench._paired(runs, "local", "m", "asyncslab", bench.BOUNDS) == pytest.approx(1.0)
    assert bench._paired_min(runs, "local", "m", "asyncslab", bench.BOUNDS) == pytest.approx(
        2.1 / 1.9
    )
    assert bench._paired(runs, "local", "m", "asyncslab", "raw-bound-threads") == pytest.approx(1.0)
    assert bench._paired(runs, "gcs", "m", "asyncslab", bench.BOUNDS) is None
    lines = bench.targets(bench.summarise(runs), runs)
    assert "PASS  local, m: asyncslab / the faster raw bound: 1.00 (goal <= 1.10)" in lines
    assert "info  local, m: asyncslab / the faster raw bound of each round: 1.11" in lines


@pytest.mark.slow
@pytest.mark.timeout(900)  # two models, two links, four vLLM processes: minutes on 2 cores
def test_the_quick_mode_reports_every_row(tmp_path: Path) -> None:
    """Every (link, model, contender) gets a row with a time, or says it is not available
    (a peer or vLLM not installed); none failed; the tables and the targets are printed.
    Every contender is named, vLLM's whole get_model (run only when named) included."""
    out = tmp_path / "run.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.s3_bench",
        "--quick",
        "--rounds",
        "1",
        "--contenders",
        ",".join(s3_bench.CONTENDERS),
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=900, check=False, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    seen = {(r["link"], r["model"], r["contender"]): r for r in rows}
    library = (
        "asyncslab",
        "asyncslab:obstore",
        "runai-model-streamer",
        "raw-bound",
        "raw-bound-threads",
    )
    mixtral_only = ("tensorizer", *s3_bench.VLLM, *s3_bench.VLLM_MODEL)
    expected = {
        (link, model, contender)
        for link in ("local", "remote")
        for model in ("mixtral", "exl3")
        for contender in library + (mixtral_only if model == "mixtral" else ())
    }
    # The emulators: the Mixtral-like model, asyncslab and the raw bounds (runai on GCS).
    expected |= {("gcs", "mixtral", c) for c in library if c != "asyncslab:obstore"}
    expected |= {("azure", "mixtral", c) for c in library if c != "runai-model-streamer"}
    assert set(seen) == expected
    for key, row in seen.items():
        assert row["status"] == "ok" or row["status"].startswith("not available"), (key, row)
    for contender in ("asyncslab", "raw-bound", "raw-bound-threads"):  # these always run
        assert seen[("local", "exl3", contender)]["status"] == "ok"
        assert seen[("remote", "exl3", contender)]["median_s"] > 0
        assert seen[("gcs", "mixtral", contender)]["median_s"] > 0
        assert seen[("azure", "mixtral", contender)]["median_s"] > 0
    assert seen[("local", "exl3", "asyncslab:obstore")]["median_s"] > 0
    for link in ("local", "remote", "gcs", "azure"):
        assert f"link {link}" in run.stdout
    assert "targets (measured vs goal; never asserted):" in run.stdout
    assert "asyncslab / the faster raw bound" in run.stdout
    assert "asyncslab / asyncslab:obstore" in run.stdout
    if seen[("local", "mixtral", "vllm-model:asyncslab")]["status"] == "ok":
        assert "vLLM get_model, layers as landed / after" in run.stdout
        assert "processed checksums equal" in run.stdout

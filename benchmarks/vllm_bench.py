"""Load formats side by side inside vLLM: each load in a fresh process, interleaved round by
round (the order reversed every other round), the page cache warm.

    python benchmarks/vllm_bench.py [--model DIR] [--rounds 3] [--json OUT]

Without ``--model`` it writes a Mixtral-like bfloat16 model (18 layers x 8 experts, about
1.48 GB; kept in ``--workdir``). Per contender and round a child process creates the model
as vLLM does (``create_model``) and times the loader's ``load_weights`` call,
``process_weights_after_loading`` and the two ``gc.collect()`` calls vLLM's ``load_model``
makes; it reports peak RSS growth over the model's creation, and a checksum of every
parameter after ``load_weights`` (equal across formats: same bytes). Two bounds run the same
way: the checkpoint's payload read with ``preadv`` by 2 threads into memory touched
beforehand, and into fresh memory.

Targets (printed, never asserted): asyncslab's ``load_weights`` >= 2x faster than the
fastest of vLLM's own formats in the same run; peak RSS growth <= parameters + staging +
64 MiB. On a GPU machine with vLLM, ``--device cuda`` runs the same comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests package, for its model writer

CONTENDERS: dict[str, dict[str, Any]] = {
    "auto": {"load_format": "auto"},
    "safetensors": {"load_format": "safetensors"},
    "auto-multithread": {
        "load_format": "auto",
        "extra": {"enable_multithread_load": True, "num_threads": 2},
    },
    "runai_streamer": {"load_format": "runai_streamer"},
    "asyncslab": {"load_format": "asyncslab"},
}
BOUNDS = ("bound-preadv-touched", "bound-preadv-fresh")
OWN = ("auto", "safetensors", "auto-multithread", "runai_streamer")  # vLLM's formats

BENCH_MODEL: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 1408,
    "num_hidden_layers": 18,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}


def _status(field: str) -> int:
    """A size from /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child_load(model: str, contender: str, device: str) -> dict[str, Any]:
    import gc

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    import asyncslab.vllm  # noqa: F401 - the plugin registers it in a real vLLM process

    spec = CONTENDERS[contender]
    config = EngineArgs(
        model=model,
        load_format=spec["load_format"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        model_loader_extra_config=spec.get("extra", {}),
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp()}",
            backend="nccl" if device == "cuda" else "gloo",
        )
        initialize_model_parallel(1, 1)
        loader = get_model_loader(config.load_config)
        target = torch.device(device)
        with set_default_torch_dtype(config.model_config.dtype), target:
            model_ = loader.create_model(vllm_config=config, model_config=config.model_config)
        params = sum(p.numel() * p.element_size() for p in model_.parameters())
        ptrs = [p.data_ptr() for p in model_.parameters()]
        gc.collect()
        rss_before = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        loader.load_weights(model_, config.model_config)
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        peak = _peak()
        kept = ptrs == [p.data_ptr() for p in model_.parameters()]
        checksum = 0
        for p in model_.parameters():
            flat = p.detach().reshape(-1).view(torch.uint8)
            checksum = (checksum * 1000003 + int(flat[::4093].to(torch.int64).sum())) % (1 << 61)
        report = getattr(loader, "report", None)
        # The same load again, into the parameters now touched (a weight reload): what
        # reading costs without faulting fresh memory.
        r0 = time.perf_counter()
        loader.load_weights(model_, config.model_config)
        if device == "cuda":
            torch.cuda.synchronize()
        reload_s = time.perf_counter() - r0
        t2 = time.perf_counter()
        gc.collect()
        t3 = time.perf_counter()
        process_weights_after_loading(model_, config.model_config, target)
        t4 = time.perf_counter()
        gc.collect()
        t5 = time.perf_counter()
    return {
        "contender": contender,
        "load_weights_s": t1 - t0,
        "process_weights_s": t4 - t3,
        "gc_s": (t3 - t2) + (t5 - t4),
        "param_bytes": params,
        "peak_rss_growth": peak - rss_before,
        "pointers_kept": kept,
        "checksum": checksum,
        "reload_s": reload_s,
        "transformed": None if report is None else len(report.transformed),
        "capture_s": None if report is None else report.capture_s,
        "reads_s": None if report is None else report.load_s,
    }


def child_bound(model: str, contender: str, device: str) -> dict[str, Any]:
    import threading

    import torch

    from asyncslab import Checkpoint

    ckpt = Checkpoint.open(model)
    jobs = []
    total = 0
    for f in ckpt.files:
        start, end = f.data_start, f.size
        for at in range(start, end, 16 << 20):
            n = min(16 << 20, end - at)
            jobs.append((str(f.path), at, n, total))
            total += n
    buffer = torch.empty(total, dtype=torch.uint8)
    if contender == "bound-preadv-touched":
        buffer.fill_(1)
    view = memoryview(buffer.numpy())
    fds = {p: os.open(p, os.O_RDONLY) for p in {j[0] for j in jobs}}
    lock = threading.Lock()
    todo = list(jobs)

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                path, at, n, dst = todo.pop()
            done = 0
            while done < n:
                done += os.preadv(fds[path], [view[dst + done : dst + n]], at + done)

    rss_before = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = time.perf_counter()
    return {
        "contender": contender,
        "load_weights_s": t1 - t0,
        "param_bytes": total,
        "peak_rss_growth": _peak() - rss_before,
    }


def _child(model: str, contender: str, device: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", contender, "--model", model, "--device", device]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    line = next((x for x in reversed(run.stdout.splitlines()) if x.startswith("{")), None)
    if run.returncode != 0 or line is None:
        return {"contender": contender, "error": (run.stderr or run.stdout)[-2000:]}
    result: dict[str, Any] = json.loads(line)
    return result


def _warm(model: Path) -> None:
    for f in model.glob("*.safetensors"):
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| contender | load_weights | GB/s | process_weights_after_loading | gc.collect x2 "
        "| peak RSS growth | reload into touched memory | pointers kept |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['contender']} | failed: {r['error'].splitlines()[-1][:80]} |")
            continue
        gbps = r["param_bytes"] / r["median_s"] / 1e9
        lines.append(
            f"| {r['contender']} | {r['median_s']:.2f} s ({r['min_s']:.2f}-{r['max_s']:.2f}) "
            f"| {gbps:.2f} | {r.get('process_weights_s', float('nan')):.2f} s "
            f"| {r.get('gc_s', float('nan')):.2f} s | {r['peak_rss_growth'] / 2**20:,.0f} MiB "
            f"| {r.get('reload_s', float('nan')):.2f} s | {r.get('pointers_kept', '-')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: write the bench model)")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "asyncslab-vllm-bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", help="comma-separated contenders")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = child_bound if args.child in BOUNDS else child_load
        print(json.dumps(fn(args.model, args.child, args.device)))
        return
    if args.model:
        model = Path(args.model)
    else:
        model = Path(args.workdir) / "mixtral-bench"
        if not (model / "config.json").exists():
            from tests.vllm_models import write_model

            print(f"writing the bench model into {model} ...", flush=True)
            write_model(model, "mixtral", shards=4, **BENCH_MODEL)
    names = [*CONTENDERS, *BOUNDS]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"model {model}: {size / 1e9:.3f} GB; {args.rounds} rounds of {', '.join(names)}")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        _warm(model)
        for name in names if r % 2 == 0 else names[::-1]:
            result = _child(str(model), name, args.device)
            results[name].append(result)
            shown = result.get("load_weights_s")
            print(
                f"  round {r + 1} {name}: " + (f"{shown:.3f} s" if shown else "failed"), flush=True
            )
    if args.json:  # the raw runs first: a fault below must not lose them
        Path(args.json).write_text(json.dumps({"model_bytes": size, "runs": results}, indent=1))
    rows = []
    for name, runs in results.items():
        good = [x for x in runs if "error" not in x]
        if not good:
            rows.append({"contender": name, "error": runs[0]["error"]})
            continue
        times = [x["load_weights_s"] for x in good]
        row = {
            **good[0],
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
        }
        for key in (
            "process_weights_s",
            "gc_s",
            "peak_rss_growth",
            "reload_s",
            "capture_s",
            "reads_s",
        ):
            values = [x[key] for x in good if x.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
        row["checksums"] = sorted({x.get("checksum") for x in good} - {None})
        rows.append(row)
    print()
    print(_table(rows))
    by = {r["contender"]: r for r in rows if "error" not in r}
    own = [by[n]["median_s"] for n in OWN if n in by]
    if "asyncslab" in by and own:
        ours = by["asyncslab"]
        best = min(own)
        fastest = min((n for n in OWN if n in by), key=lambda n: by[n]["median_s"])
        print(
            f"\nasyncslab load_weights: {best / ours['median_s']:.2f}x faster than the fastest "
            f"of vLLM's own formats ({fastest}, {best:.2f} s); goal >= 2x"
        )
        print(
            f"asyncslab's load_weights: recording {ours['capture_s']:.3f} s, reads "
            f"{ours['reads_s']:.3f} s (medians); reload into touched memory "
            f"{min(by[n]['reload_s'] for n in OWN if n in by) / ours['reload_s']:.2f}x faster "
            "than the fastest of vLLM's own"
        )
        budget = ours["param_bytes"] + (64 << 20)
        print(
            f"asyncslab peak RSS growth {ours['peak_rss_growth'] / 2**20:,.0f} MiB; "
            f"goal <= parameters + staging + 64 MiB = {budget / 2**20:,.0f} MiB"
        )
        sums = {n: by[n].get("checksums") for n in by if by[n].get("checksums")}
        same = len({tuple(v) for v in sums.values()}) == 1
        print(f"parameter checksums after load_weights: {'equal' if same else sums}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model_bytes": size, "rows": rows, "runs": results}, indent=1)
        )


if __name__ == "__main__":
    main()

"""Load formats side by side inside vLLM, on every path a server takes: each load in a
fresh process, interleaved round by round (the order reversed every other round).

    python -m benchmarks.vllm_bench [--model DIR] [--rounds 5] [--paths ...] [--json OUT]

Without ``--model`` it writes a Mixtral-like bfloat16 model (``--shape bench``: 18 layers x 8
experts, about 1.48 GB; ``moe128``, ``moe256``: 24 layers x 128 or 256 experts on skinny
dimensions, the tensor counts of real MoE checkpoints; ``moe128-fp8``: ``moe128`` in
block-wise FP8 as DeepSeek-V3 and Qwen3-FP8 ship it, each linear weight float8 beside its
``weight_scale_inv``; kept in ``--workdir``). Per contender
and round a child process creates the model as vLLM does (``create_model``) and times the
loader's ``load_weights`` call, ``process_weights_after_loading`` and the two ``gc.collect()``
calls vLLM's ``load_model`` makes; it reports peak RSS growth over the model's creation, and
a checksum of every parameter after ``load_weights`` (equal across formats: same bytes).
Two bounds run the same way: the checkpoint's payload read with ``preadv`` by 2 threads into
memory touched beforehand, and into fresh memory.

The paths (``--paths``, all by default), each a row of asyncslab against ``auto``:

* ``warm``: the first load, the page cache warm (every contender);
* ``cold``: the first load with the model's files out of the page cache: dropped with
  ``/proc/sys/vm/drop_caches`` under ``--drop-caches``, else evicted file by file with
  ``posix_fadvise(DONTNEED)``; what stayed resident is checked with ``mincore`` and shown;
* ``direct``: ``model.load_weights(loader.get_all_weights(...))`` into the live parameters
  before processing (the body of a reload, in the warm child);
* ``reload``: vLLM's ``reload_weights`` after ``process_weights_after_loading`` (the path
  RL trainers take; vLLM's re-processing included; in the warm child), with a checksum of
  every processed parameter after it;
* ``float32``: the bfloat16 checkpoint served in float32 (every tensor cast by vLLM's loaders);
* ``model``: vLLM's whole ``get_model`` (the loader's ``load_model``: create the model, load
  the weights, collect, process, collect) as a worker calls it, timed whole and in those
  parts from outside, with a checksum of every parameter as served (processed); its
  target is its own, at most 0.5x ``auto``'s.

A block-wise FP8 model on a CPU without AMX (vLLM's CPU build has no FP8 kernel for it):
the children tell vLLM's kernel selection the kernel is eligible, as the tests do
(``support/vllm_kernels.py``), and skip what would run it: processing and the
``reload`` path; ``float32`` does not apply.

Targets (printed, never asserted): on every row asyncslab's median at most 1.05x ``auto``'s;
on the first-load rows asyncslab at least 2x faster than the fastest of vLLM's own formats
in the same run; peak RSS growth <= parameters + staging + 64 MiB. On a GPU machine with
vLLM, ``--device cuda`` runs the same comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONTENDERS: dict[str, dict[str, Any]] = {
    "auto": {"load_format": "auto"},
    "safetensors": {"load_format": "safetensors"},
    "auto-multithread": {
        "load_format": "auto",
        "extra": {"enable_multithread_load": True, "num_threads": 2},
    },
    "runai_streamer": {"load_format": "runai_streamer"},
    "asyncslab": {"load_format": "asyncslab"},
    # Each layer processed as it lands, while later layers are read (off by default).
    "asyncslab-landed": {"load_format": "asyncslab", "extra": {"process_as_loaded": True}},
    # Huge pages asked for (they are off by default): what they change, in the same run.
    "asyncslab-huge": {"load_format": "asyncslab", "env": {"ASYNCSLAB_HUGE_PAGES": "1"}},
}
BOUNDS = ("bound-preadv-touched", "bound-preadv-fresh")
#: The paths besides the warm first load, and who runs them (asyncslab against auto).
PATHS = ("warm", "cold", "direct", "reload", "float32", "model")
PAIR = ("auto", "asyncslab")
#: asyncslab's median over auto's, at most, on every row; the first-load rows' speed-up.
RATIO_TARGET = 1.05
#: Rows with a target of their own: vLLM's whole get_model.
RATIO_TARGETS = {"model": 0.5}
FIRST_LOAD_SPEEDUP = 2.0
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
#: The field's expert counts on skinny dimensions (``--shape``): the tensor count of a real
#: MoE checkpoint (128 or 256 experts a layer) in a few hundred MB.
_SKINNY: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 32000,
}
SHAPES: dict[str, dict[str, Any]] = {
    "bench": BENCH_MODEL,
    # 24 x (128 x 3 + 7) + 3 = 9,387 tensors, 0.62 GB.
    "moe128": {**_SKINNY, "intermediate_size": 128, "num_local_experts": 128},
    # 24 x (256 x 3 + 7) + 3 = 18,603 tensors, 0.64 GB.
    "moe256": {**_SKINNY, "intermediate_size": 64, "num_local_experts": 256},
}
#: Shapes written as another one, then quantized in place (``to_fp8_block``): every linear
#: weight a whole number of FP8's 128 x 128 blocks. 24 x (128 x 6 + 11) + 3 = 18,699
#: tensors, 0.36 GB.
QUANTIZED = {"moe128-fp8": "moe128"}


def _status(field: str) -> int:
    """A size from /proc/self/status (``VmRSS``, ``VmHWM``, ``RssAnon``), in bytes."""
    from asyncslab._os import proc_status

    return proc_status()[field]


def _rss() -> int:
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _checksum(model: Any) -> int:
    import torch

    checksum = 0
    for p in model.parameters():
        flat = p.detach().reshape(-1).view(torch.uint8)
        checksum = (checksum * 1000003 + int(flat[::4093].to(torch.int64).sum())) % (1 << 61)
    return checksum


@contextlib.contextmanager
def _vllm(model: str, contender: str, device: str, mode: str) -> Iterator[tuple[Any, Any]]:
    """vLLM's configuration for ``contender`` and its loader, inside vLLM's current config
    with one rank's distributed state set up, as a worker has them before ``get_model``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    import asyncslab.vllm  # noqa: F401 - the plugin registers it in a real vLLM process

    spec = CONTENDERS[contender]
    config = EngineArgs(
        model=model,
        load_format=spec["load_format"],
        dtype="float32" if mode == "float32" else "bfloat16",
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
        if device == "cpu":
            # As vLLM's CPU model runner does before it loads: load_model empties the
            # accelerator's cache, which torch refuses with no accelerator.
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

            _set_torch_accelerator_to_noop()
        yield config, get_model_loader(config.load_config)


def child_load(model: str, contender: str, device: str, mode: str = "warm") -> dict[str, Any]:
    """One first load (``mode``: ``warm`` and ``cold`` in bfloat16, ``float32`` served so);
    a warm child of the pair also times the two reloads."""
    import gc

    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    serves = _kernels_here(Path(model), device)
    out: dict[str, Any] = {"contender": contender, "mode": mode}
    with _vllm(model, contender, device, mode) as (config, loader):
        target = torch.device(device)
        with set_default_torch_dtype(config.model_config.dtype), target:
            model_ = loader.create_model(vllm_config=config, model_config=config.model_config)
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model_.parameters())
        ptrs = [p.data_ptr() for p in model_.parameters()]
        gc.collect()
        rss_before = _rss()
        _reset_peak()
        out["load_weights_s"] = _timed(device, loader.load_weights, model_, config.model_config)
        out["peak_rss_growth"] = _peak() - rss_before
        out["pointers_kept"] = ptrs == [p.data_ptr() for p in model_.parameters()]
        out["checksum"] = _checksum(model_)
        report = getattr(loader, "report", None)
        out["transformed"] = None if report is None else len(report.transformed)
        out["capture_s"] = None if report is None else report.capture_s
        out["reads_s"] = None if report is None else report.load_s
        out["plan_s"] = None if report is None else report.plan_s
        out["recorded"] = None if report is None else report.recorded
        out["tensors"] = None if report is None else report.tensors
        reloads = mode == "warm" and contender in PAIR
        if reloads:
            weights = loader.get_all_weights(config.model_config, model_)
            out["direct_s"] = _timed(device, model_.load_weights, weights)
            out["direct_checksum"] = _checksum(model_)
        if not serves:
            return out
        t2 = time.perf_counter()
        gc.collect()
        t3 = time.perf_counter()
        process_weights_after_loading(model_, config.model_config, target)
        t4 = time.perf_counter()
        gc.collect()
        t5 = time.perf_counter()
        out.update(process_weights_s=t4 - t3, gc_s=(t3 - t2) + (t5 - t4))
        if reloads:
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            out["reload_s"] = _timed(device, reload_weights, config, model_, None, None, True)
            out["reload_checksum"] = _checksum(model_)
    return out


def child_get_model(model: str, contender: str, device: str) -> dict[str, Any]:
    """vLLM's ``get_model`` as a worker calls it (the loader's ``load_model``: create the
    model, ``load_weights``, collect, process, collect), timed whole and in its parts from
    outside; peak RSS growth over it, a checksum of every parameter as served (processed)."""
    import gc

    from vllm.model_executor.model_loader import base_loader

    out: dict[str, Any] = {"contender": contender, "mode": "model"}
    if not _kernels_here(Path(model), device):
        return out  # processing would run kernels this machine lacks
    parts = {"create_s": 0.0, "load_weights_s": 0.0, "process_s": 0.0, "gc_s": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[key] += time.perf_counter() - t0

        return run

    started: list[float] = []

    def collections(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2 and phase == "start":
            started.append(time.perf_counter())
        elif info["generation"] == 2 and started:
            parts["gc_s"] += time.perf_counter() - started.pop()

    with _vllm(model, contender, device, "model") as (config, loader):
        loader.create_model = timed("create_s", loader.create_model)
        loader.load_weights = timed("load_weights_s", loader.load_weights)
        process = base_loader.process_weights_after_loading
        base_loader.process_weights_after_loading = timed("process_s", process)
        gc.collect()
        rss_before = _rss()
        _reset_peak()
        gc.callbacks.append(collections)
        try:
            t0 = time.perf_counter()
            model_ = loader.load_model(vllm_config=config, model_config=config.model_config)
            out["get_model_s"] = time.perf_counter() - t0
        finally:
            gc.callbacks.remove(collections)
            base_loader.process_weights_after_loading = process
        out["peak_rss_growth"] = _peak() - rss_before
        out["model_checksum"] = _checksum(model_)
    return {**out, **parts}


def _kernels_here(model: Path, device: str) -> bool:
    """Whether vLLM has kernels for ``model`` on ``device``: not for block-wise FP8 on a
    CPU without AMX, whose kernel selection is then told the kernel is eligible (so that
    the model can be created and loaded; nothing runs it before processing)."""
    found = model / "config.json"
    if device != "cpu" or not found.is_file():  # s3_bench's children load from a URI
        return True
    quantization = json.loads(found.read_text()).get("quantization_config") or {}
    if "weight_block_size" not in quantization:
        return True
    import torch

    if torch.cpu._is_amx_tile_supported():
        return True
    from support.vllm_kernels import select_kernels_without_running_them

    select_kernels_without_running_them()
    return False


def _timed(device: str, fn: Any, *args: Any) -> float:
    import torch

    t0 = time.perf_counter()
    fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


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


def _child(model: str, contender: str, device: str, mode: str = "warm") -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.vllm_bench", "--child", contender]
    command += ["--model", model]
    command += ["--device", device, "--mode", mode]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    env.update(CONTENDERS.get(contender, {}).get("env", {}))
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    line = next((x for x in reversed(run.stdout.splitlines()) if x.startswith("{")), None)
    if run.returncode != 0 or line is None:
        return {"contender": contender, "mode": mode, "error": (run.stderr or run.stdout)[-2000:]}
    result: dict[str, Any] = json.loads(line)
    return result


def _files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def _warm(model: Path) -> None:
    for f in _files(model):
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass


def _evict(model: Path, drop_caches: bool) -> float:
    """Take the model's files out of the page cache; return the share still resident
    (``mincore``; the package's own bench helpers, which fsync and fadvise each file)."""
    from asyncslab.cli._bench.cache import cached_share as _cached_share
    from asyncslab.cli._bench.cache import drop_cache as _drop_cache

    if drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        share = _cached_share(_files(model))
    else:
        share = _drop_cache(_files(model))
    return float("nan") if share is None else share


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    times = [x[key] for x in runs if "error" not in x and x.get(key) is not None]
    if not times:
        return None
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| contender | load_weights | GB/s | process_weights_after_loading | gc.collect x2 "
        "| peak RSS growth | pointers kept |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['contender']} | failed: {r['error'].splitlines()[-1][:80]} |")
            continue
        gbps = r["param_bytes"] / r["median_s"] / 1e9
        # Not processed where vLLM has no kernel for the model here (_kernels_here).
        process, gc = (
            f"{r[k]:.2f} s" if r.get(k) is not None else "-" for k in ("process_weights_s", "gc_s")
        )
        lines.append(
            f"| {r['contender']} | {r['median_s']:.2f} s ({r['min_s']:.2f}-{r['max_s']:.2f}) "
            f"| {gbps:.2f} | {process} | {gc} | {r['peak_rss_growth'] / 2**20:,.0f} MiB "
            f"| {r.get('pointers_kept', '-')} |"
        )
    return "\n".join(lines)


#: Per path: the children's mode, the figure timed, what the row is.
ROWS: dict[str, tuple[str, str, str]] = {
    "warm": ("warm", "load_weights_s", "first load, page cache warm"),
    "cold": ("cold", "load_weights_s", "first load, model's files out of the page cache"),
    "direct": ("warm", "direct_s", "model.load_weights(get_all_weights()), live parameters"),
    "reload": ("warm", "reload_s", "vLLM's reload_weights after processing"),
    "float32": ("float32", "load_weights_s", "bfloat16 checkpoint served in float32"),
    "model": ("model", "get_model_s", "vLLM's get_model: create, load, collect, process"),
}


def _paths_table(results: dict[str, dict[str, list[dict[str, Any]]]], paths: list[str]) -> str:
    """One row per path: asyncslab against auto (medians, ranges), the ratio, the target."""
    lines = [
        "| path | asyncslab | auto | asyncslab / auto | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    for path in paths:
        mode, key, what = ROWS[path]
        ours = _summary(results[mode].get("asyncslab", []), key)
        theirs = _summary(results[mode].get("auto", []), key)
        if ours is None or theirs is None:
            lines.append(f"| {path}: {what} | failed | | | |")
            continue
        ratio = ours["median_s"] / theirs["median_s"]
        target = RATIO_TARGETS.get(path, RATIO_TARGET)
        met = "met" if ratio <= target else "missed"
        lines.append(
            f"| {path}: {what} | {ours['median_s']:.2f} s ({ours['min_s']:.2f}-"
            f"{ours['max_s']:.2f}) | {theirs['median_s']:.2f} s ({theirs['min_s']:.2f}-"
            f"{theirs['max_s']:.2f}) | {ratio:.2f}x | <= {target}x: {met} |"
        )
    return "\n".join(lines)


def _model_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """vLLM's get_model in its parts, per contender (medians)."""
    parts = ("get_model_s", "create_s", "load_weights_s", "gc_s", "process_s")
    lines = [
        "| contender | get_model | create | load_weights | full collections | processing "
        "| peak RSS growth |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, got in runs.items():
        good = [x for x in got if "error" not in x and x.get("get_model_s") is not None]
        if not good:
            lines.append(f"| {name} | - (not served here, or failed) | | | | | |")
            continue
        cells = [f"{statistics.median(x[k] for x in good):.2f} s" for k in parts]
        rss = statistics.median(x["peak_rss_growth"] for x in good)
        lines.append(f"| {name} | {' | '.join(cells)} | {rss / 2**20:,.0f} MiB |")
    return "\n".join(lines)


def _jobs(names: list[str], paths: list[str]) -> list[tuple[str, str]]:
    """A round's children, as (mode, contender)."""
    jobs: list[tuple[str, str]] = []
    if "warm" in paths:
        jobs += [("warm", n) for n in names]
    elif {"direct", "reload"} & set(paths):
        jobs += [("warm", n) for n in PAIR if n in names]
    for mode in ("cold", "float32"):
        if mode in paths:
            jobs += [(mode, n) for n in (*PAIR, "asyncslab-huge") if n in names]
    if "model" in paths:
        jobs += [("model", n) for n in (*PAIR, "asyncslab-landed") if n in names]
    return jobs


def _rounds(
    model: Path, args: argparse.Namespace, jobs: list[tuple[str, str]]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(args.rounds):
        for mode, name in jobs if r % 2 == 0 else jobs[::-1]:
            resident = None
            if mode == "cold":
                resident = _evict(model, args.drop_caches)
            else:
                _warm(model)
            result = _child(str(model), name, args.device, mode)
            if resident is not None:
                result["resident_before"] = resident
            results.setdefault(mode, {}).setdefault(name, []).append(result)
            shown = [
                f"{key.removesuffix('_s')} {result[key]:.3f} s"
                for key in ("load_weights_s", "direct_s", "reload_s", "get_model_s")
                if result.get(key) is not None
            ]
            extra = "" if resident is None else f" (resident before: {resident:.1%})"
            print(
                f"  round {r + 1} {mode} {name}: {', '.join(shown) or 'failed'}{extra}", flush=True
            )
    return results


def _warm_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for name, got in runs.items():
        good = [x for x in got if "error" not in x]
        if not good:
            rows.append({"contender": name, "error": got[0]["error"]})
            continue
        row = {**good[0], **(_summary(good, "load_weights_s") or {})}
        for key in ("process_weights_s", "gc_s", "peak_rss_growth", "capture_s", "reads_s"):
            values = [x[key] for x in good if x.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
        row["checksums"] = sorted({x.get("checksum") for x in good} - {None})
        rows.append(row)
    return rows


def _checks(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """The bytes checks: per mode, every format's checksums equal; a direct reload leaves
    what the first load did; vLLM's reload the same processed bytes for both formats."""
    out = []
    for mode, runs in results.items():
        for key in ("checksum", "direct_checksum", "reload_checksum", "model_checksum"):
            sums = {
                n: sorted({x[key] for x in got if x.get(key) is not None})
                for n, got in runs.items()
            }
            sums = {n: v for n, v in sums.items() if v}
            if sums:
                same = len({tuple(v) for v in sums.values()}) == 1
                out.append(f"{mode} {key}s: {'equal' if same else sums}")
    for got in results.get("warm", {}).values():
        for x in got:
            if x.get("direct_checksum") not in (None, x.get("checksum")):
                out.append(f"{x['contender']}: direct reload changed the bytes")
    return out


def _targets(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    out = []
    for mode in ("warm", "cold"):
        runs = results.get(mode, {})
        ours = _summary(runs.get("asyncslab", []), "load_weights_s")
        own = {n: _summary(runs[n], "load_weights_s") for n in OWN if n in runs}
        own = {n: v for n, v in own.items() if v is not None}
        if ours is None or not own:
            continue
        fastest = min(own, key=lambda n: own[n]["median_s"])  # type: ignore[index]
        speedup = own[fastest]["median_s"] / ours["median_s"]  # type: ignore[index]
        met = "met" if speedup >= FIRST_LOAD_SPEEDUP else "missed"
        out.append(
            f"{mode} first load: asyncslab {speedup:.2f}x faster than the fastest of vLLM's "
            f"own formats here ({fastest}); target >= {FIRST_LOAD_SPEEDUP}x: {met}"
        )
    ours_rows = [r for r in _warm_rows(results.get("warm", {})) if r["contender"] == "asyncslab"]
    if ours_rows and "error" not in ours_rows[0]:
        ours = ours_rows[0]
        budget = ours["param_bytes"] + (64 << 20)
        out.append(
            f"asyncslab peak RSS growth {ours['peak_rss_growth'] / 2**20:,.0f} MiB; "
            f"target <= parameters + staging + 64 MiB = {budget / 2**20:,.0f} MiB"
        )
    for mode, runs in results.items():
        on = _summary(runs.get("asyncslab-huge", []), "load_weights_s")
        off = _summary(runs.get("asyncslab", []), "load_weights_s")
        if on is not None and off is not None:
            out.append(
                f"{mode} first load, asyncslab with huge pages {on['median_s']:.2f} s "
                f"({on['min_s']:.2f}-{on['max_s']:.2f}), without {off['median_s']:.2f} s "
                f"({off['min_s']:.2f}-{off['max_s']:.2f})"
            )
    resident = [x.get("resident_before") for x in _all(results.get("cold", {}))]
    resident = [r for r in resident if r is not None]
    if resident:
        out.append(f"cold rows: at most {max(resident):.1%} of the files resident before a load")
    return out


def _all(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [x for got in runs.values() for x in got]


def shape_model(shape: str, workdir: Path) -> Path:
    """``shape``'s model in ``workdir``, written there first if missing."""
    model = workdir / ("mixtral-bench" if shape == "bench" else shape)
    if not (model / "config.json").exists():
        from support.quantized_models import to_fp8_block
        from support.vllm_models import write_model

        print(f"writing the {shape} model into {model} ...", flush=True)
        write_model(model, "mixtral", shards=4, **SHAPES[QUANTIZED.get(shape, shape)])
        if shape in QUANTIZED:
            to_fp8_block(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: write --shape's model)")
    ap.add_argument(
        "--shape",
        choices=[*SHAPES, *QUANTIZED],
        default="bench",
        help="the model written without --model: bench (18 layers x 8 experts, 1.48 GB), "
        "moe128 or moe256 (24 layers x 128 or 256 experts, skinny), moe128-fp8 (moe128 in "
        "block-wise FP8)",
    )
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "asyncslab-vllm-bench"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", help="comma-separated contenders")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    ap.add_argument("--drop-caches", action="store_true", help="cold: drop the whole cache")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="warm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child in BOUNDS:
            print(json.dumps(child_bound(args.model, args.child, args.device)))
        elif args.mode == "model":
            print(json.dumps(child_get_model(args.model, args.child, args.device)))
        else:
            print(json.dumps(child_load(args.model, args.child, args.device, args.mode)))
        return
    model = Path(args.model) if args.model else shape_model(args.shape, Path(args.workdir))
    names = [*CONTENDERS, *BOUNDS]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    paths = [p for p in args.paths.split(",") if p in ROWS]
    size = sum(f.stat().st_size for f in _files(model))
    jobs = _jobs(names, paths)
    print(f"model {model}: {size / 1e9:.3f} GB; {args.rounds} rounds of {len(jobs)} loads")
    results = _rounds(model, args, jobs)
    if args.json:  # the raw runs first: a fault below must not lose them
        Path(args.json).write_text(json.dumps({"model_bytes": size, "runs": results}, indent=1))
    rows = _warm_rows(results.get("warm", {}))
    print()
    if rows:
        print(_table(rows))
        print()
    print(_paths_table(results, [p for p in paths if p in ROWS]))
    print()
    if results.get("model"):
        print(_model_table(results["model"]))
        print()
    for line in [*_targets(results), *_checks(results)]:
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model_bytes": size, "rows": rows, "runs": results}, indent=1)
        )


if __name__ == "__main__":
    main()

"""``asyncslab.transformers.from_pretrained`` against transformers' own ``from_pretrained``:
each load in a fresh process, rounds interleaved (the order reversed every other round).

    python -m benchmarks.transformers_bench [--models mixtral,qwen3moe] [--rounds 5]
        [--modes warm,cold,s3] [--workdir DIR] [--json OUT] [--quick]

Models (bfloat16, random, written once by transformers' ``save_pretrained`` into
``--workdir`` and reused, per-expert tensors as published): ``mixtral``, the 1.47 GB
Mixtral-like model of ``benchmarks/vllm_bench.py`` (18 layers x 8 experts); ``qwen3moe``, a
Qwen3-MoE-like model with 128 experts a layer (8 layers, hidden 1024, expert width 256,
1.79 GB, 3,147 tensors); ``llama``, a dense Llama-like model (10 layers, hidden 2048,
intermediate 5632, grouped-query attention, untied embeddings, 1.16 GB, 93 tensors; not in
the default ``--models``). Modes:

* ``warm``: the files in the page cache;
* ``cold``: the files evicted before each load (``posix_fadvise(DONTNEED)``, the share left
  resident checked with ``mincore`` and shown);
* ``s3``: the model uploaded to SeaweedFS on 127.0.0.1 (``support/s3server.py``, as the tests
  start it); asyncslab reads ``s3://`` itself, transformers cannot, so it is timed as
  download-then-``from_pretrained`` (obstore GETs of every object into a temporary
  directory, then the load).

A child imports torch, transformers and asyncslab first (no contender pays for imports),
and builds the model once on the meta device (transformers imports a model's module lazily),
then times the one call, with peak RSS growth over it: total (``VmHWM``, reset before the
call; file pages mapped by the loader count) and anonymous (``RssAnon`` sampled every 2 ms,
so a peak shorter than that can be missed), and a checksum of every parameter (equal across
contenders: the same bytes), timed too: it reads a byte of every page, so for parameters that
are views of the mapped files (transformers' dense tensors on a CPU) it does the reads the
load left to the first use ("+ every page read once"). Medians and ranges over rounds; ratios
are transformers' time over asyncslab's, paired per round. On a CPU both hand out the
parameters a checkpoint tensor fills whole as views of the files' mappings;
``--copy`` adds asyncslab with ``disable_mmap=True`` (every byte read now) as a row.

Targets (printed, never asserted): warm, asyncslab at least 1.5x faster than
``from_pretrained`` on the MoE shapes, never slower on the dense one; never slower cold or
from ``s3://``; peak RSS growth at most the parameters + 128 MiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm_bench import _status  # noqa: E402  (a size from /proc/self/status)

CONTENDERS = {
    "warm": ("transformers", "asyncslab"),
    "cold": ("transformers", "asyncslab"),
    "s3": ("download+transformers", "asyncslab-s3"),
}
WARM_SPEEDUP = 1.5
MOE = ("mixtral", "qwen3moe")
RSS_SLACK = 128 << 20

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Filled from benchmarks/vllm_bench.py's BENCH_MODEL at run time (the same model).
    "mixtral": ("MixtralConfig", {}),
    "qwen3moe": (
        "Qwen3MoeConfig",
        {
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "moe_intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "vocab_size": 32000,
        },
    ),
    # Dense: nothing fused, each checkpoint tensor is a whole parameter.
    "llama": (
        "LlamaConfig",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 10,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
    ),
}
QUICK: dict[str, dict[str, Any]] = {
    "mixtral": {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4},
    "qwen3moe": {"hidden_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2},
    "llama": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2},
}


# --- the child: one load ----------------------------------------------------------------


def _checksum(model: Any) -> int:
    import torch

    checksum = 0
    for p in model.state_dict().values():
        flat = p.detach().reshape(-1).view(torch.uint8)
        checksum = (checksum * 1000003 + int(flat[::4093].to(torch.int64).sum())) % (1 << 61)
    return checksum


def _download(uri: str, into: Path) -> None:
    import obstore
    from obstore.store import S3Store

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    store = S3Store(bucket, client_options={"allow_http": True})
    for page in obstore.list(store, f"{prefix}/"):
        for meta in page:
            data = obstore.get(store, meta["path"]).bytes()
            (into / Path(meta["path"]).name).write_bytes(bytes(data))


def child(contender: str, model: str, local: str) -> dict[str, Any]:
    import torch
    import transformers

    import asyncslab.transformers

    # The imports no contender should pay for at its first call (transformers imports a
    # model's module, and much else, lazily): the model built once on the meta device.
    config = transformers.AutoConfig.from_pretrained(local)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)
    peak_anon = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS
    rss0, anon0 = _status("VmRSS"), _status("RssAnon")
    peak_anon[0] = anon0
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if contender == "transformers":
            loaded = transformers.AutoModelForCausalLM.from_pretrained(model)
        elif contender == "asyncslab" or contender == "asyncslab-s3":
            loaded = asyncslab.transformers.from_pretrained(model)
        elif contender == "asyncslab-copy":
            loaded = asyncslab.transformers.from_pretrained(model, disable_mmap=True)
        elif contender == "download+transformers":
            _download(model, Path(tmp))
            loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp)
        else:
            raise SystemExit(f"unknown contender {contender}")
        seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
    params = sum(p.numel() * p.element_size() for p in loaded.state_dict().values())
    assert all(p.device == torch.device("cpu") for p in loaded.parameters())
    result = {
        "contender": contender,
        "seconds": seconds,
        "peak_rss_growth": _status("VmHWM") - rss0,
        "peak_anon_growth": peak_anon[0] - anon0,
        "final_anon_growth": _status("RssAnon") - anon0,
        "parameter_bytes": params,
    }
    # The checksum reads a byte of every page of every parameter: for a model whose
    # parameters are views of the mapped files (transformers' dense tensors), the reads its
    # load left to the first use.
    started = time.perf_counter()
    result["checksum"] = _checksum(loaded)
    result["touch_s"] = time.perf_counter() - started
    return result


# --- the device check: both loaders onto one device, bit for bit -------------------------


def device_check(directories: dict[str, Path], device: str, rounds: int) -> list[str]:
    """Each model loaded onto ``device`` by ``from_pretrained(device_map=device)`` and by
    asyncslab ``rounds`` times in one process (the order reversed every other round, CUDA
    initialised first), every parameter and buffer compared byte for byte and the logits of
    a few tokens; returns one line per model (``benchmarks/gpu_check.sh`` runs it on CUDA)."""
    import torch
    import transformers

    import asyncslab.transformers

    target = torch.device(device)
    cuda = target.type == "cuda"
    # transformers needs accelerate for any device_map; without it, its load onto the CPU
    # and then ``.to(device)`` (said in the result).
    placed_by_transformers = importlib.util.find_spec("accelerate") is not None
    how = f"device_map={device!r}" if placed_by_transformers else f".to({device!r})"
    if cuda:
        torch.ones(1, device=target).sum().item()  # CUDA's start-up is no contender's time

    def synced() -> float:
        if cuda:
            torch.cuda.synchronize(target)
        return time.perf_counter()

    def load(contender: str, path: Path) -> tuple[Any, float, int]:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(target)
        before = torch.cuda.memory_allocated(target) if cuda else 0
        started = synced()
        if contender == "transformers" and placed_by_transformers:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device)
        elif contender == "transformers":
            model = transformers.AutoModelForCausalLM.from_pretrained(path).to(target)
        else:
            model = asyncslab.transformers.from_pretrained(path, device=device)
        seconds = synced() - started
        peak = torch.cuda.max_memory_allocated(target) - before if cuda else 0
        return model, seconds, peak

    lines = []
    for name, path in directories.items():
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
        times: dict[str, list[float]] = {"transformers": [], "asyncslab": []}
        peaks: dict[str, int] = {}
        differ: set[str] = set()
        logits_equal = True
        for r in range(rounds):
            loaded = {}
            for contender in ("transformers", "asyncslab")[:: -1 if r % 2 else 1]:
                model, seconds, peak = load(contender, path)
                loaded[contender] = model
                times[contender].append(seconds)
                peaks[contender] = max(peaks.get(contender, 0), peak)
            theirs = loaded["transformers"].state_dict()
            ours = loaded["asyncslab"].state_dict()
            differ |= set(theirs).symmetric_difference(ours)
            for key in theirs.keys() & ours.keys():
                a, b = theirs[key], ours[key]
                same = a.device == b.device == target and a.dtype == b.dtype
                same = same and a.shape == b.shape
                if not same or not torch.equal(
                    a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                ):
                    differ.add(key)
            tokens = torch.arange(1, 9, device=target).unsqueeze(0) % config.vocab_size
            with torch.no_grad():
                logits = [loaded[c](tokens).logits for c in ("transformers", "asyncslab")]
            logits_equal = logits_equal and torch.equal(*logits)
            params = sum(t.numel() * t.element_size() for t in ours.values())
            del loaded, theirs, ours, logits
        ratio = statistics.median(t / o for t, o in zip(*times.values(), strict=True))
        verdict = (
            "bit-identical"
            if not differ and logits_equal
            else (f"DIFFER: {sorted(differ)[:5]} logits equal {logits_equal}")
        )
        memory = (
            f"; peak {device} memory growth transformers {_mib(peaks['transformers'])}, "
            f"asyncslab {_mib(peaks['asyncslab'])}"
            if cuda
            else ""
        )
        lines.append(
            f"{name} on {device}, parameters {_mib(params)}, {rounds} rounds: {verdict}; "
            f"from_pretrained({how}) "
            f"transformers {_summary(times['transformers'])}, asyncslab "
            f"{_summary(times['asyncslab'])}, transformers / asyncslab = {ratio:.2f}x{memory}"
        )
    return lines


# --- the parent: models, rounds, tables -------------------------------------------------


def write_model(name: str, directory: Path, quick: bool) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    from benchmarks.vllm_bench import BENCH_MODEL

    cls_name, fields = MODELS[name]
    fields = dict(BENCH_MODEL) if name == "mixtral" else dict(fields)
    if quick:
        fields.update(QUICK[name])
    config = getattr(transformers, cls_name)(**fields, dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * 0.02)
    partial = directory.with_name(directory.name + ".partial")
    model.save_pretrained(partial, max_shard_size="512MB")
    partial.rename(directory)
    return directory


def _run_child(contender: str, model: str, local: Path, env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.transformers_bench", "--child", contender]
    command += ["--model", model]
    command += ["--local", str(local)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=600)
    line = next((x for x in reversed(run.stdout.splitlines()) if x.startswith("{")), None)
    if run.returncode != 0 or line is None:
        return {"contender": contender, "error": (run.stderr or run.stdout)[-2000:]}
    result: dict[str, Any] = json.loads(line)
    return result


def _summary(values: list[float]) -> str:
    if not values:
        return "failed"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> tuple[str, list[str]]:
    lines = [
        "| model | mode | contender | seconds (median, range) | + every page read once | "
        "peak RSS growth | peak anon growth | final anon growth |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    targets: list[str] = []
    for key, by_contender in results.items():
        model, mode = key.split("/")
        for contender, runs in by_contender.items():
            ok = [r for r in runs if "error" not in r]

            def median(key: str, ok: list[dict[str, Any]] = ok) -> float:
                return statistics.median(r[key] for r in ok) if ok else float("nan")

            touched = [r["seconds"] + r["touch_s"] for r in ok if "touch_s" in r]
            lines.append(
                f"| {model} | {mode} | {contender} | {_summary([r['seconds'] for r in ok])} | "
                f"{_summary(touched)} | "
                f"{_mib(median('peak_rss_growth'))} | {_mib(median('peak_anon_growth'))} | "
                f"{_mib(median('final_anon_growth'))} |"
            )
        theirs_name, ours_name = CONTENDERS[mode]
        theirs, ours = by_contender.get(theirs_name, []), by_contender.get(ours_name, [])
        pairs = [
            (t["seconds"], o["seconds"])
            for t, o in zip(theirs, ours, strict=False)
            if "error" not in t and "error" not in o
        ]
        if not pairs:
            targets.append(f"{model} {mode}: no paired rounds")
            continue
        ratios = [t / o for t, o in pairs]
        ratio = statistics.median(ratios)
        want = WARM_SPEEDUP if mode == "warm" and model in MOE else 1.0
        verdict = "met" if ratio >= want else "NOT met"
        targets.append(
            f"{model} {mode}: {theirs_name} / asyncslab = {ratio:.2f}x (rounds "
            f"{min(ratios):.2f}-{max(ratios):.2f}; target >= {want}x: {verdict})"
        )
        touched = [
            (t["seconds"] + t["touch_s"]) / (o["seconds"] + o["touch_s"])
            for t, o in zip(theirs, ours, strict=False)
            if "touch_s" in t and "touch_s" in o
        ]
        if touched:
            targets.append(
                f"{model} {mode}: until every page was read once, {theirs_name} / asyncslab = "
                f"{statistics.median(touched):.2f}x (rounds {min(touched):.2f}-{max(touched):.2f})"
            )
        ok = [r for r in ours if "error" not in r]
        if ok:
            growth = statistics.median(r["peak_rss_growth"] for r in ok)
            anon = statistics.median(r["peak_anon_growth"] for r in ok)
            params = ok[0]["parameter_bytes"]
            limit = params + RSS_SLACK
            targets.append(
                f"{model} {mode}: asyncslab peak RSS growth {_mib(growth)} (anon {_mib(anon)}), "
                f"parameters {_mib(params)}, limit {_mib(limit)}: "
                + ("met" if growth <= limit else "NOT met")
            )
        sums = {r["checksum"] for runs in by_contender.values() for r in runs if "error" not in r}
        if len(sums) > 1:
            targets.append(f"{model} {mode}: CHECKSUMS DIFFER {sorted(sums)}")
    return "\n".join(lines), targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", default="mixtral,qwen3moe")
    parser.add_argument("--modes", default="warm,cold,s3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "asyncslab-tf-bench"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="small models (a smoke test)")
    parser.add_argument(
        "--copy",
        action="store_true",
        help="warm and cold: asyncslab with disable_mmap=True too (every byte read into the "
        "process's memory, none left mapped), a row of its own",
    )
    parser.add_argument(
        "--device-check",
        default=None,
        metavar="DEVICE",
        help="load --models onto DEVICE (cuda, or cpu as a smoke test) by both loaders in one "
        "process, compare bit for bit and time them (--rounds each); no benchmark rows",
    )
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.model, args.local)), flush=True)
        return
    if args.device_check is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        suffix = "-quick" if args.quick else ""
        directories = {
            n: write_model(n, args.workdir / f"{n}{suffix}", args.quick)
            for n in args.models.split(",")
        }
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        lines = device_check(directories, args.device_check, args.rounds)
        print("\n".join(lines))
        if args.json is not None:
            args.json.write_text(json.dumps({"device_check": lines}, indent=2))
        if any("DIFFER" in line for line in lines):
            raise SystemExit(1)
        return
    from asyncslab.cli._bench.cache import drop_cache as _drop_cache

    names = args.models.split(",")
    modes = args.modes.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    local = {n: write_model(n, args.workdir / f"{n}{suffix}", args.quick) for n in names}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    server = None
    uris: dict[str, str] = {}
    try:
        if "s3" in modes:
            from support.s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer, upload

            server = SeaweedServer(Path(tempfile.mkdtemp(prefix="tf-bench-s3-")))
            server.start()
            for n, path in local.items():
                upload(server.store(), f"bench/{n}{suffix}", path)
                uris[n] = f"s3://models/bench/{n}{suffix}"
            env.update(
                AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true",
            )  # fmt: skip
        results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        resident: list[float] = []
        started = time.time()
        for r in range(args.rounds):
            for n in names:
                for mode in modes:
                    order = CONTENDERS[mode]
                    if args.copy and mode != "s3":
                        order = (*order, "asyncslab-copy")
                    order = order[:: -1 if r % 2 else 1]
                    for contender in order:
                        if mode == "cold":
                            share = _drop_cache(sorted(local[n].glob("*.safetensors")))
                            resident.append(float("nan") if share is None else share)
                        source = uris[n] if mode == "s3" else str(local[n])
                        result = _run_child(contender, source, local[n], env)
                        result["round"] = r
                        results.setdefault(f"{n}/{mode}", {}).setdefault(contender, []).append(
                            result
                        )
                        if "error" in result:
                            print(
                                f"round {r} {n} {mode} {contender}: {result['error']}",
                                file=sys.stderr,
                            )
            print(
                f"round {r + 1}/{args.rounds} done ({time.time() - started:.0f} s)", file=sys.stderr
            )
    finally:
        if server is not None:
            server.stop()
    table, targets = report(results)
    print(table)
    if resident:
        print(f"\ncold: share of the files still resident after eviction: max {max(resident):.3f}")
    print("\nTargets:")
    for line in targets:
        print(f"- {line}")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "targets": targets}, indent=2))


if __name__ == "__main__":
    main()

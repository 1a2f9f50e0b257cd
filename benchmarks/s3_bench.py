"""Loads from object storage side by side: asyncslab, runai-model-streamer, tensorizer and
a raw bound, then vLLM's load formats, from a local SeaweedFS, through an emulated remote
link, and from GCS's and Azure's emulators.

    pip install -e '.[test,peers]'
    # or the peers kept out of a venv others share (runai's S3 client pins python-dateutil
    # down): pip install --target PEERS --no-deps tensorizer runai-model-streamer-s3
    # runai-model-streamer-gcs and their dependencies, then, runai's backends landing in
    # PEERS' copy of its lib folder:
    #   export PYTHONPATH=PEERS LD_LIBRARY_PATH=PEERS/runai_model_streamer/libstreamer/lib
    python -m benchmarks.s3_bench [--rounds 3] [--models mixtral,exl3]
        [--links local,remote,gcs,azure] [--contenders ...] [--exl3-size 3GiB] [--json OUT]
        [--quick]

Starts SeaweedFS on 127.0.0.1 (``support/s3server.py``, as the tests do) and uploads two
checkpoints: the 1.47 GB Mixtral-like bfloat16 model of ``benchmarks/vllm_bench.py`` and a
3 GiB EXL3-like one (``asyncslab bench``'s synthetic checkpoint). Both are written once into
``--workdir`` and reused. Every load runs in a fresh process, after one unmeasured load
of each model over each link, rounds interleaved (the order reversed every other round):

- library (every model): ``asyncslab.load`` from ``s3://`` into CPU memory with the default
  ``LoadOptions`` (``asyncslab bench``'s worker, its clock after opening and planning, which
  is reported beside it), and ``asyncslab:obstore``, the same with every GET through obstore
  (``presigned_gets=False``, as the only way before presigned GETs; not on GCS, never
  signed for); runai-model-streamer's ``SafetensorsStreamer`` on the same objects
  with its defaults, each tensor copied into its slot (the worker's peer adapter; its clock
  includes its own header reads); two raw bounds: the same ranged GETs with obstore, same
  request size and concurrency, into one preallocated buffer, no bookkeeping, made by async
  calls on one event loop (``raw-bound``, ``benchmarks/object_store_bench.py``'s) and by
  threads, each copying its own response, as asyncslab's I/O threads do
  (``raw-bound-threads``);
- in vLLM (the Mixtral-like model): ``load_format`` ``asyncslab`` and ``runai_streamer`` with
  ``model="s3://..."``, ``load_weights`` timed (``benchmarks/vllm_bench.py``'s child);
  ``asyncslab`` there is reported "not available" until vLLM + asyncslab take ``s3://``;
  ``tensorizer``: vLLM's own tensorizer loader over the tensorizer object below (the
  model's configuration from its local directory), ``load_weights`` timed the same way;
- tensorizer (the Mixtral-like model, S3 links): CoreWeave's serialiser, the state dict
  written once with ``TensorSerializer`` into one object on the same server, read back by
  its own ``TensorDeserializer`` from ``s3://`` (its HTTP reader, ``force_http``) into CPU
  tensors;
- links: ``local`` is the server itself; ``remote`` adds ``--latency-ms`` (20) to each
  request and caps each connection at ``--link-mbps`` (100 MB/s), as one S3 connection over
  a distant link gives: there, concurrency decides. ``--link-emulation splice`` (the
  default) is a kernel relay (``SpliceLink``: connections kept alive, the payload never in
  Python, so the link costs the loaders next to no CPU); ``proxy`` is the tests'
  ``FaultProxy`` of earlier runs (a new connection per request, every byte relayed by a
  Python event loop on the loaders' cores).
  ``gcs`` and ``azure`` are fake-gcs-server and Azurite on 127.0.0.1
  (``support/object_servers.py``), the Mixtral-like model only, reached by each cloud's own
  variables (``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING``): asyncslab and
  the raw bounds on both, runai-model-streamer on GCS (its Azure build cannot reach
  Azurite: the host is hard-coded).

Prints one table per link (median seconds and range over rounds, GB/s, median peak RSS
growth of the load), and the targets, never asserted: asyncslab within 1.1x of the faster
raw bound (the one with the lower median time, paired per round), on every store; at least
3x faster than ``runai_streamer`` in vLLM; faster than tensorizer's reader on the same model
and link; asyncslab's peak RSS growth at most parameters + the in-flight budget (request size x
concurrency) + 64 MiB. ``--quick`` uses small models (a smoke test); ``--json OUT`` writes
every run and the summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.object_servers import AzuriteServer, GcsServer
from support.s3server import (
    ACCESS_KEY,
    SECRET_KEY,
    FaultProxy,
    SeaweedServer,
    SpliceLink,
    upload,
)

MiB = 1 << 20
BUCKET = "models"
LIBRARY = (
    "asyncslab",
    "asyncslab:obstore",
    "runai-model-streamer",
    "tensorizer",
    "raw-bound",
    "raw-bound-threads",
)
#: The raw bounds: asyncslab is judged against the faster of them in each round.
BOUNDS = ("raw-bound", "raw-bound-threads")
VLLM = ("vllm:asyncslab", "vllm:runai_streamer", "vllm:tensorizer")
#: vLLM's whole get_model from the bucket (create, load, collect, process; the seconds are
#: get_model's): each layer processed as it lands, or all after the load (the default).
#: Run when named in --contenders, not by default.
VLLM_MODEL = ("vllm-model:asyncslab-landed", "vllm-model:asyncslab")
CONTENDERS = (*LIBRARY, *VLLM, *VLLM_MODEL)
DEFAULT_CONTENDERS = (*LIBRARY, *VLLM)
MODELS = ("mixtral", "exl3")
LINKS = ("local", "remote", "gcs", "azure")
#: How the remote link is emulated: ``support/s3server.py``'s SpliceLink or FaultProxy.
EMULATIONS = ("splice", "proxy")
#: The links to the emulators (the Mixtral-like model only) and who runs there.
EMULATED = {
    "gcs": ("asyncslab", "runai-model-streamer", "raw-bound", "raw-bound-threads"),
    "azure": ("asyncslab", "asyncslab:obstore", "raw-bound", "raw-bound-threads"),
}
#: Where vLLM + asyncslab is to accept s3:// (issue 30, item 6); until then its row says so.
VLLM_OBJECT_STORE_MODULE = "asyncslab.engines._vllm_object_store"
#: The quick mode's Mixtral-like model: the same architecture, a few MB.
QUICK_MIXTRAL: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 1000,
}
RESULT = "@@s3-bench@@ "


# --------------------------------------------------------------------------- checkpoints


def write_models(
    workdir: Path, models: Sequence[str], quick: bool, exl3_size: int
) -> dict[str, Path]:
    """Each selected model's local directory, written on first use and reused after."""
    out: dict[str, Path] = {}
    if "mixtral" in models:
        target = workdir / ("mixtral-quick" if quick else "mixtral-bench")
        if not (target / "config.json").exists():
            from benchmarks.vllm_bench import BENCH_MODEL
            from support.vllm_models import write_model

            print(f"writing the Mixtral-like model into {target} ...", flush=True)
            # As vllm_bench.py writes it (its BENCH_MODEL, 4 shards requested).
            write_model(target, "mixtral", shards=4, **(QUICK_MIXTRAL if quick else BENCH_MODEL))
        out["mixtral"] = target
    if "exl3" in models:
        from asyncslab.cli._bench.fixtures import generate as _generate

        size = 24 * MiB if quick else exl3_size
        print(f"EXL3-like checkpoint of {size / 2**30:.2f} GiB ...", flush=True)
        out["exl3"], _ = _generate(workdir, size)  # asyncslab bench's own, reused if there
    return out


def payload_bytes(directory: Path) -> int:
    import asyncslab

    return int(asyncslab.plan(asyncslab.Checkpoint.open(directory)).nbytes)


# --------------------------------------------------------------------------- the links


@dataclass(frozen=True)
class Link:
    name: str
    endpoint: str
    scheme: str = "s3"
    env: tuple[tuple[str, str], ...] = ()  # how every contender reaches it


def _serialised(workdir: Path, name: str, directory: Path) -> Path:
    """``directory``'s tensors as one tensorizer file (written once, reused)."""
    target = workdir / f"{name}.tensors"
    if not target.exists():
        from safetensors.torch import load_file
        from tensorizer import TensorSerializer

        tensors = {}
        for shard in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(shard))
        serializer = TensorSerializer(str(target) + ".part")
        serializer.write_state_dict(tensors)
        serializer.close()
        os.replace(str(target) + ".part", target)
    return target


@contextmanager
def serving(
    models: dict[str, Path],
    links: Sequence[str],
    latency_s: float,
    rate: float,
    tensorizer: Path | None = None,
    emulation: str = "splice",
) -> Iterator[dict[str, Link]]:
    """SeaweedFS with every model uploaded (``s3://models/NAME``; with ``tensorizer`` a
    workdir, each model's tensorizer file at ``s3://models/tensorizer/NAME.tensors``), the
    emulators with the Mixtral-like model, and the links to them."""
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="s3-bench-")))
        server = SeaweedServer(tmp)
        server.start()
        stack.callback(server.stop)
        for name, directory in models.items():
            began = time.perf_counter()
            upload(server.store(BUCKET), name, directory)
            print(f"uploaded {name} in {time.perf_counter() - began:.1f} s", flush=True)
            if tensorizer is not None and name == "mixtral":
                serialised = _serialised(tensorizer, name, directory)
                server.put(f"tensorizer/{name}.tensors", serialised.read_bytes())
        out = {}
        if "local" in links:
            out["local"] = Link("local", server.endpoint, env=_items(s3_env(server.endpoint)))
        if "remote" in links:
            kind = SpliceLink if emulation == "splice" else FaultProxy
            proxy = stack.enter_context(kind(server.endpoint, latency_s=latency_s, rate=rate))
            out["remote"] = Link("remote", proxy.endpoint, env=_items(s3_env(proxy.endpoint)))
        emulators = {"gcs": GcsServer, "azure": AzuriteServer}
        for link, kind in emulators.items():
            if link not in links or "mixtral" not in models:
                continue
            emulator = kind(tmp / link)
            (tmp / link).mkdir()
            emulator.start()
            stack.callback(emulator.stop)
            for path in sorted(models["mixtral"].iterdir()):
                emulator.put(f"mixtral/{path.name}", path.read_bytes())
            env = (
                {
                    "STORAGE_EMULATOR_HOST": emulator.endpoint,
                    # runai-model-streamer's GCS client reads these.
                    "CLOUD_STORAGE_EMULATOR_ENDPOINT": emulator.endpoint,
                    "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "1",
                }
                if isinstance(emulator, GcsServer)
                else {"AZURE_STORAGE_CONNECTION_STRING": emulator.connection_string()}
            )
            out[link] = Link(link, emulator.endpoint, emulator.scheme, _items(env))
        yield out


def _items(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(env.items()))


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment every contender reads its endpoint and credentials from: the AWS
    conventions (asyncslab, obstore and runai-model-streamer all take them), path-style."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }


# --------------------------------------------------------------------------- children


def missing(contender: str, link: str = "local") -> str | None:
    """Why ``contender`` cannot run here, or None."""
    client = "runai_model_streamer_gcs" if link == "gcs" else "runai_model_streamer_s3"
    if "runai" in contender and importlib.util.find_spec(client) is None:
        return f"not available: pip install {client.replace('_', '-')}"
    if contender.endswith("tensorizer") and importlib.util.find_spec("tensorizer") is None:
        return "not available: pip install tensorizer"
    if contender.startswith("vllm") and importlib.util.find_spec("vllm") is None:
        return "not available: vLLM is not installed"
    ours = contender.startswith("vllm") and "asyncslab" in contender
    if ours and importlib.util.find_spec(VLLM_OBJECT_STORE_MODULE) is None:
        return "not available: vLLM + asyncslab does not take s3:// yet"
    return None


def child(contender: str, uri: str, link: Link, config: Path | None = None) -> dict[str, Any]:
    """One load of ``uri`` by ``contender`` in a fresh process (``config``: the model's
    local directory, for a loader that reads only the payload from ``uri``)."""
    env = dict(os.environ, **dict(link.env))
    if contender in ("asyncslab", "asyncslab:obstore", "runai-model-streamer"):
        from asyncslab.cli._bench.worker import RESULT_MARK

        name, _, via = contender.partition(":")
        task: dict[str, Any] = {"contender": name, "checkpoint": uri, "mode": "warm-fresh"}
        task["verify"] = 0
        if via == "obstore":  # every GET through obstore, as before presigned GETs
            task["options"] = {"presigned_gets": False}
        command = [sys.executable, "-m", "asyncslab.cli._bench.worker", json.dumps(task)]
        mark = RESULT_MARK
    else:
        command = [sys.executable, "-m", "benchmarks.s3_bench", "--child", contender, "--uri", uri]
        if config is not None:
            command += ["--config", str(config)]
        mark = RESULT
        if contender.startswith("vllm"):
            # As vllm_bench.py runs its children: a small KV cache, quiet logs.
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    line = next((x for x in reversed(run.stdout.splitlines()) if x.startswith(mark)), None)
    if run.returncode != 0 or line is None:
        tail = (run.stderr or run.stdout).strip().splitlines()
        return {"error": f"exit {run.returncode}: {tail[-1] if tail else 'no output'}"}
    result: dict[str, Any] = json.loads(line[len(mark) :])
    for bulky in ("lag_samples_ms", "idle_lag_samples_ms"):  # the worker's, per 1 ms tick
        result.pop(bulky, None)
    if "error" in result:
        result["error"] = str(result["error"]).splitlines()[0]
    return result


def child_raw(uri: str, threads: bool) -> dict[str, Any]:
    """A raw bound: the payload's ranged GETs, asyncslab's default request size and
    concurrency, into one buffer; peak RSS growth as the worker measures it. ``raw-bound`` is
    object_store_bench.py's (async GETs on one event loop, whose thread copies every
    response); ``raw-bound-threads`` makes them from threads, as asyncslab's I/O threads do."""
    import asyncio

    import asyncslab
    from asyncslab.cli._bench.worker import Timed
    from benchmarks.object_store_bench import raw_bound

    ckpt = asyncslab.Checkpoint.open(uri)
    options = asyncslab.LoadOptions()
    timed = Timed()
    timed.start()
    if threads:
        seconds = raw_threads(ckpt, options.request_size, options.request_concurrency)
    else:
        seconds = asyncio.run(raw_bound(ckpt, options.request_size, options.request_concurrency))
    timed.stop()
    rec = timed.record()
    rec["seconds"] = seconds  # the bound's own clock: after its buffer and ranges are made
    rec["bytes"] = sum(f.size - f.data_start for f in ckpt.files)
    return rec


def raw_threads(ckpt: Any, request: int, concurrency: int) -> float:
    """Each shard's payload cut at ``request`` bytes, fetched by ``concurrency`` threads with
    obstore's blocking ranged GET (the GIL released while it waits), each response copied
    by its own thread into one preallocated buffer (numpy copies without the GIL)."""
    import threading

    import numpy as np
    import obstore
    import torch

    from asyncslab._objects import client

    jobs = []
    total = 0
    for shard in ckpt.files:
        store = client(shard.source.store)
        for start in range(shard.data_start, shard.size, request):
            end = min(shard.size, start + request)
            jobs.append((store, shard.source.key, start, end, total))
            total += end - start
    target = torch.empty(total, dtype=torch.uint8).numpy()  # fresh memory, as slabs are
    pending = iter(jobs)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                job = next(pending, None)
            if job is None:
                return
            store, key, start, end, at = job
            data = obstore.get_range(store, key, start=start, end=end)
            target[at : at + end - start] = np.frombuffer(memoryview(data), dtype=np.uint8)

    began = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - began


def child_tensorizer(uri: str) -> dict[str, Any]:
    """tensorizer's own reader: ``TensorDeserializer`` over its ``s3://`` stream (plain
    HTTP to the endpoint, as ``force_http`` asks), every tensor into CPU memory; peak RSS
    growth as the worker measures it. Its clock starts before the stream is opened (the
    stream's first request reads the file's header, as asyncslab's open does)."""
    import hashlib

    from tensorizer import TensorDeserializer
    from tensorizer.stream_io import open_stream

    from asyncslab.cli._bench.worker import Timed

    timed = Timed()
    timed.start()
    stream = open_stream(uri, "rb", **_tensorizer_s3(), force_http=True)
    tensors = TensorDeserializer(stream, device="cpu")
    nbytes = sum(t.nbytes for t in tensors.values())
    timed.stop()
    rec = timed.record()
    rec["bytes"] = nbytes
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(tensors[name].contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
    rec["checksum"] = digest.hexdigest()[:16]
    tensors.close()
    stream.close()
    return rec


def _tensorizer_s3() -> dict[str, str]:
    """The link's S3 endpoint and credentials (its environment) as tensorizer's stream
    arguments: its own reader and vLLM's tensorizer loader take the same three."""
    return {
        "s3_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "s3_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        "s3_endpoint": os.environ["AWS_ENDPOINT_URL"],
    }


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def child_vllm(contender: str, uri: str, config: str | None) -> dict[str, Any]:
    """vllm_bench.py's child: ``create_model``, then ``load_weights`` timed, from ``uri``;
    ``vllm:tensorizer`` builds the model from ``config``, its weights from the tensorizer
    object ``uri`` (vLLM's extra config, flat: vLLM moves the keys into its own)."""
    from benchmarks.vllm_bench import CONTENDERS as VLLM_CONTENDERS
    from benchmarks.vllm_bench import child_get_model, child_load

    if contender.startswith("vllm-model:"):
        rec = child_get_model(uri, contender.removeprefix("vllm-model:"), "cpu")
        rec["seconds"] = rec["get_model_s"]
        rec["peak_growth"] = rec["peak_rss_growth"]
        rec["checksum"] = rec["model_checksum"]
        rec["bytes"] = 0  # the load's bytes are vllm:asyncslab's; no GB/s of a get_model
        return rec
    name = contender.removeprefix("vllm:")
    if name == "tensorizer":
        assert config is not None, "vllm:tensorizer needs the model's --config directory"
        VLLM_CONTENDERS[name] = {
            "load_format": "tensorizer",
            "extra": {
                "tensorizer_uri": uri,
                **_tensorizer_s3(),
                "stream_kwargs": {"force_http": True},
            },
        }
        uri = config
    rec = child_load(uri, name, "cpu")
    rec["seconds"] = rec["load_weights_s"]
    rec["peak_growth"] = rec["peak_rss_growth"]
    rec["bytes"] = rec["param_bytes"]
    return rec


# --------------------------------------------------------------------------- the summary


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (link, model, contender): medians and ranges over the rounds."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for run in runs:
        key = (run["link"], run["model"], run["contender"])
        row = rows.setdefault(key, {"link": key[0], "model": key[1], "contender": key[2]})
        row.setdefault("records", []).append(run["result"])
    out = []
    for row in rows.values():
        records = row.pop("records")
        good = [r for r in records if "seconds" in r and "error" not in r]
        if not good:
            first = records[0]
            row["status"] = first.get("unavailable") or f"failed: {first.get('error', '?')}"
            out.append(row)
            continue
        times = [r["seconds"] for r in good]
        row.update(
            status="ok",
            rounds=len(good),
            failed=len(records) - len(good),
            median_s=statistics.median(times),
            min_s=min(times),
            max_s=max(times),
            bytes=good[0]["bytes"],
            peak_growth=_median([r["peak_growth"] for r in good]),
            open_plan_s=_median([r["plan_s"] for r in good if r.get("plan_s") is not None]),
            checksums=sorted({r["checksum"] for r in good if "checksum" in r}),
        )
        out.append(row)
    return out


def _times(runs: list[dict[str, Any]], link: str, model: str) -> dict[tuple[int, str], float]:
    """Seconds of each (round, contender) that loaded ``model`` over ``link``."""
    return {
        (run["round"], run["contender"]): run["result"]["seconds"]
        for run in runs
        if run["link"] == link
        and run["model"] == model
        and "seconds" in run["result"]
        and "error" not in run["result"]
    }


def _paired(
    runs: list[dict[str, Any]], link: str, model: str, num: str, den: str | Sequence[str]
) -> float | None:
    """The median over rounds of ``num``'s time over ``den``'s in the same round. Of several
    ``den``, the one with the lowest median time is the reference: taking the faster of them
    anew in each round would compare one time against the minimum of several equally noisy
    ones, a reference biased low by the noise alone (:func:`_paired_min` does, for
    comparison)."""
    by = _times(runs, link, model)
    names = [den] if isinstance(den, str) else list(den)
    medians = {d: _median([t for (_, c), t in by.items() if c == d]) for d in names}
    ran = [d for d in names if medians[d] is not None]
    if not ran:
        return None
    fastest = min(ran, key=lambda d: medians[d] or 0.0)
    rounds = sorted({r for r, _ in by})
    return _median(
        [by[(r, num)] / by[(r, fastest)] for r in rounds if (r, num) in by and (r, fastest) in by]
    )


def _paired_min(
    runs: list[dict[str, Any]], link: str, model: str, num: str, den: Sequence[str]
) -> float | None:
    """As :func:`_paired`, against the fastest of ``den`` in each round: printed beside it,
    as earlier runs in ``benchmarks/runs/`` were judged."""
    by = _times(runs, link, model)
    ratios = []
    for r in sorted({r for r, _ in by}):
        best = [by[(r, d)] for d in den if (r, d) in by]
        if best and (r, num) in by:
            ratios.append(by[(r, num)] / min(best))
    return _median(ratios)


def table(rows: list[dict[str, Any]], link: str) -> list[str]:
    lines = [
        "| model | contender | load s (range) | GB/s | peak RSS growth | asyncslab open+plan |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row["link"] != link:
            continue
        if row["status"] != "ok":
            lines.append(f"| {row['model']} | {row['contender']} | {row['status']} | | | |")
            continue
        # The worker opens and plans for every contender (the peer's slots too); only
        # asyncslab's clock leaves that out.
        shown = row["contender"].startswith("asyncslab") and row["open_plan_s"] is not None
        plan = f"{row['open_plan_s']:.2f} s" if shown else ""
        failed = f", {row['failed']} failed" if row["failed"] else ""
        lines.append(
            f"| {row['model']} | {row['contender']} | {row['median_s']:.2f} s "
            f"({row['min_s']:.2f}-{row['max_s']:.2f}{failed}) "
            f"| {row['bytes'] / row['median_s'] / 1e9:.2f} "
            f"| {row['peak_growth'] / MiB:,.0f} MiB | {plan} |"
        )
    return lines


def targets(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[str]:
    """The targets, judged per link and model: ``PASS``, ``MISS`` or ``n/a``."""
    import asyncslab

    options = asyncslab.LoadOptions()
    budget = options.request_size * options.request_concurrency
    by = {(r["link"], r["model"], r["contender"]): r for r in rows if r["status"] == "ok"}
    lines = ["targets (measured vs goal; never asserted):"]
    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows if r["link"] == link):
            where = f"{link}, {model}"
            ratio = _paired(runs, link, model, "asyncslab", BOUNDS)
            label = f"{where}: asyncslab / the faster raw bound"
            lines.append(_verdict(label, ratio, 1.1, below=True))
            low = _paired_min(runs, link, model, "asyncslab", BOUNDS)
            if low is not None:
                lines.append(
                    f"info  {where}: asyncslab / the faster raw bound of each round: {low:.2f}"
                )
            before = _paired(runs, link, model, "asyncslab", "asyncslab:obstore")
            if before is not None:
                lines.append(f"info  {where}: asyncslab / asyncslab:obstore: {before:.2f}")
            for contender in ("asyncslab", "vllm:asyncslab"):
                row = by.get((link, model, contender))
                if row is None:
                    continue
                goal = row["bytes"] + budget + 64 * MiB
                lines.append(
                    _verdict(
                        f"{where}: {contender} peak RSS growth, MiB",
                        row["peak_growth"] / MiB,
                        goal / MiB,
                        below=True,
                    )
                )
            if (link, model, "tensorizer") in by:
                ratio = _paired(runs, link, model, "asyncslab", "tensorizer")
                lines.append(_verdict(f"{where}: asyncslab / tensorizer", ratio, 1.0, below=True))
            ran_vllm = any(c.startswith("vllm:") and (link, model, c) in by for c in VLLM)
            if model == "mixtral" and ran_vllm:
                speedup = _paired(runs, link, model, "vllm:runai_streamer", "vllm:asyncslab")
                lines.append(
                    _verdict(f"{where}: vLLM runai_streamer / asyncslab", speedup, 3.0, below=False)
                )
                if (link, model, "vllm:tensorizer") in by:
                    ratio = _paired(runs, link, model, "vllm:tensorizer", "vllm:asyncslab")
                    shown = "not measured" if ratio is None else f"{ratio:.2f}"
                    lines.append(f"info  {where}: vLLM tensorizer / asyncslab: {shown}")
                sums = {
                    c: by[(link, model, c)]["checksums"] for c in VLLM if (link, model, c) in by
                }
                if len(sums) > 1:
                    same = len({tuple(v) for v in sums.values()}) == 1
                    lines.append(
                        f"info  {where}: vLLM parameter checksums {'equal' if same else sums}"
                    )
            if all((link, model, c) in by for c in VLLM_MODEL):
                early, after = VLLM_MODEL
                ratio = _paired(runs, link, model, early, after)
                shown = "not measured" if ratio is None else f"{ratio:.2f}"
                lines.append(f"info  {where}: vLLM get_model, layers as landed / after: {shown}")
                sums = {c: by[(link, model, c)]["checksums"] for c in VLLM_MODEL}
                same = len({tuple(v) for v in sums.values()}) == 1
                lines.append(f"info  {where}: processed checksums {'equal' if same else sums}")
    return lines


def _verdict(label: str, value: float | None, goal: float, *, below: bool) -> str:
    sign = "<=" if below else ">="
    if value is None:
        return f"n/a   {label}: not measured (goal {sign} {goal:,.2f})"
    met = value <= goal if below else value >= goal
    return f"{'PASS' if met else 'MISS'}  {label}: {value:,.2f} (goal {sign} {goal:,.2f})"


# --------------------------------------------------------------------------- main


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from asyncslab._units import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS), help="of: " + ", ".join(MODELS))
    ap.add_argument("--links", default=",".join(LINKS), help="of: " + ", ".join(LINKS))
    ap.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help="of: " + ", ".join(CONTENDERS) + " (default: all but the vllm-model ones)",
    )
    ap.add_argument("--exl3-size", type=parse_size, default=3 << 30)
    ap.add_argument("--latency-ms", type=float, default=20.0, help="the remote link's, per request")
    ap.add_argument(
        "--link-mbps", type=float, default=100.0, help="the remote link's MB/s per connection"
    )
    ap.add_argument(
        "--link-emulation",
        choices=EMULATIONS,
        default="splice",
        help="the remote link's: a kernel relay (splice) or the tests' fault proxy",
    )
    ap.add_argument("--quick", action="store_true", help="small models: a smoke test")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "asyncslab-s3-bench"))
    ap.add_argument("--json", type=Path, help="every run (written after each) and the summary")
    ap.add_argument("--report", type=Path, help="print the tables of a --json file, run nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, universe in (("models", MODELS), ("links", LINKS), ("contenders", CONTENDERS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        unknown = set(chosen) - set(universe)
        if unknown:
            ap.error(f"--{name}: unknown {', '.join(sorted(unknown))}")
        setattr(args, name, chosen)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        if args.child in BOUNDS:
            rec = child_raw(args.uri, threads=args.child == "raw-bound-threads")
        elif args.child == "tensorizer":
            rec = child_tensorizer(args.uri)
        else:
            rec = child_vllm(args.child, args.uri, args.config)
        print(RESULT + json.dumps(rec), flush=True)
        if args.child == "raw-bound":
            # obstore's async client leaves runtime threads that can abort the interpreter's
            # finalization (SIGABRT after the result is printed); the result is flushed and
            # nothing else is left to tear down.
            sys.stderr.flush()
            os._exit(0)
        return 0
    if args.report:
        saved = json.loads(args.report.read_text())
        args.latency_ms = saved.get("latency_ms", args.latency_ms)  # the link it ran through
        args.link_mbps = saved.get("link_mbps", args.link_mbps)
        args.link_emulation = saved.get("link_emulation", "proxy")  # the only one before
        report(saved["runs"], args)
        return 0
    # A stop by SIGTERM unwinds as an exit does: the server and its directory go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(args.workdir)
    models = write_models(workdir, args.models, args.quick, args.exl3_size)
    sizes = {name: payload_bytes(path) for name, path in models.items()}
    runs: list[dict[str, Any]] = []
    link_settings = {
        "latency_ms": args.latency_ms,
        "link_mbps": args.link_mbps,
        "link_emulation": args.link_emulation,
    }
    readers = {"tensorizer", "vllm:tensorizer"}
    wanted = bool(readers & set(args.contenders)) and missing("tensorizer") is None
    tensorizer = workdir if wanted else None
    with serving(
        models,
        args.links,
        args.latency_ms / 1e3,
        args.link_mbps * 1e6,
        tensorizer,
        args.link_emulation,
    ) as links:
        jobs = [
            (link, model, contender)
            for link in links
            for model in models
            for contender in args.contenders
            if _runs(link, model, contender)
        ]
        print(
            f"s3_bench: {', '.join(f'{m} {sizes[m] / 1e9:.3f} GB' for m in models)}; links "
            f"{', '.join(links)} (remote: +{args.latency_ms:g} ms a request, "
            f"{args.link_mbps:g} MB/s a connection, {args.link_emulation}); {args.rounds} rounds; "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        # One unmeasured load of each (link, model) first: in two runs the first load after
        # the upload (asyncslab's, both times) took 1.5-2.4x that contender's median.
        for link, model in dict.fromkeys((link, model) for link, model, _ in jobs):
            uri = f"{links[link].scheme}://{BUCKET}/{model}"
            warm = child("raw-bound", uri, links[link])
            print(f"  warm-up {link} {model}: {warm.get('error') or 'done'}", flush=True)
        for r in range(args.rounds):
            for link, model, contender in jobs if r % 2 == 0 else jobs[::-1]:
                why = missing(contender, link)
                uri = f"{links[link].scheme}://{BUCKET}/{model}"
                config = models[model] if contender == "vllm:tensorizer" else None
                if contender.endswith("tensorizer"):
                    uri = f"s3://{BUCKET}/tensorizer/{model}.tensors"
                result = {"unavailable": why} if why else child(contender, uri, links[link], config)
                runs.append(
                    {
                        "round": r,
                        "link": link,
                        "model": model,
                        "contender": contender,
                        "result": result,
                        "load_average": os.getloadavg()[0],  # what the machine was doing
                    }
                )
                if args.json:  # after every load: a run stopped half-way keeps its rounds
                    args.json.write_text(
                        json.dumps({"sizes": sizes, **link_settings, "runs": runs}) + "\n"
                    )
                shown = why or result.get("error") or f"{result['seconds']:.3f} s"
                print(f"  round {r + 1} {link} {model} {contender}: {shown}", flush=True)
    report(runs, args)
    if args.json:
        rows = summarise(runs)
        args.json.write_text(
            json.dumps({"sizes": sizes, **link_settings, "rows": rows, "runs": runs}, indent=1)
            + "\n"
        )
    return 0


def _runs(link: str, model: str, contender: str) -> bool:
    """Whether ``contender`` loads ``model`` over ``link``: vLLM and tensorizer the
    Mixtral-like model, over S3; the emulators the Mixtral-like model, their contenders."""
    if link in EMULATED:
        return model == "mixtral" and contender in EMULATED[link]
    return model == "mixtral" or contender in LIBRARY and contender != "tensorizer"


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The tables and the targets of ``runs``."""
    rows = summarise(runs)
    lines = []
    for link in dict.fromkeys(run["link"] for run in runs):
        extra = {
            "remote": (
                f" (+{args.latency_ms:g} ms, {args.link_mbps:g} MB/s a connection, "
                f"{args.link_emulation})"
            ),
            "gcs": " (fake-gcs-server on 127.0.0.1)",
            "azure": " (Azurite on 127.0.0.1)",
        }.get(link, "")
        lines += ["", f"link {link}{extra}:", "", *table(rows, link)]
    lines += ["", *targets(rows, runs)]
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

"""``--load-format asyncslab`` with a model in object storage (``s3://bucket/prefix``), against
real vLLM (its CPU build) and a real S3 server (SeaweedFS, ``support/s3server.py``), and from
``gs://`` and ``az://`` (fake-gcs-server, Azurite: ``support/object_servers.py``): vLLM gets
the config and tokenizer pulled by asyncslab's client, asyncslab streams the weights from the
bucket straight into vLLM's parameters (every byte and the greedy tokens equal ``auto``'s from
the same model's local files), request options reach the GETs, a missing tensor is refused
naming it, and the OpenAI server serves such a model.

asyncslab wraps two vLLM methods for this (``asyncslab/engines/_vllm_object_store.py``); the
first test fails, and does not skip, when a vLLM upgrade changes what the wrappers rely on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncslab.engines._vllm_object_store import pull_config
from asyncslab.errors import MissingFileError
from support.object_servers import AzuriteServer, GcsServer
from support.ports import free_port
from support.s3server import ACCESS_KEY, SECRET_KEY, FaultProxy, SeaweedServer, upload
from support.vllm_models import write_model
from tests.conftest import ObjectServer
from tests.engines.test_vllm import (
    HERE,
    MISSING,
    _env,
    _log_excerpt,
    _rewrite,
    _stop,
    _wait_healthy,
)
from tests.engines.test_vllm import pytestmark as vllm_marks

pytestmark = vllm_marks

#: Bytes of one ranged GET at most in the llama case: far below a tensor, so each tensor
#: comes in several GETs.
REQUEST_SIZE = 4096
PREFIX = "s3://models/vllm"


@pytest.fixture(scope="module")
def proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    """Between vLLM and the server: it counts and shows every request (no faults)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy


def _s3_env(endpoint: str, cache: Path) -> dict[str, str]:
    """The standard AWS variables, as a deployment sets them; vLLM's cache in ``cache``."""
    return _env(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_REGION="us-east-1",
        VLLM_ASSETS_CACHE=str(cache),
    )


@pytest.fixture(scope="module")
def models(s3_server: SeaweedServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local models, each uploaded under ``PREFIX/<name>``."""
    root = tmp_path_factory.mktemp("vllm-s3-models")
    local = {
        "llama": write_model(root / "llama", "llama", shards=2),
        "mixtral": write_model(root / "mixtral", "mixtral", shards=3),
    }
    one = write_model(root / "llama-one-shard", "llama")
    local["missing"] = _rewrite(one, root / "missing", lambda t: t.pop(MISSING))
    local["no-config"] = root / "no-config"
    local["no-config"].mkdir()
    shutil.copy(one / "model.safetensors", local["no-config"])
    local["tokenizer"] = root / "tokenizer"
    local["tokenizer"].mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(one / name, local["tokenizer"])
    store = s3_server.store()
    for name, path in local.items():
        upload(store, f"vllm/{name}", path)
    return local


@pytest.fixture(scope="module")
def results(
    models: dict[str, Path], proxy: FaultProxy, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-s3-run")
    extra = {"request_size": REQUEST_SIZE, "request_concurrency": 3, "request_retries": 1}
    cases = {
        "guard": {"local": str(models["llama"]), "uri": f"{PREFIX}/llama",
                  "tokenizer": f"{PREFIX}/tokenizer"},
        "generate": [
            {"name": "llama", "local": str(models["llama"]), "uri": f"{PREFIX}/llama",
             "extra": extra},
            {"name": "mixtral", "local": str(models["mixtral"]), "uri": f"{PREFIX}/mixtral"},
        ],
        "refused": [
            {"name": "missing", "uri": f"{PREFIX}/missing"},
            {"name": "no-config", "uri": f"{PREFIX}/no-config"},
        ],
    }  # fmt: skip
    (tmp / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run(
        [
            sys.executable, str(HERE / "vllm_object_store_worker.py"), str(tmp / "cases.json"),
            str(tmp / "out.json"),
        ],
        env=_s3_env(proxy.endpoint, tmp / "cache"), capture_output=True, text=True, timeout=800,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    result: dict[str, Any] = json.loads((tmp / "out.json").read_text())
    return result


def test_vllm_still_needs_the_two_wrappers_and_takes_them(results: dict[str, Any]) -> None:
    """What asyncslab relies on in vLLM: ``EngineArgs.create_model_config`` and
    ``VllmConfig.try_verify_and_update_config`` exist and the plugin wrapped them; without
    the second wrapper vLLM refuses the format for object-storage weights (when it stops
    refusing, drop the wrapper: vllm#32807); with both, an ``s3://`` model gets vLLM's
    config of a pulled model: ``model`` a local directory of its config and tokenizer,
    ``model_weights`` the URI, the format kept as asked."""
    guard = results["guard"]
    assert guard["wrapped"] == {
        "EngineArgs.create_model_config": True,
        "VllmConfig.try_verify_and_update_config": True,
    }
    refusal = guard["unwrapped"]
    assert refusal["error"] is not None, (
        "vLLM no longer refuses load format 'asyncslab' for object-storage weights: drop "
        "_vllm_object_store._verifying"
    )
    assert "ValueError" in refusal["bases"], refusal  # pydantic's ValidationError, raised there
    assert "object storage" in refusal["message"]
    assert "but got 'asyncslab'" in refusal["message"]
    config = guard["wrapped_config"]
    assert config["model_weights"] == f"{PREFIX}/llama"
    assert config["load_format"] == "asyncslab"
    assert config["tokenizer"] == config["model"]
    assert Path(config["model"]).is_dir()
    assert config["served_model_name"] == f"{PREFIX}/llama"
    assert config["architecture"] == "LlamaForCausalLM"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(config["pulled"])
    assert not any(n.endswith(".safetensors") for n in config["pulled"])
    # The same objects: the same directory, pulled once (the llama engine below used it).
    assert results["generate"]["llama"]["config"]["model"] == config["model"]
    apart = guard["tokenizer_apart"]
    assert apart["model"] == config["model"]
    assert apart["tokenizer"] != config["model"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(apart["pulled"])
    assert "config.json" not in apart["pulled"]


def _as_auto(case: dict[str, Any]) -> None:
    """Every parameter byte as served, the parameters vLLM's processing replaced (the rest
    stay at vLLM's addresses) and the greedy tokens as ``auto`` gives them from the local
    files."""
    assert case["same_names"]
    assert case["parameters"] > 10
    assert case["differ"] == []
    assert case["replaced"]["asyncslab"] == case["replaced"]["auto"]
    assert case["tokens"]["asyncslab"] == case["tokens"]["auto"]
    assert all(len(t) == 8 for t in case["tokens"]["auto"])


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_an_s3_model_loads_every_byte_and_generates_as_auto_from_local_files(
    results: dict[str, Any], models: dict[str, Path], name: str
) -> None:
    case = results["generate"][name]
    _as_auto(case)
    report = case["report"]
    assert report["files"] == len(list(models[name].glob("*.safetensors")))
    assert report["transformed"] == []
    assert report["skipped"] == []
    config = case["config"]
    assert config["model_weights"] == f"{PREFIX}/{name}"
    assert config["served_model_name"] == f"{PREFIX}/{name}"
    # Nothing of the weights was pulled: they came from the bucket.
    assert "config.json" in config["pulled"]
    assert not any(n.endswith(".safetensors") for n in config["pulled"])


def test_request_options_from_the_extra_config_reach_the_gets(
    results: dict[str, Any], proxy: FaultProxy, models: dict[str, Path]
) -> None:
    """``request_size`` from ``--model-loader-extra-config``: every payload GET of the
    llama shards asks for at most that many bytes, pinned to the object's ETag."""
    assert results["generate"]["llama"]["differ"] == []
    payload = proxy.matching(
        lambda r: (
            r.method == "GET"
            and r.path.startswith("/models/vllm/llama/")
            and r.path.endswith(".safetensors")
            and r.range is not None
            and r.range[0] > 0
        )  # a header read starts at 0; the payload after the header
    )
    sizes = [r.range[1] - r.range[0] + 1 for r in payload if r.range is not None]
    total = sum(f.stat().st_size for f in models["llama"].glob("*.safetensors"))
    assert max(sizes) <= REQUEST_SIZE
    assert len(payload) >= total // REQUEST_SIZE // 2, len(payload)
    assert all("if-match" in r.headers for r in payload)


def test_a_tensor_missing_from_the_bucket_is_refused_naming_it(results: dict[str, Any]) -> None:
    case = results["refused"]["missing"]
    assert case["error"] == "CoverageError", case
    assert "AsyncSlabError" in case["bases"]
    assert case["tensor"] == MISSING
    assert "'model.layers.1.self_attn.qkv_proj.weight'" in case["message"]


def test_a_prefix_without_a_config_is_refused_naming_it(results: dict[str, Any]) -> None:
    case = results["refused"]["no-config"]
    assert case["error"] == "MissingFileError", case
    assert "AsyncSlabError" in case["bases"]
    assert f"no config.json under {PREFIX}/no-config" in case["message"]


def test_the_openai_server_serves_an_s3_model(
    models: dict[str, Path], results: dict[str, Any], s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """``vllm serve s3://... --load-format asyncslab`` (as ``python -m
    vllm.entrypoints.openai.api_server``): served under the URI, loaded by asyncslab, and
    its greedy completion is the one ``auto`` gives from the local files."""
    uri = f"{PREFIX}/mixtral"
    port, log = free_port(), tmp_path / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", uri,
        "--load-format", "asyncslab", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager",
        "--model-loader-extra-config", json.dumps({"request_concurrency": 4}),
    ]  # fmt: skip
    with log.open("wb") as out:
        env = _s3_env(s3_server.endpoint, tmp_path / "cache")
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server, port, log)
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in listed["data"]] == [uri]
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": uri, "prompt": "w1 w2 w3 w4", "max_tokens": 8, "temperature": 0,
                  "return_token_ids": True},
            timeout=120,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text + "\n" + _log_excerpt(log)
        choice = reply.json()["choices"][0]
        # PROMPTS[0] of the workers: auto's greedy tokens from the local files.
        assert choice["token_ids"] == results["generate"]["mixtral"]["tokens"]["auto"][0]
    finally:
        _stop(server)
    text = log.read_text()
    assert "asyncslab loaded" in text
    assert f"({len(list(models['mixtral'].glob('*.safetensors')))} files)" in text


def test_a_pull_with_bad_credentials_is_refused_without_showing_them(
    models: dict[str, Path], s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull of config and tokenizer fails as ``Checkpoint.open`` does: a
    ``MissingFileError`` naming the prefix, no secret in it, the client's error not chained
    (in this process: the pull imports vLLM only once the listing succeeded)."""
    for name, value in _s3_env(s3_server.endpoint, Path("unused")).items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    with pytest.raises(MissingFileError, match="access denied") as caught:
        pull_config(f"{PREFIX}/llama")
    assert f"{PREFIX}/llama" in str(caught.value)
    assert "not-the-secret" not in str(caught.value)
    assert caught.value.__cause__ is None


def _store_env(server: GcsServer | AzuriteServer, cache: Path) -> dict[str, str]:
    """Each cloud's own variables, as a deployment against its emulator sets them."""
    if isinstance(server, GcsServer):
        return _env(STORAGE_EMULATOR_HOST=server.endpoint, VLLM_ASSETS_CACHE=str(cache))
    return _env(
        AZURE_STORAGE_CONNECTION_STRING=server.connection_string(), VLLM_ASSETS_CACHE=str(cache)
    )


@pytest.mark.parametrize("object_server", ["gs", "az"], indirect=True)
def test_a_gcs_or_azure_model_loads_every_byte_and_generates_as_auto_from_local_files(
    object_server: ObjectServer, tmp_path: Path
) -> None:
    """``LLM(model="gs://..." | "az://...", load_format="asyncslab")``: config and tokenizer
    pulled with the cloud's settings, every parameter byte and the greedy tokens equal
    ``auto``'s from the same local files."""
    assert not isinstance(object_server, SeaweedServer)
    local = write_model(tmp_path / "llama", "llama", shards=2)
    for path in sorted(local.iterdir()):
        object_server.put(f"vllm-{object_server.scheme}/llama/{path.name}", path.read_bytes())
    uri = f"{object_server.scheme}://models/vllm-{object_server.scheme}/llama"
    extra = {"request_size": REQUEST_SIZE, "request_concurrency": 3}
    cases = {"generate": [{"name": "llama", "local": str(local), "uri": uri, "extra": extra}]}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run(
        [
            sys.executable, str(HERE / "vllm_object_store_worker.py"),
            str(tmp_path / "cases.json"), str(tmp_path / "out.json"),
        ],
        env=_store_env(object_server, tmp_path / "cache"), capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    case = json.loads((tmp_path / "out.json").read_text())["generate"]["llama"]
    _as_auto(case)
    assert case["report"]["files"] == len(list(local.glob("*.safetensors")))
    assert case["config"]["model_weights"] == uri
    assert "config.json" in case["config"]["pulled"]
    assert not any(n.endswith(".safetensors") for n in case["config"]["pulled"])

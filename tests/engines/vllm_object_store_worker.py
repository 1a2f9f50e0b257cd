"""Runs vLLM for ``tests/engines/test_vllm_object_store.py``, in a process of its own (as
``vllm_worker.py``, whose helpers it uses), against the store the environment names
(``AWS_ENDPOINT_URL``, keys, region; ``STORAGE_EMULATOR_HOST``;
``AZURE_STORAGE_CONNECTION_STRING``).

``python tests/engines/vllm_object_store_worker.py CASES.json OUT.json``, CASES holding
any of:

- ``guard``: a local model directory and the URI of the same model. Recorded: whether
  asyncslab's plugin wrapped vLLM's two methods, the error vLLM's own config check raises
  for the format and an object-storage ``model_weights`` without the wrapper, and the
  config vLLM builds for the URI with it, and with a tokenizer URI of its own.
- ``generate``: per case, ``LLM(local, load_format="auto")`` and ``LLM(uri,
  load_format="asyncslab", model_loader_extra_config=extra)``: greedy tokens, every
  parameter's bytes and address around the loaders (``vllm_worker._watching``), and the
  model config the URI gave.
- ``refused``: per case, ``LLM(uri, load_format="asyncslab")`` expected to fail: the error.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the loaders run in this process

from vllm_worker import _compare, _error, _greedy, _watching  # noqa: E402


def guard(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # asyncslab's register(), as in every vLLM process
    mark = "__asyncslab_object_store__"
    verify = VllmConfig.try_verify_and_update_config
    record: dict[str, Any] = {
        "wrapped": {
            "EngineArgs.create_model_config": getattr(EngineArgs.create_model_config, mark, 0),
            "VllmConfig.try_verify_and_update_config": getattr(verify, mark, False),
        }
    }
    common = {"load_format": "asyncslab", "max_model_len": 128, "enforce_eager": True}
    # vLLM's own check, the wrapper out of the way: an already pulled model (local config,
    # object-storage weights), as vLLM records one.
    VllmConfig.try_verify_and_update_config = verify.__wrapped__  # type: ignore[attr-defined,method-assign]
    try:
        EngineArgs(model=case["local"], model_weights=case["uri"], **common).create_engine_config()
        record["unwrapped"] = {"error": None}
    except Exception as err:  # recorded for the test to judge
        record["unwrapped"] = _error(err)
    finally:
        VllmConfig.try_verify_and_update_config = verify  # type: ignore[method-assign]
    config = EngineArgs(model=case["uri"], **common).create_engine_config()
    model = config.model_config
    record["wrapped_config"] = {
        "model": model.model,
        "model_weights": model.model_weights,
        "tokenizer": model.tokenizer,
        "served_model_name": model.served_model_name,
        "load_format": config.load_config.load_format,
        "architecture": model.architecture,
        "pulled": sorted(p.name for p in Path(model.model).iterdir()),
    }
    # A tokenizer of its own in the bucket (a prefix with no config): pulled on its own.
    apart = EngineArgs(model=case["uri"], tokenizer=case["tokenizer"], **common)
    model = apart.create_engine_config().model_config
    record["tokenizer_apart"] = {
        "model": model.model,
        "tokenizer": model.tokenizer,
        "pulled": sorted(p.name for p in Path(model.tokenizer).iterdir()),
    }
    return record


def generate(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        record: dict[str, Any] = {"tokens": {}}
        snapshots: dict[str, Any] = {}
        with _watching(record, snapshots, served=True):
            llm, record["tokens"]["auto"] = _greedy(
                {"model": case["local"]}, "auto", distributed_executor_backend="uni"
            )
        del llm
        gc.collect()
        with _watching(record, snapshots, served=True):
            llm, record["tokens"]["asyncslab"] = _greedy(
                {"model": case["uri"]},
                "asyncslab",
                distributed_executor_backend="uni",
                model_loader_extra_config=case.get("extra", {}),
            )
        model = llm.llm_engine.vllm_config.model_config
        record["config"] = {
            "model": model.model,
            "model_weights": model.model_weights,
            "served_model_name": model.served_model_name,
            "pulled": sorted(p.name for p in Path(model.model).iterdir()),
        }
        del llm
        gc.collect()
        record.update(_compare(snapshots))
        out[case["name"]] = record
    return out


def refused(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        try:
            llm, _ = _greedy(
                {"model": case["uri"]}, "asyncslab", distributed_executor_backend="uni"
            )
            del llm
            out[case["name"]] = {"error": None}
        except Exception as err:  # recorded for the test to judge
            out[case["name"]] = _error(err)
        gc.collect()
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    runs = {"guard": guard, "generate": generate, "refused": refused}
    result = {name: run(cases[name]) for name, run in runs.items() if name in cases}
    Path(sys.argv[2]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

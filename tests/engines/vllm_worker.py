"""Runs vLLM for ``tests/engines/test_vllm.py``, in a process of its own (vLLM sets up torch, its
distributed state and logging process-wide; the test process stays as it was).

``python tests/engines/vllm_worker.py loads CASES.json OUT.json``: per case, a model created the way
vLLM creates it and loaded with the case's load format, in this process; recorded: every
parameter's bytes compared with ``auto``'s (before ``process_weights_after_loading``, which
repacks on the CPU), whether every parameter kept its address, each parameter's dtype, how
many passes the garbage collector made inside asyncslab's load, the loader's report, or the
error raised (type, message, the error's ``tensor``).

``python tests/engines/vllm_worker.py generate CASES.json OUT.json``: per case, ``LLM(...)`` with
each load format in turn (in this process: ``distributed_executor_backend="uni"``), the
greedy tokens of a few prompts, every parameter's bytes as served (after vLLM's processing)
and the parameters processing replaced, and the loader's report.

``python tests/engines/vllm_worker.py reload CASES.json OUT.json``: per case, ``LLM(...)``
loaded with the case's format (default ``asyncslab``), then vLLM's in-place
``reload_weights`` from another checkpoint of the same architecture (``weights_path``): the
greedy tokens before and after, a digest of every parameter after, asyncslab's report of the
reload, and (``fresh``) ``auto``'s tokens and digests on a fresh engine of that checkpoint.

``python tests/engines/vllm_worker.py tp CASES.json OUT.json``: per case, tensor parallelism
over two ranks (vLLM's worker processes) with each format: greedy tokens, and each rank's
report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from support.vllm_kernels import select_kernels_without_running_them  # noqa: E402

PROMPTS = ["w1 w2 w3 w4", "w9 w8", "w100 w5 w7"]


def _bytes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()
    }


def _error(err: BaseException) -> dict[str, Any]:
    return {
        "error": type(err).__name__,
        "bases": [c.__name__ for c in type(err).__mro__],
        "message": str(err),
        "tensor": getattr(err, "tensor", None),
        "cause": None if err.__cause__ is None else repr(err.__cause__),
    }


@contextlib.contextmanager
def _watching(
    record: dict[str, Any],
    snapshots: dict[str, dict[str, torch.Tensor]],
    *,
    served: bool = False,
    label: str | None = None,
) -> Iterator[None]:
    """Wrap both loaders' ``load_weights``: addresses before and after, bytes after. With
    ``served`` (an engine's whole ``load_model``), bytes as served, after vLLM's processing
    (asyncslab may process layers inside ``load_weights`` as they land), and the parameters
    processing replaced (``replaced``) instead of whether ``load_weights`` kept every one.
    Recorded under the load format's name, or ``label``; reports also in ``reports``."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from asyncslab.engines._vllm import AsyncSlabLoader

    befores: dict[str, dict[str, int]] = {}
    # Served, each parameter's storage as load_weights found it, held until load_model
    # returns: a storage processing replaces is then not freed, so that the new one cannot
    # take its address and look like the same memory.
    held: dict[str, list[Any]] = {}
    originals: list[tuple[type, Callable[..., Any]]] = []
    for cls in (DefaultModelLoader, AsyncSlabLoader):
        original = cls.load_weights

        def wrapped(self: Any, model: Any, model_config: Any, _orig: Any = original) -> None:
            fmt = label or self.load_config.load_format
            before = befores[fmt] = {n: p.data_ptr() for n, p in model.named_parameters()}
            if served:
                held[fmt] = [p.untyped_storage() for p in model.parameters()]
            _orig(self, model, model_config)
            after = {n: p.data_ptr() for n, p in model.named_parameters()}
            if not served:
                record.setdefault("pointers_kept", {})[fmt] = before == after
                snapshots[fmt] = _bytes(model)
            record["dtypes"] = {
                n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()
            }
            report = getattr(self, "report", None)
            if report is not None:
                record["report"] = dataclasses.asdict(report)
                record.setdefault("reports", {})[fmt] = record["report"]

        originals.append((cls, original))
        cls.load_weights = wrapped  # type: ignore[method-assign]
    # The collector's passes inside asyncslab's load (the one that re-enabling it may set
    # off as load_weights returns is vLLM's to pay, like its gc.collect() after).
    inner = AsyncSlabLoader._load_weights

    def counted(self: Any, model: Any, model_config: Any) -> None:
        passes: list[int] = []

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                passes.append(info["generation"])

        gc.callbacks.append(count)
        try:
            inner(self, model, model_config)
        finally:
            gc.callbacks.remove(count)
            record["gc_passes"] = len(passes)

    AsyncSlabLoader._load_weights = counted  # type: ignore[method-assign]
    # Inside each loader's whole load_model (an engine's, not a bare load_weights): how
    # many objects the heap had frozen at each full collection, and after.
    whole = [(cls, cls.__dict__.get("load_model")) for cls in (DefaultModelLoader, AsyncSlabLoader)]
    for cls, _ in whole:
        load_model = cls.load_model

        def watched(self: Any, *args: Any, _orig: Any = load_model, **kwargs: Any) -> Any:
            frozen: list[int] = []

            def full(phase: str, info: dict[str, int]) -> None:
                if phase == "start" and info["generation"] == 2:
                    frozen.append(gc.get_freeze_count())

            before = gc.get_freeze_count()
            gc.callbacks.append(full)
            fmt = label or self.load_config.load_format
            try:
                model = _orig(self, *args, **kwargs)
            finally:
                gc.callbacks.remove(full)
                record.setdefault("collections", {})[fmt] = {
                    "frozen_before": before,
                    "frozen_during": frozen,
                    "frozen_after": gc.get_freeze_count(),
                }
            if served:
                snapshots[fmt] = _bytes(model)
                record.setdefault("replaced", {})[fmt] = sorted(
                    n for n, p in model.named_parameters() if befores[fmt].get(n) != p.data_ptr()
                )
                del held[fmt]
            return model

        cls.load_model = watched  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, own in whole:
            if own is None:  # inherited: the base class's again
                del cls.load_model
            else:
                cls.load_model = own  # type: ignore[method-assign]
        AsyncSlabLoader._load_weights = inner  # type: ignore[method-assign]
        for cls, original in originals:
            cls.load_weights = original  # type: ignore[method-assign]


def _compare(snapshots: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    auto, ours = snapshots.get("auto"), snapshots.get("asyncslab")
    if auto is None or ours is None:
        return {}
    differ = sorted(n for n in auto if n not in ours or not torch.equal(auto[n], ours[n]))
    return {"parameters": len(auto), "differ": differ, "same_names": set(auto) == set(ours)}


def loads(cases: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    import asyncslab.vllm  # noqa: F401 - registers the format, as the plugin does

    if any(case.get("select_kernels") for case in cases):
        select_kernels_without_running_them()
    # vLLM's parallel groups, once, from the first case: an MoE model's, so that the
    # expert-parallel group exists for the MoE cases too.
    first = EngineArgs(model=cases[0]["model"], max_model_len=128, enforce_eager=True)
    with set_current_vllm_config(first.create_engine_config()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    out: dict[str, Any] = {}
    for case in cases:
        record: dict[str, Any] = {}
        snapshots: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for fmt in case.get("formats", ["auto", "asyncslab"]):
                args = EngineArgs(
                    model=case["model"],
                    load_format=fmt,
                    dtype=case.get("dtype", "bfloat16"),
                    max_model_len=128,
                    enforce_eager=True,
                    model_loader_extra_config=case.get("extra", {}) if fmt != "auto" else {},
                )
                config = args.create_engine_config()
                with set_current_vllm_config(config), _watching(record, snapshots):
                    loader = get_model_loader(config.load_config)
                    with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
                        model = loader.create_model(
                            vllm_config=config, model_config=config.model_config
                        )
                    if case.get("change_before_read"):
                        _change_before_read(Path(case["change_before_read"]))
                    loader.load_weights(model, config.model_config)
                del model
                gc.collect()
        except Exception as err:  # recorded for the test to judge
            record.update(_error(err))
        record.update(_compare(snapshots))
        out[case["name"]] = record
    return out


def _change_before_read(path: Path) -> None:
    """Replace ``path`` (same size, other bytes) once the plan is made, before any read."""
    import asyncslab.engines._engine_load as glue

    real = glue.SlabSet

    class Changing(real):  # type: ignore[misc, valid-type]
        async def load(self, *args: Any, **kwargs: Any) -> Any:
            # Blocking on purpose: the file is changed before the load's first read.
            data = bytearray(path.read_bytes())  # noqa: ASYNC240
            data[-1] ^= 0xFF
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(bytes(data))
            os.replace(tmp, path)
            glue.SlabSet = real  # once
            return await super().load(*args, **kwargs)

    glue.SlabSet = Changing  # type: ignore[misc]


def generate(cases: list[dict[str, Any]]) -> dict[str, Any]:
    # The engine core in this process (and, with the "uni" executor, the worker): the
    # loaders' load_weights wrapped here are the ones that run.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import asyncslab.vllm  # noqa: F401

    if any(case.get("select_kernels") for case in cases):
        select_kernels_without_running_them()
    out: dict[str, Any] = {}
    for case in cases:
        missing = _missing_kernels(case.get("kernels", []))
        if missing:
            out[case["name"]] = {"missing_kernels": missing}
            continue
        record: dict[str, Any] = {"tokens": {}}
        snapshots: dict[str, dict[str, torch.Tensor]] = {}
        # "landed": asyncslab again, each layer processed as it lands.
        for label in ("auto", "asyncslab", *(["landed"] if case.get("landed") else [])):
            fmt, run = label, case
            if label == "landed":
                fmt = "asyncslab"
                run = {**case, "extra": {**case.get("extra", {}), "process_as_loaded": True}}
            with _watching(record, snapshots, served=True, label=label):
                llm, record["tokens"][label] = _greedy(run, fmt, distributed_executor_backend="uni")
            del llm
            gc.collect()
        record.update(_compare(snapshots))
        if "landed" in snapshots:
            landed = _compare({"auto": snapshots["auto"], "asyncslab": snapshots["landed"]})
            record["landed"] = landed
        out[case["name"]] = record
    return out


def _missing_kernels(kernels: list[str]) -> list[str]:
    """Those of ``kernels`` this machine's vLLM CPU build lacks: it loads the extension built
    for the CPU's instruction set, and the AVX2 one has no WNA16 (AWQ, GPTQ) GEMM."""
    import vllm._custom_ops  # noqa: F401 - loads the build's ``_C`` operators

    return [k for k in kernels if not hasattr(torch.ops._C, k)]


def _greedy(case: dict[str, Any], fmt: str, **engine: Any) -> tuple[Any, list[list[int]]]:
    """An engine for ``case`` loaded with ``fmt``, and its greedy tokens for ``PROMPTS``."""
    from vllm import LLM, SamplingParams

    if fmt == "asyncslab" and case.get("extra"):
        engine.setdefault("model_loader_extra_config", case["extra"])
    llm = LLM(
        model=case["model"],
        load_format=fmt,
        dtype=case.get("dtype", "bfloat16"),
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        **engine,
    )
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return llm, [list(r.outputs[0].token_ids) for r in results]


def _last_report(worker: Any) -> dict[str, Any] | None:
    from asyncslab.engines._vllm import AsyncSlabLoader

    report = AsyncSlabLoader.last_report
    return None if report is None else dataclasses.asdict(report)


def tensor_parallel(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case, ``LLM(tensor_parallel_size=2)`` with each format (vLLM's own worker
    processes, one per rank): greedy tokens, and each rank's asyncslab report."""
    out: dict[str, Any] = {}
    for case in cases:
        record: dict[str, Any] = {"tokens": {}}
        for fmt in ("auto", "asyncslab"):
            llm, record["tokens"][fmt] = _greedy(case, fmt, tensor_parallel_size=2)
            if fmt == "asyncslab":
                record["reports"] = llm.collective_rpc(_last_report)
            del llm
            gc.collect()
        out[case["name"]] = record
    return out


def _digests(worker: Any) -> dict[str, str]:
    """Every parameter of the worker's model (as served: processed), by a digest of its
    bytes."""
    import hashlib

    model = worker.model_runner.get_model()
    return {
        n: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, p in model.named_parameters()
    }


def _last_reload(worker: Any) -> dict[str, Any] | None:
    from asyncslab.vllm import AsyncSlabLoader

    report = AsyncSlabLoader.last_reload
    return None if report is None else dataclasses.asdict(report)


def _forget_reload(worker: Any) -> None:
    from asyncslab.vllm import AsyncSlabLoader

    AsyncSlabLoader.last_reload = None  # this case's report, not an earlier one's


def reload(cases: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    import asyncslab.vllm  # noqa: F401

    out: dict[str, Any] = {}
    for case in cases:
        record: dict[str, Any] = {}
        fmt = case.get("format", "asyncslab")
        # Local files placed as objects are: the loader's option, which vLLM's reload passes
        # on to the loader it makes (the same load config).
        extra = (
            {"model_loader_extra_config": {"place_local_files": True}} if case.get("place") else {}
        )
        llm, record["before"] = _greedy(case, fmt, distributed_executor_backend="uni", **extra)
        llm.collective_rpc(_forget_reload)
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": case["other"]})
            results = llm.generate(
                PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
            )
            record["after"] = [list(r.outputs[0].token_ids) for r in results]
            (record["digests"],) = llm.collective_rpc(_digests)
            (record["report"],) = llm.collective_rpc(_last_reload)
        except Exception as err:  # recorded for the test to judge
            record.update(_error(err))
        del llm
        gc.collect()
        if case.get("fresh"):
            other = dict(case, model=case["other"])
            llm, record["fresh"] = _greedy(other, "auto", distributed_executor_backend="uni")
            (record["fresh_digests"],) = llm.collective_rpc(_digests)
            del llm
            gc.collect()
        out[case["name"]] = record
    return out


def layers(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """``_vllm_process.LayerProcessing`` on a toy model of vLLM quantization methods that
    record their processing: which modules it processes as their layer lands, and what
    vLLM's pass then does to each."""
    from torch import nn
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    from asyncslab.engines._vllm_process import LayerProcessing

    calls: list[str] = []

    class Recorded(QuantizeMethodBase):
        def create_weights(self, *args: Any, **kwargs: Any) -> None: ...

        def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise NotImplementedError

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            calls.append(layer.name)

    class KV(BaseKVCacheMethod):
        def process_weights_after_loading(self, layer: nn.Module) -> None:
            calls.append(layer.name)

    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(5))
    shared_method, shared_weight = Recorded(), nn.Parameter(torch.ones(2), False)

    def add(parent: nn.Module, attr: str, name: str, method: Any, weight: Any = None) -> None:
        module = nn.Module()
        module.name, module.quant_method = name, method
        module.weight = weight if weight is not None else nn.Parameter(torch.ones(2), False)
        setattr(parent, attr, module)

    add(model.layers[0], "mlp", "own", Recorded())
    model.layers[0].again = model.layers[0].mlp  # one module under two names: processed once
    add(model.layers[0], "attn", "attention", KV(None))
    add(model.layers[1], "mlp", "method shared", shared_method)
    add(model.layers[2], "mlp", "method shared too", shared_method)
    add(model.layers[3], "mlp", "weight shared", Recorded(), shared_weight)
    add(model.layers[4], "mlp", "weight shared too", Recorded(), shared_weight)
    add(model, "norm", "outside the layers", Recorded())
    processing = LayerProcessing.of(model, None, torch.device("cpu"))
    assert processing is not None
    for unit in ("layers.0", "layers.1", "layers.2", "layers.3", "layers.4"):
        processing(unit)
    early = list(calls)
    calls.clear()
    with processing.skipped_by_vllm():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
    in_vllms_pass = list(calls)
    calls.clear()
    model.layers[0].mlp.quant_method.process_weights_after_loading(model.layers[0].mlp)
    return {"early": early, "in_vllms_pass": in_vllms_pass, "after_the_pass": list(calls)}


def main() -> None:
    what, cases_path, out_path = sys.argv[1:4]
    cases = json.loads(Path(cases_path).read_text())
    modes = {
        "loads": loads,
        "generate": generate,
        "tp": tensor_parallel,
        "reload": reload,
        "layers": layers,
    }
    result = modes[what](cases)
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

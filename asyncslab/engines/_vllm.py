"""vLLM's load format ``asyncslab``: every checkpoint byte read straight into vLLM's own
parameters, where vLLM's own weight loaders would have put it.

vLLM allocates the model; :func:`~asyncslab.engines._engine_load.load_into_engine` runs the
model's ``load_weights`` once on stand-ins to learn where each tensor goes (fused
``qkv_proj`` and ``gate_up_proj`` shards, FusedMoE expert slots, a padded vocabulary, a
tensor-parallel rank's rows), checks that every parameter byte is covered exactly once, and
writes the payload into those parameters in place. Tensors vLLM transforms on the way (a
dtype cast it was asked for) are read by asyncslab and handed to vLLM's loader as they are.
Then vLLM post-processes as usual. This module holds only vLLM's side: the files vLLM would
read, the names it knows them by, the parameters it lets a checkpoint leave out, its
options, log and report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .._heap import gc_paused
from .._units import format_bytes
from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from ..loading import LoadOptions, LoadStatistics
from ._engine_load import Engine, EngineLoad, WeightLoader, host, load_into_engine
from ._vllm_object_store import install, object_weights, open_checkpoint
from ._vllm_process import LayerProcessing
from ._vllm_reload import ReloadReport, reload_tensors, remember

__all__ = [
    "LOAD_FORMAT",
    "AsyncSlabLoader",
    "LoadReport",
    "ReloadReport",
    "options_from_config",
    "register",
]

LOAD_FORMAT = "asyncslab"

# Under vLLM's logger, so that its handler and format apply (vLLM configures "vllm" only).
logger = logging.getLogger("vllm.asyncslab")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts
    (the loader is looked up in the worker, not in the process the user started)."""
    register_model_loader(LOAD_FORMAT)(AsyncSlabLoader)
    # Object-storage models (s3://...): vLLM pulls their config with Run:ai's client and
    # lets only Run:ai's formats read them, unless this format's hooks are in place.
    install(LOAD_FORMAT)


#: Extra-config keys of the loader itself, beside the :class:`LoadOptions` fields.
#: ``place_local_files``: a reload reads a local checkpoint's tensors straight into vLLM's
#: parameters too, as it does from object storage (else it hands vLLM views of the files'
#: mappings, which measured faster; docs/vllm.md, "Reloading in place").
#: ``process_as_loaded``: each layer's weights processed as soon as it has landed, while
#: later layers are read (:mod:`._vllm_process`); else all after the load, as vLLM does.
#: Off by default: where the processing's threads and the reads share a few cores it
#: measured no faster (docs/vllm.md, "Processing each layer as it lands").
_LOADER_KEYS = ("place_local_files", "process_as_loaded")


def options_from_config(config: Mapping[str, Any] | None) -> LoadOptions:
    """``--model-loader-extra-config`` as :class:`LoadOptions` (the loader's own keys,
    ``place_local_files``, left out): an unknown key or a bad value is refused naming it, at
    startup."""
    config = dict(config or {})
    known = {f.name for f in dataclasses.fields(LoadOptions)}
    unknown = sorted(set(config) - known - set(_LOADER_KEYS))
    if unknown:
        raise ValueError(
            f"load format {LOAD_FORMAT!r}: unknown model_loader_extra_config key "
            f"{unknown[0]!r}; the keys are LoadOptions fields: {', '.join(sorted(known))}, "
            f"and {', '.join(_LOADER_KEYS)}"
        )
    try:
        return LoadOptions(**{k: v for k, v in config.items() if k in known})
    except (TypeError, ValueError) as err:
        raise ValueError(f"load format {LOAD_FORMAT!r}: model_loader_extra_config: {err}") from err


def _flag(config: Mapping[str, Any] | None, key: str, default: bool) -> bool:
    value = (config or {}).get(key, default)
    if not isinstance(value, bool):
        raise ValueError(
            f"load format {LOAD_FORMAT!r}: model_loader_extra_config: {key} "
            f"must be true or false, got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport(EngineLoad):
    """What one load into a vLLM model did (``AsyncSlabLoader.report``). ``defaulted``:
    parameters vLLM gives a value of its own and takes from a checkpoint only if there
    (KV-cache scales), which this checkpoint does not hold."""

    def summary(self) -> str:
        done = (
            f"asyncslab loaded {format_bytes(self.bytes)} of {self.tensors} tensors "
            f"({self.files} files) into {self.parameters} parameters in {self.load_s:.2f} s "
            f"({self.gbps:.2f} GB/s)"
        )
        rest = [
            f"recording destinations {self.capture_s:.2f} s (vLLM's loaders run on "
            f"{self.recorded} tensors, the rest derived), planning {self.plan_s:.2f} s"
        ]
        if self.transformed:
            rest.append(
                f"{len(self.transformed)} tensors ({format_bytes(self.transformed_bytes)}) "
                f"transformed by vLLM's loaders in {self.transformed_s:.2f} s"
            )
        else:
            rest.append("none transformed")
        if self.handed:
            rest.append(f"{len(self.handed)} layers processed as they landed")
        if self.skipped:
            rest.append(f"{len(self.skipped)} skipped by vLLM ({', '.join(self.skipped[:3])})")
        if self.overwritten:
            rest.append(
                f"{len(self.overwritten)} not read, a later tensor writing the same bytes as "
                f"vLLM's loaders do ({', '.join(self.overwritten[:3])})"
            )
        if self.defaulted:
            rest.append(
                f"{len(self.defaulted)} parameters kept vLLM's defaults "
                f"({', '.join(self.defaulted[:3])})"
            )
        return f"{done}; {'; '.join(rest)}. Loading weights took {self.total_s:.2f} seconds"


class AsyncSlabLoader(BaseModelLoader):
    """``load_format="asyncslab"``. Extra-config keys are :class:`LoadOptions` fields and
    ``place_local_files`` (see ``_LOADER_KEYS``).

    ``report`` describes this loader's last load; ``last_report`` the last load of any in
    this process (a worker's, for ``LLM.collective_rpc``). The same for reloads:
    ``reload_report`` and ``last_reload`` (vLLM's ``reload_weights`` makes a loader of its
    own and drops it, so only the latter outlives the call)."""

    last_report: LoadReport | None = None
    last_reload: ReloadReport | None = None

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = options_from_config(load_config.model_loader_extra_config)
        extra = load_config.model_loader_extra_config
        self.place_local_files = _flag(extra, "place_local_files", False)
        self.process_as_loaded = _flag(extra, "process_as_loaded", False)
        # Set while vLLM's load_model runs this loader (a bare load_weights processes
        # nothing: its caller processes the whole model after).
        self._within: _Within | None = None
        # vLLM's own file selection (download, index filtering, patterns), configured as
        # for safetensors, which is what this format reads.
        self._files = DefaultModelLoader(
            dataclasses.replace(
                load_config, load_format="safetensors", model_loader_extra_config={}
            )
        )
        self.report: LoadReport | None = None
        self.reload_report: ReloadReport | None = None

    def download_model(self, model_config: Any) -> None:
        if object_weights(model_config) is None:  # objects are read where they are
            self._files.download_model(model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        # vLLM's load_model collects twice, after the weights and after processing, to free
        # what the load left behind. Each full pass also walks every object the worker held
        # before (its imports: hundreds of thousands), costing more than reading a small
        # model; with that heap set aside the passes walk what the load made, and free it.
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        # Layers processed as they land are left alone by vLLM's pass, once load_weights has
        # processed them, until the pass is over (``_vllm_process``).
        with _only_new_objects_collected(), contextlib.ExitStack() as after_vllms_pass:
            self._within = _Within(torch.device(load_device), after_vllms_pass)
            try:
                model: nn.Module = super().load_model(vllm_config, model_config, prefix)
            finally:
                self._within = None
        return model

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        # The collector paused: what the load allocates holds no cycle that must go before
        # it ends, but its allocations would set off full passes over a vLLM worker's heap
        # inside the load, each costing more than reading a small model; vLLM's load_model
        # collects right after load_weights (tests/engines/test_vllm.py counts the passes).
        with gc_paused():
            self._load_weights(model, model_config)

    def _load_weights(self, model: nn.Module, model_config: Any) -> None:
        started = time.perf_counter()
        checkpoint, names = self._checkpoint(model, model_config)
        within, layers = self._within, None
        if within is not None and self.process_as_loaded:
            layers = LayerProcessing.of(model, model_config, within.target)
        engine = Engine(
            # Every vLLM model has one; nn.Module's typing only knows it as an attribute.
            load=cast(WeightLoader, model.load_weights),
            # A list, which the load empties once planned: a weight a layer's processing
            # replaces is freed then, not at the load's end.
            parameters=list(model.named_parameters(remove_duplicate=False)),
            buffers=tuple(model.named_buffers(remove_duplicate=False)),
            names=names,
            optional=frozenset(_optional(model)),
            stand_ins="cpu",  # where vLLM's own readers put the tensors they hand over
            order=_reading_order(checkpoint, names),
        )
        entered = time.perf_counter()
        done = load_into_engine(
            checkpoint,
            engine,
            options=self.options,
            progress=_LogProgress(logger),
            placed=lambda placement: remember(model, placement),
            on_unit=layers,
        )
        if within is not None and layers is not None and layers.processed:
            within.after_vllms_pass.enter_context(layers.skipped_by_vllm())
        # vLLM's file selection counts with the recording: both come before the reads.
        before = entered - started
        figures = {f.name: getattr(done, f.name) for f in dataclasses.fields(done)}
        figures.update(capture_s=before + done.capture_s, total_s=before + done.total_s)
        self.report = LoadReport(**figures)
        AsyncSlabLoader.last_report = self.report
        logger.info("%s", self.report.summary())

    def get_all_weights(
        self, model_config: Any, model: nn.Module
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every checkpoint tensor by vLLM's name, as stored, for vLLM's in-place
        ``reload_weights``: the files opened and checked again; each tensor the first load
        put whole into one parameter read straight into that parameter's bytes
        (``_vllm_reload``), the rest read into host memory a window at a time (see
        ``_stream``), the next window read while vLLM's loaders take the current one."""
        checkpoint, names = self._checkpoint(model, model_config)
        # Files vLLM reads hold nothing it would skip: every tensor goes to its loader.
        self.reload_report = yield from reload_tensors(
            checkpoint,
            names,
            model,
            host(self.options),
            logger,
            place_local_files=self.place_local_files,
        )
        AsyncSlabLoader.last_reload = self.reload_report

    def _checkpoint(self, model: nn.Module, model_config: Any) -> tuple[Checkpoint, dict[str, str]]:
        """The safetensors files vLLM would read, as one checkpoint, and the names vLLM
        knows each tensor by (a source's prefix added) -> checkpoint names."""
        uri = object_weights(model_config)
        if uri is not None:
            return open_checkpoint(uri, model)
        sources = [
            DefaultModelLoader.Source(
                model_config.model,
                model_config.revision,
                prefix="",
                fall_back_to_pt=False,
                allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
                is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None),
            ),
            *getattr(model, "secondary_weights", ()),
        ]
        files: list[str] = []
        prefixes: list[tuple[str, list[str]]] = []
        indexed: Checkpoint | None = None
        for source in sources:
            folder, found, use_safetensors, index_name = self._files._prepare_weights(
                source.model_or_path,
                source.subfolder,
                source.revision,
                False,
                source.allow_patterns_overrides,
            )
            if not use_safetensors:
                raise CheckpointError(
                    f"load format {LOAD_FORMAT!r} reads safetensors checkpoints; "
                    f"{source.model_or_path} has none",
                    file=source.model_or_path,
                )
            if source.is_unused_weight is not None:
                from vllm.model_executor.model_loader.weight_utils import (
                    filter_safetensors_files_by_weight_name,
                )

                found = filter_safetensors_files_by_weight_name(found, source.is_unused_weight)
            index = Path(folder) / index_name
            if source.allow_patterns_overrides is None and index.is_file():
                # vLLM keeps the files the index lists and drops the rest; a file it lists
                # that is not there, or a header that disagrees with it, is an error here
                # (asyncslab's index checks: headers only), not tensors silently missing.
                indexed = Checkpoint.open(index)
            files.extend(found)
            prefixes.append((source.prefix, found))
        if (
            len(prefixes) == 1
            and indexed is not None
            and sorted(str(f.path) for f in indexed.files) == sorted(str(Path(f)) for f in files)
        ):
            # One source, every file its index lists: that is the checkpoint, its headers
            # parsed once (a large MoE's are tens of thousands of tensors).
            checkpoint = indexed
        else:
            checkpoint = Checkpoint.open_files(files)
        if len(prefixes) == 1 and not prefixes[0][0]:
            # Every tensor, under its own name (the usual case; no per-tensor file lookup).
            return checkpoint, {name: name for name in checkpoint.tensors}
        names: dict[str, str] = {}
        for prefix, found in prefixes:
            mine = {Path(f) for f in found}
            for name, info in checkpoint.tensors.items():
                if info.file in mine:
                    names[prefix + name] = name
        return checkpoint, names


@contextlib.contextmanager
def _only_new_objects_collected() -> Iterator[None]:
    """The collector's passes inside limited to objects made inside: the heap as it was is
    frozen (``gc.freeze``, after a pass over the young generations, which is cheap, so that
    recent garbage is not kept) and unfrozen after. Left alone where the heap is frozen
    already: ``gc.unfreeze`` cannot be nested and would undo the other freeze."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclasses.dataclass(frozen=True, slots=True)
class _Within:
    """vLLM's load_model, running this loader: the device it processes the weights on, and
    what is undone once its processing pass is over."""

    target: torch.device
    after_vllms_pass: contextlib.ExitStack


def _reading_order(checkpoint: Checkpoint, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A sort key of vLLM's names in the order its safetensors reader hands the tensors to
    ``load_weights`` (``safetensors_weights_iterator``): files in natural order (``-2-``
    before ``-10-``), each file's tensors by name (``safe_open.keys()`` sorts them). Where
    vLLM's loaders write one byte from several tensors, the last so read stands."""
    tensors = checkpoint.tensors
    keys: dict[Path, list[int | str]] = {}

    def key(name: str) -> tuple[list[int | str], str]:
        stored = names.get(name, name)
        file = tensors[stored].file
        found = keys.get(file)
        if found is None:
            parts = re.split(r"(\d+)", Path(file).name)
            found = keys[file] = [int(p) if p.isdigit() else p for p in parts]
        return found, stored

    return key


class _LogProgress:
    """A progress line in vLLM's log about once a second (and none for a load that ends
    within the first)."""

    def __init__(self, log: logging.Logger, every: float = 1.0) -> None:
        self._log = log
        self._every = every
        self._next = time.perf_counter() + every

    def __call__(self, stats: LoadStatistics) -> None:
        now = time.perf_counter()
        if stats.state != "loading" or now < self._next:
            return
        self._next = now + self._every
        eta = stats.eta_s
        self._log.info(
            "asyncslab: %.0f%% of %s, %.2f GB/s%s",
            100 * stats.bytes_landed / max(1, stats.bytes_needed),
            format_bytes(stats.bytes_needed),
            stats.gbps,
            f", about {eta:.0f} s left" if eta is not None else "",
        )


def _optional(model: nn.Module) -> set[str]:
    """The parameters a checkpoint need not hold, as vLLM's own check of a quantized load
    has them (``DefaultModelLoader.track_weights_loading``): those of a KV-cache
    quantization method (scales vLLM initialises and overwrites only from a checkpoint
    that has them), and those vLLM builds from the quantization config."""
    out = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        kv_cache = isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod)
        for name, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            if kv_cache or name in _CONFIG_BUILT:
                out.add(f"{prefix}.{name}" if prefix else name)
    return out


#: vLLM's ``default_loader._CONFIG_BUILT_PARAMS``, private to it.
_CONFIG_BUILT = ("input_scale_ub",)

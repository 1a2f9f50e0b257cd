"""transformers' ``from_pretrained``, each checkpoint tensor read straight into its slot of
the model's own (fused) parameters, from local files or object storage.

The sequence: read the config (from an ``s3://``/``gs://``/``az://`` prefix, its config and
generation files are fetched by asyncslab's own client) and refuse a quantized checkpoint
(a ``quantization_config``: loading it needs transformers' quantizer); open the checkpoint's
headers (:meth:`Checkpoint.open`: a directory or that prefix); build the model as
``from_pretrained`` builds it (its init context: the meta device, no initialisation, no
tying); find every checkpoint tensor's parameter and view with transformers' own
conversion mapping, refusing a missing, extra, misshapen or mistyped tensor
(:mod:`._transformers_places`); on a CPU target, hand each parameter that
one local checkpoint tensor fills whole and as it is a view of its file's private mapping,
as transformers' own reader does (its pages are read at first use; ``disable_mmap=True``
reads them now, into memory of the process's own); allocate every other parameter once, on
the target device; plan one run per tensor into those views and load it (a
:class:`~asyncslab.SlabSet` over the model's own tensors). Groups whose conversion is not
a placement (a transpose, a cast asked for) are read into buffers of their own in the same
load and handed to transformers' own converter. Then ``from_pretrained``'s own finishing
steps run (``PreTrainedModel._finalize_model_loading``: non-persistent buffers such as
rotary ``inv_freq`` computed, tied weights tied), the model is put in eval mode and its
generation config read (``adjust_generation_fn``). ``tests/engines/test_transformers.py``
fails, never skips, when transformers changes what is used here.
"""

from __future__ import annotations

import asyncio
import copy
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import Checkpoint, TensorInfo
from ..errors import (
    LoadError,
    ShapeMismatchError,
)
from ..loading import (
    LoadOptions,
    LoadStatistics,
    ProgressCallback,
    SlabSet,
    map_checked,
    presigns,
)
from ..planning import Claim, Plan, SlabSpec, make_route, plan, unit_of_layer
from ._engine_load import run_sync
from ._transformers_model import (
    build_model,
    config_at,
    dtype_lookup,
    is_object_uri,
    local_files,
    model_class_of,
    model_dtype,
    read_config,
)
from ._transformers_places import Converted, Places, places, refuse_quantized

__all__ = ["TransformersLoad", "from_pretrained", "load", "load_pretrained"]

#: The weights, read by the load; every other file under a prefix (config, tokenizer,
#: generation config, chat template) is fetched.

#: From object storage, the GETs in flight unless the caller sets them. Presigned GETs
#: (``s3://``, ``az://``) read their bodies straight into the parameters and hold no memory:
#: the loader's 16 of 8 MiB, faster than 8 over a distant link. Through obstore (``gs://``,
#: a store that cannot sign) a load holds this path's own ~35-65 MiB plus the responses in
#: flight beyond the parameters, so 16 x 8 MiB would break the promise of at most the
#: parameters + 128 MiB; 8 were as fast there (docs/transformers.md has both measurements).
PRESIGNED_REQUESTS: Mapping[str, int] = {"request_concurrency": 16, "request_size": 8 << 20}
OBJECT_STORE_REQUESTS: Mapping[str, int] = {"request_concurrency": 8, "request_size": 8 << 20}


@dataclass(frozen=True, slots=True)
class TransformersLoad:
    """What one load did: ``tensors`` checkpoint tensors, ``placed`` of them straight into
    their parameters: read there (``bytes``), or, ``mapped`` of them (``mapped_bytes``),
    handed over as views of their files' mappings; ``converted`` through transformers'
    converters (with why), ``skipped`` (tied copies, keys the model ignores). Seconds:
    building, mapping and planning (``prepare_s``), the reads (``load_s``), converting and
    finishing (``finish_s``)."""

    source: str
    files: int
    tensors: int
    placed: int
    bytes: int
    mapped: int
    mapped_bytes: int
    parameters: int
    converted: Mapping[str, str]
    skipped: tuple[str, ...]
    prepare_s: float
    load_s: float
    finish_s: float

    @property
    def total_s(self) -> float:
        return self.prepare_s + self.load_s + self.finish_s

    @property
    def gbps(self) -> float:
        return self.bytes / self.load_s / 1e9 if self.load_s > 0 else 0.0


def from_pretrained(
    source: str | os.PathLike[str],
    *,
    model_class: Any = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: Any = None,
    storage_options: Mapping[str, str | bool | int | float] | None = None,
    progress: ProgressCallback | None = None,
    disable_mmap: bool | None = None,
    **options: Any,
) -> Any:
    """What ``model_class.from_pretrained(source, dtype=dtype, device_map=device)`` returns
    (eval mode, tied weights sharing storage, buffers, ``generation_config``), every
    parameter read by asyncslab straight into place.

    ``source``: a checkpoint directory (``config.json`` and safetensors, with or without an
    index) or an object-store URI (``s3://bucket/prefix``). ``model_class``: any
    ``PreTrainedModel`` class or auto class (default ``AutoModelForCausalLM``).
    ``dtype``: ``None`` (or ``"auto"``) keeps the config's, and refuses a tensor of another
    dtype; a dtype casts to it, as transformers does. ``config`` replaces ``config.json``.
    ``storage_options`` configure the object-store client (else the environment's
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...; see docs/object-storage.md).
    ``disable_mmap``, as transformers': by default (``None``: unless the files are on an
    hf-mount FUSE filesystem, as transformers decides) a CPU model's parameters that one
    local checkpoint tensor fills whole and as it is are views of a private mapping of
    their file, read at first use; ``True`` reads every byte now, into the process's own
    memory. A mapped parameter shares the file's pages with the page cache: rewriting the
    file in place while the model lives (``save_pretrained`` into the same directory)
    changes or breaks it, as it does a model of ``from_pretrained``'s (writes into the
    parameter never reach the file). ``options`` are :class:`~asyncslab.LoadOptions`
    fields (from object storage,
    ``request_concurrency`` and ``request_size`` default to :data:`PRESIGNED_REQUESTS` where
    the GETs are presigned, else to :data:`OBJECT_STORE_REQUESTS`).
    Synchronous (a running event loop is left alone: the reads run on a loop of their own
    thread); see :func:`load_pretrained`."""
    return load(
        source,
        model_class=model_class,
        dtype=dtype,
        device=device,
        config=config,
        storage_options=storage_options,
        progress=progress,
        disable_mmap=disable_mmap,
        **options,
    )[0]


async def load_pretrained(
    source: str | os.PathLike[str],
    *,
    model_class: Any = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: Any = None,
    storage_options: Mapping[str, str | bool | int | float] | None = None,
    progress: ProgressCallback | None = None,
    disable_mmap: bool | None = None,
    **options: Any,
) -> Any:
    """:func:`from_pretrained` for async code: building the model, planning and converting
    run on a worker thread, the reads on the caller's event loop, which never blocks."""
    _load_options(source, options)  # wrong options fail before anything is prepared
    started = time.perf_counter()
    prepared = await asyncio.to_thread(
        _prepare, source, model_class, dtype, device, config, storage_options, disable_mmap
    )
    try:
        load_options = _load_options(source, options, prepared.checkpoint)
        read = time.perf_counter()
        statistics = await _read(prepared, load_options, progress)
        done = time.perf_counter()
        model, _ = await asyncio.to_thread(
            _finish, prepared, statistics, read - started, done - read
        )
    finally:
        prepared.close()
    return model


def load(
    source: str | os.PathLike[str],
    *,
    model_class: Any = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: Any = None,
    storage_options: Mapping[str, str | bool | int | float] | None = None,
    progress: ProgressCallback | None = None,
    disable_mmap: bool | None = None,
    **options: Any,
) -> tuple[Any, TransformersLoad]:
    """:func:`from_pretrained`, and what the load did."""
    _load_options(source, options)  # wrong options fail before anything is prepared
    import transformers  # noqa: F401  (its first import is no part of the load's time)

    started = time.perf_counter()
    prepared = _prepare(source, model_class, dtype, device, config, storage_options, disable_mmap)
    try:
        load_options = _load_options(source, options, prepared.checkpoint)
        read = time.perf_counter()
        statistics = run_sync(_read(prepared, load_options, progress))
        done = time.perf_counter()
        return _finish(prepared, statistics, read - started, done - read)
    finally:
        prepared.close()


def _load_options(
    source: str | os.PathLike[str], options: Mapping[str, Any], opened: Checkpoint | None = None
) -> LoadOptions:
    """``options``, with the object store's in-flight defaults for what they leave unset when
    ``source`` is in object storage: :data:`PRESIGNED_REQUESTS` where every shard's GETs are
    presigned (known once the checkpoint is ``opened``; before, the options are only
    checked), else :data:`OBJECT_STORE_REQUESTS`."""
    asked = LoadOptions(**options)
    if not is_object_uri(os.fspath(source)):
        return asked
    presigned = (
        opened is not None
        and asked.presigned_gets
        and all(presigns(shard) for shard in opened.files)
    )
    defaults = PRESIGNED_REQUESTS if presigned else OBJECT_STORE_REQUESTS
    return LoadOptions(**{**defaults, **options})


# --- preparing: config, model on meta, places, storage, plan ----------------------------


@dataclass(slots=True)
class _Prepared:
    source: str
    files: Path
    checkpoint: Checkpoint
    model: Any
    dtype: torch.dtype
    dtype_plan: dict[str, torch.dtype]
    conversions: list[Any]
    found: Places
    device: torch.device
    plan: Plan
    mapped: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor]
    sources: dict[str, torch.Tensor]
    temporary: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        if self.temporary is not None:
            self.temporary.cleanup()
            self.temporary = None


def _prepare(
    source: str | os.PathLike[str],
    model_class: Any,
    dtype: Any,
    device: Any,
    config: Any,
    storage_options: Mapping[str, str | bool | int | float] | None,
    disable_mmap: bool | None,
) -> _Prepared:
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping

    where = os.fspath(source)
    files, temporary = local_files(where, storage_options, need_config=config is None)
    try:
        given = config is not None
        config = read_config(config, files)
        # From the config alone: before a header is opened, let alone a payload byte read.
        refuse_quantized(config, config_at(where, files, given))
        checkpoint = Checkpoint.open(where, storage_options=storage_options)
        cls = model_class_of(model_class or AutoModelForCausalLM, config)
        target, cast = model_dtype(dtype, config, checkpoint)
        model = build_model(cls, config, target, where)
        dtype_plan = model._get_dtype_plan(target)
        conversions = get_model_conversion_mapping(model, None, None)
        dtype_of = dtype_lookup(dtype_plan)
        found = places(
            model, checkpoint.tensors, conversions, dtype_of=dtype_of, dtype=target, cast=cast
        )
        device = torch.device(device)
        _check_converted(model, found, checkpoint)
        mapped = _mapped(checkpoint, found, device, disable_mmap)
        _allocate(model, found, dtype_of, device, mapped)
        built, views, sources = _plan(checkpoint, model, found, device, mapped)
    except BaseException:
        if temporary is not None:
            temporary.cleanup()
        raise
    return _Prepared(
        source=where,
        files=files,
        checkpoint=checkpoint,
        model=model,
        dtype=target,
        dtype_plan=dtype_plan,
        conversions=conversions,
        found=found,
        device=device,
        plan=built,
        mapped=mapped,
        views=views,
        sources=sources,
        temporary=temporary,
    )


def _check_converted(model: Any, found: Places, checkpoint: Checkpoint) -> None:
    """Each converted group's converter, run once on meta stand-ins: its outputs must be
    the model's targets in their shapes, checked before any read."""
    from transformers.core_model_loading import WeightConverter

    state = model.state_dict()
    for group in found.converted:
        if not isinstance(group.converter, WeightConverter):
            continue
        converter = copy.deepcopy(group.converter)
        stand_ins = {
            p: [
                torch.empty(
                    checkpoint.tensors[n].shape, dtype=checkpoint.tensors[n].dtype, device="meta"
                )
                for n in ns
            ]
            for p, ns in group.tensors.items()
        }
        result = _run_converter(converter, group, stand_ins, model)
        for name, value in result.items():
            if name not in state:
                raise ShapeMismatchError(
                    f"transformers' converter makes {name!r}, which "
                    f"{type(model).__name__} does not have",
                    tensor=group.names[0],
                    target=name,
                )
            if tuple(value.shape) != tuple(state[name].shape):
                raise ShapeMismatchError(
                    f"transformers' converter makes {list(value.shape)} for {name!r}, the model "
                    f"expects {list(state[name].shape)}",
                    tensor=group.names[0],
                    target=name,
                    expected=tuple(state[name].shape),
                    got=tuple(value.shape),
                )


def _run_converter(
    converter: Any, group: Converted, tensors: Mapping[str, list[torch.Tensor]], model: Any
) -> dict[str, torch.Tensor]:
    for pattern, values in tensors.items():
        # Callables: transformers' synchronous path (``materialize_tensors``) calls each.
        converter.collected_tensors[pattern] = [lambda t=t: t for t in values]
    try:
        result = converter.convert(group.target, model=model, config=model.config)
    except Exception as err:
        raise LoadError(
            f"transformers' converter for {group.target!r} ({group.why}) failed on "
            f"{list(group.names)[:4]}: {type(err).__name__}: {err}",
            tensor=group.names[0],
        ) from err
    return {k: (v[0] if isinstance(v, list) else v) for k, v in result.items()}


def _allocate(
    model: Any,
    found: Places,
    dtype_of: Any,
    device: torch.device,
    mapped: Mapping[str, torch.Tensor],
) -> None:
    """Real storage for every state-dict entry a checkpoint tensor writes, once, on
    ``device`` (or its ``mapped`` view of a file); tied copies stay on meta until tied,
    missing buffers for the model to initialise. Each is marked initialised, as
    ``set_param_for_module`` marks it."""
    skip = {*found.missing_buffers, *found.missing_tied}
    for key, meta in model.state_dict(keep_vars=True).items():
        if key in skip:
            continue
        module_path, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        real = mapped.get(key)
        if real is None:
            real = torch.empty(meta.shape, dtype=dtype_of(key, meta), device=device)
        if leaf in module._buffers:
            module._buffers[leaf] = real
        else:
            real = torch.nn.Parameter(real, requires_grad=real.is_floating_point())
            module._parameters[leaf] = real
        real._is_hf_initialized = True  # type: ignore[attr-defined]


def _mapped(
    checkpoint: Checkpoint, found: Places, device: torch.device, disable_mmap: bool | None
) -> dict[str, torch.Tensor]:
    """Per state-dict entry one checkpoint tensor fills whole and as it is (no slice, no
    cast: ``places`` placed it with no steps), from a local file, on a CPU target: a view
    of that file's private mapping, each file mapped once (:func:`map_checked`: one
    changed since it was opened is refused). A tensor at an offset no multiple of its
    element size (a file the safetensors library did not write) cannot be viewed, and is
    read instead."""
    if device.type != "cpu" or disable_mmap:
        return {}
    from transformers.modeling_utils import _is_on_hf_mount

    shards = {shard.path: shard for shard in checkpoint.files if shard.source is None}
    usable: dict[Path, bool] = {}
    files: dict[Path, torch.Tensor] = {}
    mapped: dict[str, torch.Tensor] = {}
    for place in found.placed:
        info = checkpoint.tensors[place.tensor]
        shard = shards.get(info.file)
        if place.steps or shard is None or info.offset % info.dtype.itemsize:
            continue
        if disable_mmap is None:
            if (fine := usable.get(shard.path)) is None:
                # transformers' own test: mmap on hf-mount's FUSE filesystem can deadlock.
                fine = usable[shard.path] = not _is_on_hf_mount(shard.path)
            if not fine:
                continue
        whole = files.get(shard.path)
        if whole is None:
            whole = files[shard.path] = map_checked(
                shard.path, shard.size, shard.inode, shard.mtime_ns, shards=len(shards)
            )
        raw = whole[info.offset : info.offset + info.nbytes]
        mapped[place.target] = raw.view(info.dtype).view(info.shape)
    return mapped


class _Claimed:
    """A rule that claims what was decided already."""

    def __init__(self, claim: Claim) -> None:
        self._claim = claim

    def claim(self, checkpoint: Checkpoint, pending: Mapping[str, TensorInfo]) -> Claim:
        return self._claim


def _plan(
    checkpoint: Checkpoint,
    model: Any,
    found: Places,
    device: torch.device,
    mapped: Mapping[str, torch.Tensor],
) -> tuple[Plan, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One route per placed tensor into its view of the (real) parameter, and one per
    converted tensor into a buffer of its own on ``device``; the ``mapped`` (by target)
    are not read."""
    state = model.state_dict(keep_vars=True)
    specs: list[SlabSpec] = []
    routes = []
    views: dict[str, torch.Tensor] = {}
    sources: dict[str, torch.Tensor] = {}

    def route(info: TensorInfo, name: str, target: str, view: torch.Tensor) -> None:
        spec = SlabSpec(
            name=name,
            unit=unit_of_layer(target),
            dtype=info.dtype,
            slot_dims=(),
            item_shape=(info.numel,),
            labels={"target": target, "tensor": info.name},
        )
        specs.append(spec)
        routes.append(make_route(info, spec, (), elements=(0, info.numel)))
        views[name] = view

    unread: list[str] = []
    for place in found.placed:
        if place.target in mapped:
            unread.append(place.tensor)
            continue
        info = checkpoint.tensors[place.tensor]
        view = place.view(state[place.target].detach())
        offset = (
            view.storage_offset() - state[place.target].storage_offset()
        ) * view.element_size()
        route(info, f"{place.target}@{offset}", place.target, view.reshape(-1))
    for group in found.converted:
        for name in group.names:
            info = checkpoint.tensors[name]
            buffer = torch.empty(info.shape, dtype=info.dtype, device=device)
            sources[name] = buffer
            route(info, f"source:{name}", group.target, buffer.view(-1))
    claim = Claim(slabs=tuple(specs), routes=tuple(routes), skipped=(*found.skipped, *unread))
    return plan(checkpoint, [_Claimed(claim)]), views, sources


# --- reading and finishing --------------------------------------------------------------


async def _read(
    prepared: _Prepared, options: LoadOptions, progress: ProgressCallback | None
) -> LoadStatistics:
    slabs = SlabSet(prepared.plan, prepared.device, tensors=prepared.views)
    try:
        await slabs.load(prepared.checkpoint, options=options, progress=progress)
        return slabs.statistics()
    finally:
        # The SlabSet only lent itself the model's tensors; closing it frees none of them.
        await slabs.aclose()


def _finish(
    prepared: _Prepared, statistics: LoadStatistics, prepare_s: float, load_s: float
) -> tuple[Any, TransformersLoad]:
    started = time.perf_counter()
    model = prepared.model
    with torch.no_grad():
        for group in prepared.found.converted:
            _convert(model, group, prepared.sources)
    prepared.sources.clear()
    _finalize(model, prepared)
    report = TransformersLoad(
        source=prepared.source,
        files=len(prepared.checkpoint.files),
        tensors=len(prepared.checkpoint.tensors),
        placed=len(prepared.found.placed),
        bytes=statistics.bytes_landed,
        mapped=len(prepared.mapped),
        mapped_bytes=sum(t.nbytes for t in prepared.mapped.values()),
        parameters=sum(1 for _ in model.parameters()),
        converted={n: g.why for g in prepared.found.converted for n in g.names},
        skipped=prepared.found.skipped,
        prepare_s=prepare_s,
        load_s=load_s,
        finish_s=time.perf_counter() - started,
    )
    return model, report


def _finalize(model: Any, prepared: _Prepared) -> None:
    """``from_pretrained``'s own finishing steps (buffers computed, weights tied), eval mode
    and the generation config, on the loaded model."""
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(
        missing_keys={*prepared.found.missing_buffers, *prepared.found.missing_tied},
        unexpected_keys=set(),
        mismatched_keys=set(),
        conversion_errors={},
        error_msgs=[],
        skipped_pp_keys=set(),
    )
    config = LoadStateDictConfig(
        pretrained_model_name_or_path=prepared.source,
        device_map={"": prepared.device},
        dtype=prepared.dtype,
        dtype_plan=prepared.dtype_plan,
        weight_mapping=prepared.conversions,
    )
    type(model)._finalize_model_loading(model, config, info)
    model.eval()
    # What from_pretrained keeps for save_pretrained to write the original format again.
    model._weight_conversions = [c for c in prepared.conversions if c.was_used()]
    if model.can_generate() and hasattr(model, "adjust_generation_fn"):
        model.adjust_generation_fn(
            None,
            False,
            False,
            str(prepared.files),
            cache_dir=None,
            force_download=False,
            proxies=None,
            local_files_only=True,
            token=None,
            revision="main",
            subfolder="",
            trust_remote_code=False,
        )


def _convert(model: Any, group: Converted, sources: Mapping[str, torch.Tensor]) -> None:
    """A group that is not a placement, through transformers' own converter (or a cast)."""
    if group.converter is None or not hasattr(group.converter, "operations"):
        (name,) = group.names
        model.get_parameter_or_buffer(group.target).copy_(sources[name])
        return
    tensors = {p: [sources[n] for n in ns] for p, ns in group.tensors.items()}
    result = _run_converter(copy.deepcopy(group.converter), group, tensors, model)
    for name, value in result.items():
        # copy_ casts: a converted group is one whose dtype change was asked for.
        model.get_parameter_or_buffer(name).copy_(value)

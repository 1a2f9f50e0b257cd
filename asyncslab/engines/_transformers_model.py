"""transformers' model as ``from_pretrained`` makes it, before a payload byte is read: the
checkpoint's small files (its config, generation config, tokenizer) beside it or fetched
from object storage, the config read, the model class and dtype chosen, the model built in
transformers' init context, and the dtype each parameter takes once loaded. The load into
it is :mod:`._transformers`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._objects import SCHEMES, ObjectPath
from ..checkpoint import Checkpoint
from ..errors import CheckpointError, MissingFileError, UnsafePathError

__all__ = [
    "build_model",
    "config_at",
    "dtype_lookup",
    "is_object_uri",
    "local_files",
    "model_class_of",
    "model_dtype",
    "read_config",
]

#: The weights, read by the load; every other file under a prefix (config, tokenizer,
#: generation config, chat template) is fetched.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def is_object_uri(text: str) -> bool:
    """Whether ``text`` names a prefix in object storage (``s3://``, ``gs://``, ``az://``...)."""
    return "://" in text and text.partition("://")[0] in SCHEMES


def local_files(
    where: str,
    storage_options: Mapping[str, str | bool | int | float] | None,
    *,
    need_config: bool,
) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The folder of the checkpoint's small files (its config, tokenizer...): beside it, or
    for one in object storage, a temporary folder they are fetched into (returned too, for
    the caller to clean up)."""
    if not is_object_uri(where):
        path = Path(where)
        return (path if path.is_dir() else path.parent), None
    temporary = tempfile.TemporaryDirectory(prefix="asyncslab-transformers-")
    files = Path(temporary.name)
    try:
        _fetch_files(where, files, storage_options or {}, need_config=need_config)
    except BaseException:
        temporary.cleanup()
        raise
    return files, temporary


def _fetch_files(
    uri: str,
    into: Path,
    storage_options: Mapping[str, str | bool | int | float],
    *,
    need_config: bool,
) -> None:
    """Every object directly under ``uri`` but the weights (config, generation config,
    tokenizer), into ``into``, by asyncslab's own client (endpoint and credentials from
    the environment and ``storage_options``, as for ``Checkpoint.open``), each GET pinned
    to the ETag its listing gave."""
    from .._objects import ObjectLocation, bucket_of, client, etag_of, listing, read_object

    spec, prefix = bucket_of(uri, storage_options)
    store = client(spec)
    where = ObjectPath.of(spec.scheme, spec.bucket, prefix)
    metas = listing(store, spec, prefix, "listing the prefix")
    parent = f"{prefix}/" if prefix else ""
    names = {
        key: key[len(parent) :]
        for key in sorted(metas)
        if "/" not in key[len(parent) :] and not key.endswith(_WEIGHT_SUFFIXES)
    }
    if need_config and "config.json" not in names.values():
        raise MissingFileError(
            f"no config.json under {uri}: transformers needs the model's config beside its "
            "weights (or pass config=...)",
            file=where,
        )
    for key, name in names.items():
        if name in ("", ".", ".."):
            raise UnsafePathError(f"object {key!r} under {uri} has no safe file name", file=where)
        location = ObjectLocation(spec, key, etag_of(metas[key]))
        (into / name).write_bytes(read_object(store, location))


def read_config(config: Any, files: Path) -> Any:
    """A copy of the config given, or of the one beside the checkpoint."""
    from transformers import AutoConfig

    if config is None:
        if not (files / "config.json").is_file():
            raise MissingFileError(
                "no config.json beside the checkpoint (or pass config=...)", file=files
            )
        config = AutoConfig.from_pretrained(files)
    return copy.deepcopy(config)


def config_at(where: str, files: Path, given: bool) -> str:
    """Where the config came from, for an error to name: the ``config=`` argument, or the
    ``config.json`` beside the checkpoint (under its URI when it is in object storage)."""
    if given:
        return f"{where} (config=...)"
    if is_object_uri(where):
        return f"{where.rstrip('/')}/config.json"
    return str(files / "config.json")


def model_class_of(model_class: Any, config: Any) -> Any:
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _get_model_class

    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:
        try:
            return _get_model_class(config, mapping)  # type: ignore[no-untyped-call]
        except KeyError:
            raise CheckpointError(
                f"{model_class.__name__} has no model for config {type(config).__name__} "
                f"(model_type {getattr(config, 'model_type', None)!r})"
            ) from None
    if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
        return model_class
    raise TypeError(
        f"model_class must be a PreTrainedModel class or an auto class, not {model_class!r}"
    )


def model_dtype(dtype: Any, config: Any, checkpoint: Checkpoint) -> tuple[torch.dtype, bool]:
    """The model's dtype, and whether tensors of another dtype are cast to it (asked for)."""
    if dtype is None or dtype == "auto":
        found = getattr(config, "dtype", None)
        if isinstance(found, str):
            found = getattr(torch, found, None)
        if isinstance(found, torch.dtype):
            return found, False
        floats = [i.dtype for i in checkpoint.tensors.values() if i.dtype.is_floating_point]
        return (floats[0] if floats else torch.get_default_dtype()), False
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is no torch dtype (or 'auto')")
        dtype = named
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, its name or 'auto', not {dtype!r}")
    return dtype, True


def build_model(cls: Any, config: Any, target: torch.dtype, where: str) -> Any:
    """The model of ``cls``, made as ``from_pretrained`` makes it, in dtype ``target``."""
    from transformers.modeling_utils import ContextManagers  # type: ignore[attr-defined]
    from transformers.monkey_patching import patch_output_recorders

    config.dtype = target
    for sub in getattr(config, "sub_configs", {}):
        if (sub_config := getattr(config, sub, None)) is not None:
            sub_config.dtype = target
    config.name_or_path = where
    with ContextManagers(cls.get_init_context(target, False, False, None)):
        model = cls(config)
        patch_output_recorders(model)
    return model


def dtype_lookup(dtype_plan: Mapping[str, torch.dtype]) -> Any:
    """A target's dtype once loaded: the model's, or the ``dtype_plan``'s (modules kept in
    float32), matched as transformers matches it."""
    if not dtype_plan:
        return lambda name, meta: meta.dtype
    from transformers.core_model_loading import build_glob_alternation

    alternation, by_group, _ = build_glob_alternation(list(dtype_plan))

    def dtype_of(name: str, meta: torch.Tensor) -> torch.dtype:
        match = alternation.search(name)
        if match is not None and match.lastgroup is not None:
            return dtype_plan[by_group[match.lastgroup]]
        return meta.dtype

    return dtype_of

"""vLLM's load format ``asyncslab`` for checkpoints in object storage:
``vllm serve s3://bucket/prefix --load-format asyncslab`` and
``LLM(model="s3://...", load_format="asyncslab")``.

vLLM itself takes an object-storage model in two steps: ``ModelConfig`` pulls every file but
the weights (config, tokenizer) into a local directory, keeps the URI in
``ModelConfig.model_weights`` and points ``ModelConfig.model`` at the directory; the load
format then reads the weights from the URI. vLLM 0.32 ties both steps to Run:ai's streamer,
so two of its methods are wrapped here, each only for this load format (any other format,
and any local model, go through vLLM untouched):

- ``EngineArgs.create_model_config``: the config and tokenizer are pulled by asyncslab's own
  object-store client (obstore; endpoint and credentials from the environment, as for
  ``Checkpoint.open``), not by ``runai_model_streamer`` (whose S3 client is a package of its
  own), and the ``EngineArgs`` are handed to vLLM as for an already pulled model
  (``model_weights`` set, which ``ModelConfig.maybe_pull_model_tokenizer_for_runai`` skips).
- ``VllmConfig.try_verify_and_update_config``: it refuses an object-storage
  ``model_weights`` to every load format outside a list written into it (vLLM issue 32807);
  for this format it runs with ``model_weights`` out of its sight, and only that.

The loader (``_vllm.AsyncSlabLoader``) then opens the URI with
:meth:`Checkpoint.open <asyncslab.Checkpoint.open>` (headers by ranged GETs) and streams the
payload straight into vLLM's parameters. ``tests/engines/test_vllm_object_store.py`` fails,
and does not skip, when vLLM changes what is wrapped here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from .._objects import (
    SCHEMES,
    ObjectLocation,
    ObjectPath,
    StoreSpec,
    bucket_of,
    client,
    endpoint,
    etag_of,
    listing,
    parse_uri,
    read_object,
)
from ..checkpoint import Checkpoint
from ..errors import CheckpointError, MissingFileError, UnsafePathError

__all__ = ["install", "is_object_uri", "object_weights", "open_checkpoint", "pull_config"]

logger = logging.getLogger("vllm.asyncslab")

F = TypeVar("F", bound=Callable[..., Any])

#: What vLLM's own pull leaves in the bucket (``ModelConfig.maybe_pull_model_tokenizer_for
#: _runai``'s ``ignore_pattern``): the weights, which the load format reads from there.
WEIGHT_SUFFIXES = (".pt", ".safetensors", ".bin", ".tensors", ".pth")
#: The attribute marking a vLLM method as wrapped here (``register`` runs once per process,
#: but a test may call it again).
_WRAPPED = "__asyncslab_object_store__"
#: Written last into a pulled directory: one without it was cut short and is not used.
_COMPLETE = ".asyncslab-complete"


def is_object_uri(text: object) -> bool:
    """``s3://...``, ``gs://...``, ``az://...``: what ``Checkpoint.open`` reads with GETs."""
    return isinstance(text, str) and "://" in text and text.partition("://")[0] in SCHEMES


def object_weights(model_config: Any) -> str | None:
    """The object-storage URI the weights of ``model_config`` are read from, if any: its
    ``model_weights`` (vLLM's field for the URI of a model whose ``model`` is the pulled
    directory), else ``model`` itself (``reload_weights(weights_path="s3://...")`` sets
    ``model`` and clears ``model_weights``)."""
    for uri in (getattr(model_config, "model_weights", ""), model_config.model):
        if is_object_uri(uri):
            return str(uri)
    return None


def install(load_format: str) -> None:
    """Wrap vLLM's two methods for ``load_format`` (see the module's docstring). Called by
    the ``vllm.general_plugins`` entry point in every vLLM process, before any
    ``EngineArgs`` builds its config; a second call changes nothing. A method this vLLM no
    longer has gets a warning instead of a wrapper (raising here would stop every vLLM
    start): object-storage models are then left to vLLM itself, every other load works as
    before."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    for owner, name, wrap in (
        (EngineArgs, "create_model_config", _pulling),
        (VllmConfig, "try_verify_and_update_config", _verifying),
    ):
        original = getattr(owner, name, None)
        if original is None:
            logger.warning(
                "asyncslab: this vLLM has no %s.%s; load format %r cannot read object "
                "storage (s3://...) here",
                owner.__name__,
                name,
                load_format,
            )
            continue
        if not getattr(original, _WRAPPED, False):
            wrapped = wrap(original, load_format)
            setattr(wrapped, _WRAPPED, True)
            setattr(owner, name, wrapped)


def _pulling(original: F, load_format: str) -> F:
    @functools.wraps(original)
    def create_model_config(self: Any) -> Any:
        uri = self.model
        if self.load_format == load_format and not self.model_weights and is_object_uri(uri):
            local = str(pull_config(uri))
            if self.tokenizer is None or self.tokenizer == uri:
                self.tokenizer = local
            elif is_object_uri(self.tokenizer):
                self.tokenizer = str(pull_config(self.tokenizer, need_config=False))
            # Served under the URI, as vLLM names a model it pulled itself (its
            # ModelConfig takes the name before pulling).
            if self.served_model_name is None:
                self.served_model_name = uri
            self.model_weights, self.model = uri, local
        return original(self)

    return create_model_config  # type: ignore[return-value]


def _verifying(original: F, load_format: str) -> F:
    @functools.wraps(original)
    def try_verify_and_update_config(self: Any) -> Any:
        model = self.model_config
        if (
            model is None
            or self.load_config.load_format != load_format
            or not is_object_uri(model.model_weights)
        ):
            return original(self)
        # Its only use of model_weights is the refusal of formats other than Run:ai's
        # (and "auto" switched to runai_streamer): for this format, neither applies.
        weights, model.model_weights = model.model_weights, ""
        try:
            return original(self)
        finally:
            model.model_weights = weights

    return try_verify_and_update_config  # type: ignore[return-value]


def pull_config(uri: str, *, need_config: bool = True) -> Path:
    """Every object under ``uri`` but the weights (config, tokenizer, generation config,
    chat template, code), in a local directory under vLLM's assets cache, as vLLM's own
    pull lays them out; the directory. ``need_config``: refuse a prefix without
    ``config.json`` (a tokenizer's prefix may have none).

    Named by the URI, the endpoint and every object's ETag: a changed bucket gets a
    directory of its own, an unchanged one the same, pulled once (the objects go to a
    staging directory renamed into place when complete, so two processes pulling at once
    each end with the whole of it)."""
    spec, prefix = bucket_of(uri, {})  # as Checkpoint.open
    store = client(spec)
    metas = listing(store, spec, prefix, "listing the prefix")
    wanted = {
        key: meta
        for key, meta in sorted(metas.items())
        if not key.endswith("/") and not key.endswith(WEIGHT_SUFFIXES)
    }
    if need_config and not any(_relative(k, prefix, uri) == "config.json" for k in wanted):
        raise MissingFileError(
            f"no config.json under {uri}: vLLM needs the model's config beside its weights",
            file=ObjectPath.of(spec.scheme, spec.bucket, prefix),
        )
    digest = hashlib.sha256(f"{uri}\n{endpoint(spec)}".encode())
    for key, meta in wanted.items():
        digest.update(f"\n{key}\n{meta.get('e_tag')}\n{meta.get('size')}".encode())
    target = _cache_root() / digest.hexdigest()[:24]
    if not (target / _COMPLETE).is_file():
        _pull(store, spec, wanted, prefix, uri, target)
        logger.info(
            "asyncslab: pulled %d files of %s (no weights) into %s", len(wanted), uri, target
        )
    return target


def _pull(
    store: Any,
    spec: StoreSpec,
    metas: dict[str, dict[str, Any]],
    prefix: str,
    uri: str,
    target: Path,
) -> None:
    """The objects ``metas`` lists, each as listed (pinned to its ETag: the directory's name
    says which), into ``target``, whole or not at all."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for key, meta in metas.items():
            dest = staging / _relative(key, prefix, uri)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(read_object(store, ObjectLocation(spec, key, etag_of(meta))))
        (staging / _COMPLETE).touch()
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its own complete pull into place first.
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _cache_root() -> Path:
    from vllm.assets.base import get_cache_dir  # VLLM_ASSETS_CACHE, as vLLM's own pull

    root = get_cache_dir() / "asyncslab"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _relative(key: str, prefix: str, uri: str) -> str:
    """``key`` below ``prefix``, refused if it would leave the pulled directory."""
    rest = key[len(prefix) + 1 :] if prefix else key
    parts = PurePosixPath(rest).parts
    if not parts or rest.startswith("/") or any(p in ("..", ".") for p in parts):
        raise UnsafePathError(
            f"object {key!r} under {uri} would be written outside the pulled directory",
            file=ObjectPath.of(*parse_uri(uri)),
        )
    return rest


def open_checkpoint(uri: str, model: Any) -> tuple[Checkpoint, dict[str, str]]:
    """The checkpoint at ``uri`` as ``Checkpoint.open`` selects it (the prefix's index and
    the objects it names, else every ``*.safetensors`` directly under it: what vLLM selects
    in a local directory), and the names vLLM knows its tensors by -> checkpoint names.

    Shards holding only tensors the model declares unused are dropped, as vLLM's
    ``filter_safetensors_files_by_weight_name`` drops such files; models that read weights
    from a second source or other files than ``*.safetensors`` are refused."""
    cls = type(model).__name__
    for attr, what in (
        ("secondary_weights", "weights from a second source"),
        ("allow_patterns_overrides", "other files than *.safetensors"),
    ):
        if getattr(model, attr, None):
            raise CheckpointError(
                f"{cls} reads {what} ({attr}); load format 'asyncslab' reads it from local "
                f"files only, not from {uri}",
                file=ObjectPath.of(*parse_uri(uri)),
            )
    checkpoint = Checkpoint.open(uri)
    unused = getattr(model, "is_unused_checkpoint_weight", None)
    names = list(checkpoint.tensors)
    if unused is not None:
        by_file: dict[Path, list[str]] = {}
        for name, info in checkpoint.tensors.items():
            by_file.setdefault(info.file, []).append(name)
        kept = [ns for ns in by_file.values() if not all(unused(n) for n in ns)]
        if kept:  # vLLM keeps every file when none holds a wanted tensor
            names = [n for ns in kept for n in ns]
    return checkpoint, {name: name for name in names}

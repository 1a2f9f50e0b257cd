"""A bucket's client (obstore's store), and what its failures mean.

S3 requests are path-style (``endpoint/bucket/key``), which every S3 server on a custom
endpoint accepts, and an ``http://`` endpoint of any store is allowed as given. No error
raised here quotes more than the first line of the client's message, and never a configured
secret. obstore is imported on first use only: ``import asyncslab`` does not load it.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError
from ._location import ObjectPath, StoreSpec
from ._settings import endpoint_in, redacted, settings_of

__all__ = ["client", "failure_kind", "refused"]

# Keys of obstore's HTTP client options (the rest of storage_options is the store's config).
_CLIENT_KEYS = frozenset(
    {
        "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
        "http1_only", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
        "proxy_ca_certificate", "proxy_excludes", "timeout", "user_agent", "read_timeout",
    }
)  # fmt: skip
# The client's own retries (before a response starts: connection errors, 5xx), kept short:
# a ranged GET's body cut mid-way is retried by ``_retry``, whose attempt limit bounds a
# request.
_RETRY = {
    "max_retries": 3,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=2),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=30),
}
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "AZURITE_", "STORAGE_EMULATOR_HOST")


def client(spec: StoreSpec, timeout: float | None = None, *, retry: bool = True) -> Any:
    """The obstore store of ``spec``'s bucket (one per spec, settings and environment: a
    load's requests share its connection pool). ``timeout``: seconds a whole request (its
    body included) may take. ``retry`` False: the client retries nothing, for a caller that
    retries itself within a deadline (the client's retries would multiply its timeout)."""
    try:
        import obstore  # noqa: F401
    except ImportError as err:  # an extra of the package, not a dependency
        raise ImportError(
            f"{spec.scheme}://{spec.bucket} needs obstore, the object-store client: "
            "pip install 'asyncslab[s3]'"
        ) from err
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    return _client(spec, timeout, retry, env)


@functools.lru_cache(maxsize=64)
def _client(
    spec: StoreSpec, timeout: float | None, retry: bool, env: tuple[tuple[str, str], ...]
) -> Any:
    # ``env``: the variables the client reads, so that a changed environment makes a new one.
    from obstore.store import AzureStore, GCSStore, S3Store

    settings = settings_of(spec)
    config = {k: v for k, v in settings.items() if k not in _CLIENT_KEYS}
    options: dict[str, Any] = {k: v for k, v in settings.items() if k in _CLIENT_KEYS}
    if endpoint_in(spec.scheme, settings).startswith("http://"):
        options.setdefault("allow_http", "true")
    if timeout is not None:
        options["timeout"] = timedelta(seconds=timeout)
    kinds = {"s3": S3Store, "gs": GCSStore, "az": AzureStore, "azure": AzureStore}
    kinds["abfs"] = AzureStore
    try:
        return kinds[spec.scheme](
            spec.bucket,
            config=config,
            client_options=options,
            retry_config=_RETRY if retry else {"max_retries": 0},
        )
    except Exception as err:
        raise CheckpointError(
            f"cannot configure the {spec.scheme}:// client: {redacted(str(err), spec)}",
            file=ObjectPath.of(spec.scheme, spec.bucket),
        ) from None


def failure_kind(err: BaseException) -> str:
    """What a client error means to a caller: ``changed`` (an ``If-Match`` failed),
    ``missing``, ``denied``, ``timeout``, or ``transient`` (worth a retry)."""
    from obstore.exceptions import (
        NotFoundError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    kind = getattr(err, "kind", None)  # a presigned GET's status (``_presigned.StatusError``)
    if kind in _KINDS:
        return str(kind)
    if isinstance(err, PreconditionError):
        return "changed"
    if isinstance(err, (NotFoundError, FileNotFoundError)):
        return "missing"
    if isinstance(err, (PermissionDeniedError, UnauthenticatedError)):
        return "denied"
    text = str(err)
    if "NoSuchBucket" in text or "404 Not Found" in text:
        return "missing"
    if "403 Forbidden" in text or "401 Unauthorized" in text:
        return "denied"
    if "timed out" in text.lower() or "TimedOut" in text:
        return "timeout"
    return "transient"


_KINDS = frozenset({"changed", "missing", "denied", "timeout", "transient"})

#: What a refused request's message tells the user to check, by scheme.
_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, GOOGLE_SERVICE_ACCOUNT, ...",
    "az": "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY, ...",
}


def refused(err: Exception, what: str, where: Path, spec: StoreSpec) -> CheckpointError:
    """A client error while finding or reading an object (``what``, of ``where``), as the
    checkpoint error a local file would give."""
    kind = failure_kind(err)
    why = redacted(str(err), spec)
    if kind == "missing":
        return MissingFileError(f"{what}: not found ({why})", file=where)
    if kind == "denied":
        return MissingFileError(
            f"{what}: access denied; check the credentials "
            f"({_CREDENTIALS.get(spec.scheme, 'the cloud variables')} or storage_options) ({why})",
            file=where,
        )
    if kind == "changed":
        return CheckpointError(f"{what}: the object changed while it was opened", file=where)
    return CheckpointError(f"{what}: {why}", file=where)

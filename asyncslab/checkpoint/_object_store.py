"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``), through obstore (the Python
bindings of Rust's object_store crate).

Opening lists the prefix (every page of it), reads the index if there is one and each shard's
header with ranged GETs, and applies every rule a local checkpoint gets: the header rules, the
index's path safety (a name may not leave the prefix), and each object's size against the data
end its header declares. Each object's ETag is recorded then, and every later request for it
(the headers' too) is pinned to it with ``If-Match``, and the ETag of every response is
checked too (a GCS emulator ignores ``If-Match``); where the first response names the object's
generation (GCS), every later request asks for that generation as well. An object replaced
meanwhile is refused, never read as a mix of two versions.

Credentials and endpoint come from the environment by each cloud's own conventions, and
``storage_options`` overrides them key by key (docs/object-storage.md has the table). obstore
reads most variables itself: ``AWS_*`` for ``s3://`` (``AWS_SKIP_SIGNATURE`` for public
buckets), ``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT*``, ``GOOGLE_BASE_URL``
for ``gs://``, ``AZURE_STORAGE_ACCOUNT_NAME/KEY``, ``AZURE_STORAGE_SAS_KEY``,
``AZURE_STORAGE_USE_EMULATOR`` (with ``AZURITE_BLOB_STORAGE_URL``) for ``az://``. Two that
the clouds' own SDKs read are mapped here: ``STORAGE_EMULATOR_HOST`` (a GCS emulator: its URL,
and no credentials unless some are configured, as google-cloud-storage does) and
``AZURE_STORAGE_CONNECTION_STRING`` (or a ``connection_string`` option: account, key or SAS,
endpoint). S3 requests are path-style (``endpoint/bucket/key``), which every S3 server on a
custom endpoint accepts, and an ``http://`` endpoint of any store is allowed as given. No error
raised here quotes more than the first line of the client's message, and never a configured
secret.

obstore is imported on first use only: ``import asyncslab`` does not load it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, IndexFileError, MissingFileError
from ._header import INDEX_NAME, INDEX_SUFFIX, ShardFile, TensorInfo, shard_of
from ._index import Index, check_name, choose_index, index_of_text
from ._source import ObjectLocation, ObjectPath, StoreSpec

if TYPE_CHECKING:
    from obstore import GetOptions

__all__ = [
    "Found",
    "client",
    "endpoint",
    "etag_of",
    "pinned",
    "failure_kind",
    "refused",
    "open_objects",
    "parse_uri",
    "redacted",
    "store_spec",
]

#: Bytes fetched from each object's start at open: one GET holds the header of nearly every
#: checkpoint (a larger header takes one more).
HEADER_PREFETCH = 1 << 20
#: Header GETs in flight at open.
OPEN_REQUESTS = 16
# Keys of obstore's HTTP client options (the rest of storage_options is the store's config).
_CLIENT_KEYS = frozenset(
    {
        "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
        "http1_only", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
        "proxy_ca_certificate", "proxy_excludes", "timeout", "user_agent", "read_timeout",
    }
)  # fmt: skip
# The client's own retries (before a response starts: connection errors, 5xx), kept short:
# the loader retries a body cut mid-way itself, and its read_timeout bounds a request.
_RETRY = {
    "max_retries": 3,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=2),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=30),
}
_SECRET_ENV = (
    "SECRET", "TOKEN", "PASSWORD", "ACCESS_KEY", "ACCOUNT_KEY", "MASTER_KEY", "PRIVATE_KEY",
    "SERVICE_ACCOUNT_KEY", "SAS", "SIGNATURE", "CONNECTION_STRING",
)  # fmt: skip
#: Parts of an Azure connection string that are secrets.
_CONNECTION_SECRETS = ("accountkey", "sharedaccesssignature")


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ``("s3", "bucket", "a/b")``."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise CheckpointError(f"{uri!r} names no bucket: expected {scheme}://bucket/prefix")
    return scheme, bucket, key.strip("/")


def store_spec(scheme: str, bucket: str, options: Mapping[str, object]) -> StoreSpec:
    settings = []
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, (str, bool, int, float)):
            raise TypeError(
                f"storage_options maps names to str, bool or numbers; got {key!r}: "
                f"{type(value).__name__}"
            )
        text = str(value).lower() if isinstance(value, bool) else str(value)
        settings.append((key.lower(), text))
    return StoreSpec(scheme, bucket, tuple(sorted(settings)))


def redacted(text: str, spec: StoreSpec | None = None) -> str:
    """``text``'s first line with every configured or environment secret masked."""
    line = (text.splitlines() or [""])[0]
    secrets = [] if spec is None else spec.secrets()
    secrets += [v for k, v in os.environ.items() if any(m in k.upper() for m in _SECRET_ENV)]
    connections = [v for k, v in os.environ.items() if k == "AZURE_STORAGE_CONNECTION_STRING"]
    if spec is not None and "connection_string" in spec.settings:
        connections.append(spec.settings["connection_string"])
    for connection in connections:
        parts = _connection_parts(connection)
        secrets += [v for k, v in parts.items() if k in _CONNECTION_SECRETS]
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= 4:
            line = line.replace(secret, "***")
    return line


def _endpoint(scheme: str, settings: Mapping[str, str]) -> str:
    """The URL ``settings`` (and the environment) send ``scheme``'s requests to; "" for the
    cloud's own."""
    keys = {
        "s3": ("endpoint", "aws_endpoint", "endpoint_url", "aws_endpoint_url"),
        "gs": ("base_url", "google_base_url"),
        "az": ("endpoint", "azure_storage_endpoint", "azure_endpoint"),
    }.get(scheme, ())
    for key in keys:
        if key in settings:
            return settings[key]
    variables = {
        "s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
        "gs": ("GOOGLE_BASE_URL",),
        "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
    }.get(scheme, ())
    return next((os.environ[v] for v in variables if os.environ.get(v)), "")


def endpoint(spec: StoreSpec) -> str:
    """Where ``spec``'s bucket is reached ("" for the cloud's own endpoint), for a cache key
    that must tell two servers' buckets of one name apart."""
    settings = _settings(spec)
    if spec.scheme == "az" and settings.get("use_emulator", "").lower() == "true":
        return os.environ.get("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:10000")
    return _endpoint(spec.scheme, settings)


def _settings(spec: StoreSpec) -> dict[str, str]:
    """``spec``'s settings with the variables obstore does not read mapped in."""
    settings = dict(spec.settings)
    if spec.scheme == "gs":
        return _gcs_settings(settings)
    if spec.scheme == "az":
        return _azure_settings(settings)
    return settings


#: Settings (or variables obstore reads) that give a GCS client credentials.
_GCS_CREDENTIALS = (
    "service_account", "service_account_path", "service_account_key", "application_credentials",
    "bearer_token", "google_service_account", "google_service_account_path",
    "google_service_account_key", "google_application_credentials", "google_bearer_token",
)  # fmt: skip


def _gcs_settings(settings: dict[str, str]) -> dict[str, str]:
    """``STORAGE_EMULATOR_HOST`` (google-cloud-storage's variable: ``host:port`` or a URL)
    as the base URL, unless one is configured; against an emulator a client with no
    credentials configured sends none (as google-cloud-storage does) rather than asking a
    metadata server for a token."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
    if not emulator or _endpoint("gs", settings):
        return settings
    if "://" not in emulator:
        emulator = f"http://{emulator}"
    configured = set(settings) | {k.lower() for k in os.environ if k.startswith("GOOGLE_")}
    out = {"base_url": emulator, **settings}
    if not configured & set(_GCS_CREDENTIALS):
        out.setdefault("skip_signature", "true")
    return out


def _connection_parts(text: str) -> dict[str, str]:
    """An Azure connection string's ``Name=value;`` parts, names lowercased."""
    parts = {}
    for item in text.split(";"):
        name, sep, value = item.strip().partition("=")
        if sep:
            parts[name.strip().lower()] = value.strip()
    return parts


def _azure_settings(settings: dict[str, str]) -> dict[str, str]:
    """An Azure connection string (``connection_string``, else
    ``AZURE_STORAGE_CONNECTION_STRING``) as obstore's settings; the settings given override
    its parts."""
    text = settings.pop("connection_string", None) or os.environ.get(
        "AZURE_STORAGE_CONNECTION_STRING", ""
    )
    if not text:
        return settings
    parts = _connection_parts(text)
    out: dict[str, str] = {}
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        out["use_emulator"] = "true"
    if "accountname" in parts:
        out["account_name"] = parts["accountname"]
    if "accountkey" in parts:
        out["account_key"] = parts["accountkey"]
    if "sharedaccesssignature" in parts:
        out["sas_key"] = parts["sharedaccesssignature"]
    if "blobendpoint" in parts:
        out["endpoint"] = parts["blobendpoint"]
    elif "accountname" in parts and "endpointsuffix" in parts:
        protocol = parts.get("defaultendpointsprotocol", "https")
        out["endpoint"] = f"{protocol}://{parts['accountname']}.blob.{parts['endpointsuffix']}"
    return {**out, **settings}


def client(spec: StoreSpec, timeout: float | None = None, *, retry: bool = True) -> Any:
    """The obstore store of ``spec``'s bucket (one per spec, settings and environment: a
    load's requests share its connection pool). ``timeout``: seconds a whole request (its
    body included) may take. ``retry`` False: the client retries nothing, for a caller that
    retries itself within a deadline (the client's retries would multiply its timeout)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    return _client(spec, timeout, retry, env)


_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "AZURITE_", "STORAGE_EMULATOR_HOST")


@functools.lru_cache(maxsize=64)
def _client(
    spec: StoreSpec, timeout: float | None, retry: bool, env: tuple[tuple[str, str], ...]
) -> Any:
    # ``env``: the variables the client reads, so that a changed environment makes a new one.
    from obstore.store import AzureStore, GCSStore, S3Store

    settings = _settings(spec)
    config = {k: v for k, v in settings.items() if k not in _CLIENT_KEYS}
    options: dict[str, Any] = {k: v for k, v in settings.items() if k in _CLIENT_KEYS}
    if _endpoint(spec.scheme, settings).startswith("http://"):
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

    kind = getattr(err, "kind", None)  # a presigned GET's status (loading/_presigned)
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
    """A client error while opening, as the checkpoint error a local file would give."""
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


def etag_of(meta: Mapping[str, Any]) -> str | None:
    """An object's ETag as a response header gives it (quoted): a listing of GCS or Azure
    gives it bare, and ``If-Match`` wants the quoted form."""
    etag = meta.get("e_tag")
    if etag is None:
        return None
    etag = str(etag)
    return etag if etag.startswith(('"', "W/")) else f'"{etag}"'


def pinned(location: ObjectLocation, start: int, end: int) -> GetOptions:
    """The options of a GET of bytes ``[start, end)`` of ``location`` as it was opened:
    ``If-Match`` its ETag, and its generation where one was recorded (GCS)."""
    options: GetOptions = {"range": (start, end)}
    if location.etag is not None:
        options["if_match"] = location.etag
    if location.version is not None:
        options["version"] = location.version
    return options


#: Schemes whose first response's version (a GCS object's generation) pins later requests;
#: an S3 version id needs a permission of its own (s3:GetObjectVersion) that a reader may
#: lack, and Azure honours If-Match.
_PINNED_VERSIONS = frozenset({"gs"})


class _ObjectSource:
    """One object's bytes for :func:`~._header.shard_of` (a :class:`~._source.ByteSource`):
    its first :data:`HEADER_PREFETCH` bytes fetched whole on the first read, every GET
    pinned to the ETag the listing gave (and to the generation the first response named);
    :attr:`location` is final once the first read returned."""

    def __init__(
        self, store: Any, location: ObjectLocation, path: ObjectPath, meta: Mapping[str, Any]
    ) -> None:
        self.store, self.location = store, location
        self.path: Path = path
        self.size = int(meta["size"])
        self.mtime_ns = _nanoseconds(meta.get("last_modified"))
        self._first: bytes | None = None

    def read(self, offset: int, nbytes: int) -> bytes:
        if self._first is None:
            self._first = self._get(0, min(self.size, HEADER_PREFETCH))
        if offset + nbytes <= len(self._first):
            return self._first[offset : offset + nbytes]
        return self._get(offset, offset + nbytes)

    def _get(self, start: int, end: int) -> bytes:
        import obstore

        location = self.location
        what = f"reading bytes {start}-{end - 1}"
        try:
            result = obstore.get(self.store, location.key, options=pinned(location, start, end))
            meta = result.meta
            data = bytes(result.bytes())
        except Exception as err:
            if location.version is not None and failure_kind(err) == "missing":
                raise self._changed(what, None) from None  # that generation is gone
            raise refused(err, what, self.path, location.store) from None
        got = etag_of(meta)
        if location.etag is not None and got is not None and got != location.etag:
            raise self._changed(what, got)
        version = meta.get("version")
        if location.version is None and version and location.store.scheme in _PINNED_VERSIONS:
            self.location = dataclasses.replace(location, version=str(version))
        if len(data) != end - start:
            raise CheckpointError(
                f"{what}: got {len(data)} bytes (object truncated?)",
                file=self.path,
                expected=end - start,
                got=len(data),
            )
        return data

    def _changed(self, what: str, got: str | None) -> CheckpointError:
        now = "is gone" if got is None else f"now has ETag {got}"
        return CheckpointError(
            f"{what}: the object changed while it was opened (ETag {self.location.etag} "
            f"listed, it {now})",
            file=self.path,
        )


@dataclass(frozen=True, slots=True)
class Found:
    """An object-store checkpoint's pieces, for :class:`~._format.Checkpoint`."""

    root: ObjectPath
    shards: Sequence[tuple[ShardFile, list[TensorInfo]]]
    index_path: ObjectPath | None
    index: Index | None
    index_files: Mapping[str, Path]


def _listing(store: Any, spec: StoreSpec, prefix: str) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (all pages), by key."""
    import obstore

    where = ObjectPath.of(spec.scheme, spec.bucket, prefix)
    try:
        pages = obstore.list(store, prefix + "/" if prefix else None, chunk_size=1000)
        return {meta["path"]: dict(meta) for page in pages for meta in page}
    except Exception as err:
        raise refused(err, f"listing bucket {spec.bucket!r}", where, spec) from None


def _head(store: Any, spec: StoreSpec, key: str) -> dict[str, Any]:
    import obstore

    try:
        return dict(obstore.head(store, key))
    except Exception as err:
        where = ObjectPath.of(spec.scheme, spec.bucket, key)
        raise refused(err, "no such object", where, spec) from None


def open_objects(uri: str, storage_options: Mapping[str, object]) -> Found:
    """The checkpoint at ``uri``: a prefix (its ``*.safetensors`` and index), an index, or
    one object."""
    try:
        import obstore  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"opening {uri} needs obstore, the object-store client: pip install 'asyncslab[s3]'"
        ) from err
    scheme, bucket, key = parse_uri(uri)
    if scheme == "azure" or scheme == "abfs":
        scheme = "az"
    spec = store_spec(scheme, bucket, storage_options)
    store = client(spec)
    if key.endswith(".json") and not key.endswith(INDEX_SUFFIX):
        raise CheckpointError(
            f"{uri} is a JSON object, not a safetensors file: open a .safetensors object, an "
            "index (*.safetensors.index.json) or the checkpoint's prefix",
            file=ObjectPath.of(scheme, bucket, key),
        )
    if key.endswith(".safetensors"):
        metas = {key: _head(store, spec, key)}
        return _of_objects(store, spec, _parent(key), [key], metas, None)
    if key.endswith(INDEX_SUFFIX):
        prefix = _parent(key)
        metas = _listing(store, spec, prefix)
        if key not in metas:
            metas[key] = _head(store, spec, key)  # raises: the index is not there
        return _of_objects(store, spec, prefix, [], metas, key)
    metas = _listing(store, spec, key)
    root = ObjectPath.of(scheme, bucket, key)
    if not metas:
        try:  # one object named without its suffix?
            metas = {key: _head(store, spec, key)} if key else {}
        except MissingFileError:
            pass
        if not metas:
            raise MissingFileError("no *.safetensors objects and no index", file=root)
        return _of_objects(store, spec, _parent(key), [key], metas, None)
    children = sorted(k for k in metas if "/" not in k[len(key) + 1 if key else 0 :])
    names = [k.rpartition("/")[2] for k in children]
    index_key = None
    if INDEX_NAME in names:
        index_key = _join(key, INDEX_NAME)
    else:
        others = [n for n in names if n.endswith(INDEX_SUFFIX) and not n.startswith(".")]
        chosen = choose_index(others, root)
        index_key = None if chosen is None else _join(key, chosen)
    if index_key is not None:
        return _of_objects(store, spec, key, [], metas, index_key)
    shards = [k for k, n in zip(children, names, strict=True) if n.endswith(".safetensors")]
    if not shards:
        raise MissingFileError("no *.safetensors objects and no index", file=root)
    return _of_objects(store, spec, key, shards, metas, None)


def _parent(key: str) -> str:
    return key.rpartition("/")[0]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _of_objects(
    store: Any,
    spec: StoreSpec,
    prefix: str,
    keys: list[str],
    metas: Mapping[str, Mapping[str, Any]],
    index_key: str | None,
) -> Found:
    root = ObjectPath.of(spec.scheme, spec.bucket, prefix)
    paths = {k: ObjectPath.of(spec.scheme, spec.bucket, k) for k in keys}
    index = None
    index_path = None
    index_files: dict[str, Path] = {}
    if index_key is not None:
        index_path = ObjectPath.of(spec.scheme, spec.bucket, index_key)
        source = _source(store, spec, index_key, metas[index_key])
        text = _index_text(source)
        index = index_of_text(text, index_path, lambda: _index_text(source))
        keys = []
        for name in dict.fromkeys(index.files):
            key = _join(prefix, str(check_name(root, name, index_path)))
            if key in paths:
                raise IndexFileError(
                    f"{_named(index_files, paths[key])!r} and {name!r} name the same object",
                    file=index_path,
                )
            if key not in metas:
                raise MissingFileError(
                    f"object does not exist (the index {index_path} names {name!r})",
                    file=ObjectPath.of(spec.scheme, spec.bucket, key),
                )
            paths[key] = ObjectPath.of(spec.scheme, spec.bucket, key)
            index_files[name] = paths[key]
            keys.append(key)
    sources = [_source(store, spec, k, metas[k], paths[k]) for k in keys]
    return Found(root, _headers(sources), index_path, index, index_files)


def _named(index_files: Mapping[str, Path], path: Path) -> str:
    return next(name for name, p in index_files.items() if p is path)


def _source(
    store: Any,
    spec: StoreSpec,
    key: str,
    meta: Mapping[str, Any],
    path: ObjectPath | None = None,
) -> _ObjectSource:
    location = ObjectLocation(spec, key, etag_of(meta), meta.get("version"))
    path = path or ObjectPath.of(spec.scheme, spec.bucket, key)
    return _ObjectSource(store, location, path, meta)


def _index_text(source: _ObjectSource) -> str:
    try:
        return source.read(0, source.size).decode("utf-8")
    except UnicodeDecodeError as err:
        raise IndexFileError(f"cannot read index: {err}", file=source.path) from err


def _headers(sources: Sequence[_ObjectSource]) -> list[tuple[ShardFile, list[TensorInfo]]]:
    """Every source's header, :data:`OPEN_REQUESTS` at a time (each waits a round trip; the
    client releases the GIL while it waits)."""
    if len(sources) <= 1:
        return [_header(s) for s in sources]
    workers = min(OPEN_REQUESTS, len(sources))
    with concurrent.futures.ThreadPoolExecutor(workers, "asyncslab-open") as pool:
        return list(pool.map(_header, sources))


def _header(source: _ObjectSource) -> tuple[ShardFile, list[TensorInfo]]:
    shard, tensors = shard_of(source, inode=0, mtime_ns=source.mtime_ns)
    # The location as the reads left it (pinned to the generation they found).
    return dataclasses.replace(shard, source=source.location), tensors


def _nanoseconds(when: datetime | None) -> int:
    return 0 if when is None else int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000

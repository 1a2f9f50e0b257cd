"""A bucket's settings as its client takes them, and the secrets no message may show.

Credentials and endpoint come from the environment by each cloud's own conventions, and
``storage_options`` overrides them key by key (docs/object-storage.md has the table). obstore
reads most variables itself: ``AWS_*`` for ``s3://`` (``AWS_SKIP_SIGNATURE`` for public
buckets), ``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT*``, ``GOOGLE_BASE_URL``
for ``gs://``, ``AZURE_STORAGE_ACCOUNT_NAME/KEY``, ``AZURE_STORAGE_SAS_KEY``,
``AZURE_STORAGE_USE_EMULATOR`` (with ``AZURITE_BLOB_STORAGE_URL``) for ``az://``. Two that
the clouds' own SDKs read are mapped here: ``STORAGE_EMULATOR_HOST`` (a GCS emulator: its URL,
and no credentials unless some are configured, as google-cloud-storage does) and
``AZURE_STORAGE_CONNECTION_STRING`` (or a ``connection_string`` option: account, key or SAS,
endpoint).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._location import StoreSpec

__all__ = ["endpoint", "endpoint_in", "redacted", "settings_of"]

_SECRET_ENV = (
    "SECRET", "TOKEN", "PASSWORD", "ACCESS_KEY", "ACCOUNT_KEY", "MASTER_KEY", "PRIVATE_KEY",
    "SERVICE_ACCOUNT_KEY", "SAS", "SIGNATURE", "CONNECTION_STRING",
)  # fmt: skip
#: Parts of an Azure connection string that are secrets.
_CONNECTION_SECRETS = ("accountkey", "sharedaccesssignature")
#: Settings (or variables obstore reads) that give a GCS client credentials.
_GCS_CREDENTIALS = (
    "service_account", "service_account_path", "service_account_key", "application_credentials",
    "bearer_token", "google_service_account", "google_service_account_path",
    "google_service_account_key", "google_application_credentials", "google_bearer_token",
)  # fmt: skip


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


def endpoint_in(scheme: str, settings: Mapping[str, str]) -> str:
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
    settings = settings_of(spec)
    if spec.scheme == "az" and settings.get("use_emulator", "").lower() == "true":
        return os.environ.get("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:10000")
    return endpoint_in(spec.scheme, settings)


def settings_of(spec: StoreSpec) -> dict[str, str]:
    """``spec``'s settings with the variables obstore does not read mapped in."""
    settings = dict(spec.settings)
    if spec.scheme == "gs":
        return _gcs_settings(settings)
    if spec.scheme == "az":
        return _azure_settings(settings)
    return settings


def _gcs_settings(settings: dict[str, str]) -> dict[str, str]:
    """``STORAGE_EMULATOR_HOST`` (google-cloud-storage's variable: ``host:port`` or a URL)
    as the base URL, unless one is configured; against an emulator a client with no
    credentials configured sends none (as google-cloud-storage does) rather than asking a
    metadata server for a token."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
    if not emulator or endpoint_in("gs", settings):
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

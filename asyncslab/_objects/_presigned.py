"""Ranged GETs whose bodies land straight in the caller's memory: the fast path for
``s3://`` and ``az://`` (``LoadOptions.presigned_gets``).

obstore collects each response body into a buffer of its own, which a load then copies
into its slots: two copies in user space, and a fresh 8 MiB allocation per request. On a
two-core server that client work cost 3.7x the CPU of reading the same bytes with the
standard library's ``http.client`` (docs/performance.md has the figures). So here obstore
only signs: it turns its credentials, whatever their source, into a presigned URL per object
(S3's query-string signature, an Azure SAS), and ``http.client`` makes the GET on a
keep-alive connection of the I/O thread's own, reading the body with ``readinto`` into the
caller's memory (a load's slots, or its thread's staging buffer), so that the kernel copies
each byte once, out of the socket into its final place.

What a GET through obstore checks, this checks too: the request is pinned with ``If-Match``
to the ETag recorded at open, and the response's status, ETag, and length are checked
before a byte of its body is read. Failures are classed as obstore's are
(:func:`~._client.failure_kind`: ``kind``), so the retries, timeouts and errors of
:func:`~._get.fetch` apply unchanged; no error quotes a URL (it holds a signature).

Where requests go unsigned (``skip_signature``), a store cannot sign (no signing
credentials), or the connection needs what ``http.client`` lacks (a proxy, invalid
certificates accepted, HTTP/2 only), the load reads through obstore instead. GCS is not
signed for: obstore's GCS signer needs a service account's key or the instance's metadata
server, and the tests' emulator offers neither, so no test could check it.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._location import ObjectLocation

__all__ = ["Connections", "StatusError", "Signer", "get_into", "presigns", "signer_of"]

#: Schemes signed for (see the module's docstring).
SIGNED_SCHEMES = frozenset({"s3", "az"})
#: A presigned URL's lifetime, and its age when the next request signs a new one: a GET
#: begun just before renewal still has most of an hour.
_LIFETIME = timedelta(hours=1)
_RENEW_S = 15 * 60.0
# storage_options the standard library's client does not honour: their loads go through
# obstore, which does.
_OBSTORE_ONLY = frozenset(
    {"proxy_url", "proxy_ca_certificate", "proxy_excludes", "allow_invalid_certificates",
     "http2_only"}
)  # fmt: skip
_PROXY_ENV = ("http_proxy", "https_proxy", "all_proxy")
#: Bytes of an error response's body read for its error code (S3's and Azure's are short XML).
_ERROR_BODY = 4096


class StatusError(Exception):
    """A GET answered with an unexpected status; ``kind`` as :func:`failure_kind` classes it."""

    def __init__(self, status: int, reason: str, code: str | None) -> None:
        detail = f" ({code})" if code else ""
        super().__init__(f"{status} {reason}{detail}")
        self.status = status
        if status == 412:
            self.kind = "changed"
        elif status == 404:
            self.kind = "missing"
        elif status in (401, 403):
            self.kind = "denied"
        else:
            self.kind = "transient"


@dataclass(frozen=True, slots=True)
class _Url:
    https: bool
    host: str
    port: int | None
    target: str  # path and query: what the request line names
    signed_at: float


class Signer:
    """Presigned GET URLs of one store's objects, each renewed once it is :data:`_RENEW_S`
    old; shared by a load's I/O threads, which sign (a credential provider may make a
    request of its own: never on the event loop)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._urls: dict[str, _Url] = {}
        self._lock = threading.Lock()
        self._first = threading.Lock()  # a key's first signing, one thread at a time
        self._refused = False

    def signs(self, key: str) -> bool:
        """Whether GETs of ``key`` go through presigned URLs: False, for the rest of the
        load, once the store could not sign (no signing credentials), found by one attempt
        however many threads ask at once."""
        if self._refused:
            return False
        if key in self._urls:
            return True
        with self._first:
            if not self._refused and key not in self._urls:
                try:
                    self.url(key)
                except Exception:  # noqa: BLE001 - obstore reads with what credentials it has
                    self._refused = True
        return not self._refused

    def url(self, key: str) -> _Url:
        now = time.monotonic()
        with self._lock:
            url = self._urls.get(key)
        if url is None or now - url.signed_at > _RENEW_S:
            url = _signed(self._store, key, now)
            with self._lock:
                self._urls[key] = url
        return url


def _signed(store: Any, key: str, now: float) -> _Url:
    import obstore

    parts = urllib.parse.urlsplit(obstore.sign(store, "GET", key, _LIFETIME))
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return _Url(parts.scheme == "https", parts.hostname or "", parts.port, target, now)


def signer_of(location: ObjectLocation, store: Any) -> Signer | None:
    """A :class:`Signer` for ``location``'s store, or None where its GETs go through obstore
    (see the module's docstring). Signs nothing yet: see :meth:`Signer.signs`."""
    return Signer(store) if presigns(location) else None


def presigns(location: ObjectLocation) -> bool:
    """Whether ``location``'s GETs are to be presigned (see the module's docstring); a store
    that turns out unable to sign still sends them through obstore (:meth:`Signer.signs`)."""
    if location.store.scheme not in SIGNED_SCHEMES:
        return False
    settings = location.store.settings
    if any(key in _OBSTORE_ONLY for key in settings):
        return False
    # Unsigned requests: obstore would look for credentials to sign with (on S3, from the
    # instance's metadata server where none are configured).
    variable = {"s3": "AWS_SKIP_SIGNATURE", "az": "AZURE_SKIP_SIGNATURE"}[location.store.scheme]
    skips = [v for k, v in settings.items() if k.endswith("skip_signature")]
    if any(v.lower() in ("true", "1") for v in skips or [os.environ.get(variable, "")]):
        return False
    return not any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_ENV)


class Connections:
    """One keep-alive connection per I/O thread, (re)opened on first use and after a failed
    GET (a body half read leaves the connection unusable); :meth:`close` once the threads
    drained."""

    def __init__(self, workers: int) -> None:
        self._open: list[http.client.HTTPConnection | None] = [None] * workers
        self._context: ssl.SSLContext | None = None

    def get(self, worker: int, url: _Url, timeout: float | None) -> http.client.HTTPConnection:
        conn = self._open[worker]
        if conn is not None and (conn.host, conn.port) != (url.host, _port(url)):
            conn.close()
            conn = None
        if conn is None:
            if url.https:
                if self._context is None:
                    self._context = ssl.create_default_context()
                conn = http.client.HTTPSConnection(
                    url.host, url.port, timeout=timeout, context=self._context
                )
            else:
                conn = http.client.HTTPConnection(url.host, url.port, timeout=timeout)
            self._open[worker] = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def drop(self, worker: int) -> None:
        conn, self._open[worker] = self._open[worker], None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for worker in range(len(self._open)):
            self.drop(worker)


def _port(url: _Url) -> int:
    return url.port or (443 if url.https else 80)


def get_into(
    connections: Connections,
    worker: int,
    signer: Signer,
    location: ObjectLocation,
    offset: int,
    regions: Sequence[tuple[int, int]],
    timeout: float | None,
) -> str | None:
    """One attempt: bytes from ``offset`` of ``location``'s object, read in order into
    ``regions`` (``(address, nbytes)`` pairs, the caller's memory kept alive), with one GET
    pinned to its ETag (``timeout``: the seconds the whole attempt may take). Returns the
    response's ETag. Raises :class:`StatusError`, ``OSError`` (a timeout included) or
    :class:`http.client.HTTPException` (a body cut short)."""
    nbytes = sum(size for _, size in regions)
    headers = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
    if location.etag is not None:
        headers["If-Match"] = location.etag
    url = signer.url(location.key)
    deadline = None if timeout is None else time.monotonic() + timeout
    conn = connections.get(worker, url, timeout)
    response: http.client.HTTPResponse | None = None
    try:
        if conn.sock is None:
            conn.connect()
        # Held here: a response that closes its connection takes the socket from it.
        sock = conn.sock
        conn.request("GET", url.target, headers=headers)
        response = conn.getresponse()
        etag = _checked_head(response, nbytes)
        if location.etag is not None and etag is not None and etag != location.etag:
            _close(connections, worker, response)  # its body unread
            return etag  # the caller refuses it
        _read_body(response, sock, regions, deadline, timeout)
        response.close()  # every byte of its length read: the connection is free again
        return etag
    except BaseException:
        _close(connections, worker, response)
        raise


def _checked_head(response: http.client.HTTPResponse, nbytes: int) -> str | None:
    """The ETag of a response whose status and length are those of the range asked for."""
    if response.status != 206:
        code = _error_code(response.read(_ERROR_BODY))
        if response.status == 200:
            code = "the server ignored the Range header"
        raise StatusError(response.status, response.reason, code)
    length = response.getheader("Content-Length")
    if length is None or int(length) != nbytes:
        raise http.client.IncompleteRead(b"", nbytes)
    return response.getheader("ETag")


def _read_body(
    response: http.client.HTTPResponse,
    sock: Any,
    regions: Sequence[tuple[int, int]],
    deadline: float | None,
    timeout: float | None,
) -> None:
    """The body, into ``regions`` in order, by the response's own reader, past
    http.client's length bookkeeping: its readinto1 makes one receive at most, so that the
    attempt's deadline is looked at between any two (readinto would wait for a whole piece,
    however slowly it came)."""
    body = response.fp
    for address, size in regions:
        view = _view(address, size)
        got = 0
        while got < size:
            if deadline is not None:  # the socket's limit is per wait: the body's, whole
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out: the body took over {timeout:.3g} s")
                sock.settimeout(left)
            n = body.readinto1(view[got:])
            if not n:
                raise http.client.IncompleteRead(b"", size - got)
            got += n


def _view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``address``; the caller keeps the owner alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _close(
    connections: Connections, worker: int, response: http.client.HTTPResponse | None
) -> None:
    # A response that will close its connection (``Connection: close``) holds the socket
    # itself, not the connection: closing only the connection would leave it open.
    if response is not None:
        response.close()
    connections.drop(worker)


def _error_code(body: bytes) -> str | None:
    """The ``<Code>`` of an S3 or Azure error body."""
    start = body.find(b"<Code>")
    end = body.find(b"</Code>", start)
    if start < 0 or end < 0:
        return None
    return body[start + 6 : end].decode("ascii", "replace")[:64]

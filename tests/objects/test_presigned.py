"""A presigned GET's own rules (``_objects/_presigned``), against a small HTTP server of the
test's own: what a real store will not do on demand. The loads through real stores are in
``tests/loading/test_object_store_load.py``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncslab._objects import ObjectLocation, StoreSpec
from asyncslab._objects._presigned import Connections, Signer, StatusError, _Url, get_into

ETAG = '"v1"'


class _Server:
    """Answers every GET on 127.0.0.1 with ``head`` then ``body``, ``step`` bytes at a time
    with ``pause`` seconds between them; :meth:`stop` ends every connection."""

    def __init__(self, head: bytes, body: bytes, step: int, pause: float) -> None:
        self.head, self.body, self.step, self.pause = head, body, step, pause
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.05)
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)  # the request
                try:
                    conn.sendall(self.head)
                    for at in range(0, len(self.body), self.step):
                        if self.stopped.wait(self.pause):
                            return
                        conn.sendall(self.body[at : at + self.step])
                except OSError:  # the client gave up
                    continue

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.listener.close()


def _head(status: str, length: int, etag: str = ETAG) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Length: {length}\r\nETag: {etag}\r\n\r\n").encode()


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[_Server] = []

    def start(head: bytes, body: bytes, step: int = 1 << 20, pause: float = 0.0) -> _Server:
        servers.append(_Server(head, body, step, pause))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _get(port: int, nbytes: int, timeout: float | None) -> tuple[str | None, torch.Tensor]:
    spec = StoreSpec("s3", "models")
    location = ObjectLocation(spec, "m/x.safetensors", ETAG)
    signer = Signer(store=None)
    signer._urls["m/x.safetensors"] = _Url(False, "127.0.0.1", port, "/models/x?sig", 1e18)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    half = nbytes // 2
    regions = ((out.data_ptr(), half), (out.data_ptr() + half, nbytes - half))
    connections = Connections(1)
    try:
        return get_into(connections, 0, signer, location, 0, regions, timeout), out
    finally:
        connections.close()


def test_a_body_lands_in_its_regions_in_order(serve: Any) -> None:
    body = bytes(range(256)) * 64
    server = serve(_head("206 Partial Content", len(body)), body, step=1000)
    etag, out = _get(server.port, len(body), timeout=30.0)
    assert etag == ETAG
    assert bytes(out.numpy()) == body


def test_a_body_that_trickles_past_the_attempts_limit_times_out(serve: Any) -> None:
    """The limit is the whole attempt's, not each wait's: a server sending a byte every
    10 ms never waits long, yet 64 KiB at that pace cannot come within 0.5 s."""
    body = b"x" * (64 << 10)
    server = serve(_head("206 Partial Content", len(body)), body, step=1, pause=0.01)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        _get(server.port, len(body), timeout=0.5)
    assert time.monotonic() - began < 30  # a hang guard: the attempt ended


@pytest.mark.parametrize(
    ("status", "kind"),
    [(412, "changed"), (404, "missing"), (403, "denied"), (401, "denied"), (503, "transient")],
)
def test_a_status_is_classed_as_obstore_errors_are(serve: Any, status: int, kind: str) -> None:
    error = b"<Error><Code>SomeCode</Code><Message>no</Message></Error>"
    server = serve(_head(f"{status} Nope", len(error)), error)
    with pytest.raises(StatusError) as err:
        _get(server.port, 16, timeout=30.0)
    assert err.value.kind == kind
    assert str(err.value) == f"{status} Nope (SomeCode)"


def test_a_server_ignoring_the_range_or_sending_another_length_is_refused(serve: Any) -> None:
    whole = serve(_head("200 OK", 64), b"y" * 64)
    with pytest.raises(StatusError, match="ignored the Range header"):
        _get(whole.port, 16, timeout=30.0)
    longer = serve(_head("206 Partial Content", 32), b"y" * 32)
    with pytest.raises(Exception, match="IncompleteRead"):
        _get(longer.port, 16, timeout=30.0)


def test_another_versions_etag_is_returned_and_its_body_not_read(serve: Any) -> None:
    server = serve(_head("206 Partial Content", 16, etag='"v2"'), b"z" * 16)
    etag, out = _get(server.port, 16, timeout=30.0)
    assert etag == '"v2"'
    assert not out.any()

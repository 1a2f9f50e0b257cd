"""Shared fixtures. Every ``@pytest.mark.asyncio`` test runs under the default asyncio loop
and, where installed, uvloop — servers await asyncslab from either."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from asyncslab.testing import SyntheticCheckpoint, SyntheticSpec, write_synthetic
from support.object_servers import AzuriteServer, GcsServer
from support.s3server import SeaweedServer, upload

_Server = TypeVar("_Server", SeaweedServer, GcsServer, AzuriteServer)

try:
    import uvloop
except ImportError:  # pragma: no cover - platforms without uvloop
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # vLLM in processes of its own takes minutes: not in the fast tier
        if "vllm" in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """A small tiered MoE checkpoint (3 shards, experts straddling them). Read-only."""
    return write_synthetic(tmp_path_factory.mktemp("moe"), SyntheticSpec())


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCheckpoint:
    """~300 KB, three shards, experts straddling them: a load is dozens of small reads.
    Read-only."""
    spec = SyntheticSpec(n_layers=3, n_experts=4, hidden=64, intermediate=32, vocab=128)
    return write_synthetic(tmp_path_factory.mktemp("small"), spec)


@pytest.fixture
def fresh_moe(tmp_path: Path) -> SyntheticCheckpoint:
    """A checkpoint the test may damage."""
    return write_synthetic(tmp_path / "ckpt", SyntheticSpec())


def _running(server: _Server) -> Iterator[_Server]:
    """``server`` started, then stopped when the session ends."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A real S3 server (SeaweedFS on 127.0.0.1) for the session; a server that cannot
    start fails the tests that need it, it never skips them."""
    yield from _running(SeaweedServer(tmp_path_factory.mktemp("seaweedfs")))


@pytest.fixture(scope="session")
def s3_small(s3_server: SeaweedServer, small_checkpoint: SyntheticCheckpoint) -> str:
    """``small_checkpoint`` (three shards and an index) uploaded: its URI. Read-only."""
    upload(s3_server.store(), "small", small_checkpoint.root)
    return "s3://models/small"


@pytest.fixture(scope="session")
def gs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """fake-gcs-server on 127.0.0.1 for the session (``support/object_servers.py``)."""
    yield from _running(GcsServer(tmp_path_factory.mktemp("fake-gcs")))


@pytest.fixture(scope="session")
def az_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    """Azurite's blob service on 127.0.0.1 for the session (``support/object_servers.py``)."""
    yield from _running(AzuriteServer(tmp_path_factory.mktemp("azurite")))


ObjectServer = SeaweedServer | GcsServer | AzuriteServer


@pytest.fixture(params=["s3", "gs", "az"])
def object_server(request: pytest.FixtureRequest) -> ObjectServer:
    """Each store in turn: SeaweedFS (``s3://``), fake-gcs-server (``gs://``), Azurite
    (``az://``), each started once for the session."""
    server: ObjectServer = request.getfixturevalue(f"{request.param}_server")
    return server


_UPLOADED: set[tuple[str, str]] = set()


@pytest.fixture
def object_small(object_server: ObjectServer, small_checkpoint: SyntheticCheckpoint) -> str:
    """``small_checkpoint`` uploaded to ``object_server`` (once per session): its URI.
    Read-only."""
    if (object_server.endpoint, "small") not in _UPLOADED:
        for path in sorted(small_checkpoint.root.rglob("*")):
            if path.is_file():
                key = f"small/{path.relative_to(small_checkpoint.root).as_posix()}"
                object_server.put(key, path.read_bytes())
        _UPLOADED.add((object_server.endpoint, "small"))
    return f"{object_server.scheme}://models/small"

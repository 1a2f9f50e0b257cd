"""Loads from object storage against the real stores the tests start (SeaweedFS, and where
the behaviour is the store's, fake-gcs-server and Azurite too), faults through the proxy of
``support/s3server.py``: bit-exact slabs, the bytes in flight bounded, every GET pinned to the
version opened, progress, readiness, reload in place, and every fault a clear error with
nothing left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save

import asyncslab
from asyncslab import Checkpoint, LoadOptions, Plan, SlabSet, load
from asyncslab.errors import FileChangedError, IncompleteLoadError, ReadError, ReadTimeoutError
from asyncslab.testing import SyntheticCheckpoint
from support.object_servers import AZURE_ACCOUNT, PUBLIC_CONTAINER, SIGNED_QUERY, AzuriteServer
from support.s3server import Fault, FaultProxy, Request, SeaweedServer
from tests.conftest import ObjectServer
from tests.helpers import assert_units_all_or_nothing, until, wait_io_threads_gone

pytestmark = pytest.mark.asyncio

SMALL = LoadOptions(request_size=4096, request_concurrency=4, coalesce_gap=0)


def _payload(request: Request) -> bool:
    """A GET of payload bytes (headers lie in the first KiB of these small shards)."""
    return request.method == "GET" and request.range is not None and request.range[0] > 4096


def _open(server: ObjectServer, uri: str, endpoint: str | None = None) -> Checkpoint:
    return Checkpoint.open(uri, storage_options=server.options(endpoint))


@pytest.fixture
def proxied(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint
) -> Iterator[tuple[FaultProxy, Checkpoint, Plan]]:
    """``object_small`` opened through a fault-injecting proxy, and planned (each store)."""
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, object_small, proxy.endpoint)
        yield proxy, ckpt, asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)


@pytest.fixture
def proxied_s3(
    s3_server: SeaweedServer, s3_small: str, small_checkpoint: SyntheticCheckpoint
) -> Iterator[tuple[FaultProxy, Checkpoint, Plan]]:
    """``s3_small`` opened through a fault-injecting proxy, and planned: for the loader's
    own behaviour (cancellation, closing), the same whatever the store."""
    with FaultProxy(s3_server.endpoint) as proxy:
        ckpt = _open(s3_server, s3_small, proxy.endpoint)
        yield proxy, ckpt, asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)


@pytest.fixture(params=["presigned", "obstore"])
def gets(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a load makes its GETs (``_objects/_presigned``): presigned URLs read straight
    into the slots where the store signs (``s3://``, ``az://``), or obstore, forced here."""
    from asyncslab._objects import _get

    if request.param == "obstore":
        monkeypatch.setattr(_get, "signer_of", lambda location, store: None)
    return str(request.param)


def _bit_exact(slabs: SlabSet, local: SyntheticCheckpoint) -> None:
    complete, incomplete = assert_units_all_or_nothing(slabs, Checkpoint.open(local.root))
    assert (complete, incomplete) == (len(slabs.plan.units), 0)


async def test_a_load_from_each_store_lands_bit_exact_direct_and_staged(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    ckpt = _open(object_server, object_small)
    p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
    for transfer in ("auto", "staged"):
        options = LoadOptions(request_size=8192, request_concurrency=3, transfer=transfer)
        async with await load(ckpt, p, options=options) as slabs:
            _bit_exact(slabs, small_checkpoint)
            stats = slabs.statistics()
            assert stats.transfer == "remote"
            assert stats.bytes_landed == stats.bytes_needed == p.nbytes
            assert (stats.staging_budget > 0) == (transfer == "staged")
    assert await wait_io_threads_gone() == []


async def test_requests_are_bounded_by_size_and_concurrency_and_pinned_to_the_version(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, object_small, proxy.endpoint)
        p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
        async with await load(ckpt, p, options=SMALL) as slabs:
            _bit_exact(slabs, small_checkpoint)
        gets = proxy.matching(_payload)
        sources = {("models", f.source.key): f.source for f in ckpt.files if f.source}
        assert gets
        for request in gets:
            assert request.range is not None
            first, last = request.range
            assert last - first + 1 <= SMALL.request_size
            source = sources[object_server.key_of(request)]
            assert request.headers["if-match"] == source.etag
            # GCS: the generation the open found (fake-gcs-server ignores If-Match).
            if object_server.scheme == "gs":
                assert object_server.pin_of(request) == source.version is not None
        assert proxy.most_open <= SMALL.request_concurrency + 1  # + the open's own
        # Responses of one size, so that each I/O thread can reuse the one it freed (see
        # _strategy_remote): each shard's payload is one run, cut at exactly request_size.
        sizes: dict[tuple[str, str] | None, list[tuple[int, int]]] = {}
        for request in gets:
            assert request.range is not None
            first, last = request.range
            sizes.setdefault(object_server.key_of(request), []).append((first, last - first + 1))
        for reads in sizes.values():
            *full, (_, final) = sorted(reads)
            assert [n for _, n in full] == [SMALL.request_size] * len(full)
            assert 0 < final <= SMALL.request_size


async def test_s3_and_azure_gets_are_presigned_and_their_bodies_land_without_a_copy(
    object_server: ObjectServer,
    object_small: str,
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the store signs, each payload GET names a presigned URL and carries no
    credentials of its own, and onto the CPU its body is read straight into the slots: no
    obstore GET, no copy. ``gs://``, and ``presigned_gets=False``, go through obstore."""
    import obstore

    from asyncslab.loading import _copy

    obstore_gets: list[str] = []
    copies: list[int] = []
    real_get, real_copy = obstore.get, _copy.host_copy

    def spied_get(store: object, key: str, *, options: Any = None) -> Any:
        obstore_gets.append(key)
        return real_get(store, key, options=options)  # type: ignore[arg-type]

    def spied_copy(dst: int, src: int, nbytes: int) -> None:
        copies.append(nbytes)
        real_copy(dst, src, nbytes)

    monkeypatch.setattr(obstore, "get", spied_get)
    monkeypatch.setattr(_copy, "host_copy", spied_copy)
    signed = SIGNED_QUERY.get(object_server.scheme)
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, object_small, proxy.endpoint)
        p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
        for presigned in (True, False):
            obstore_gets.clear()
            copies.clear()
            proxy.requests.clear()
            options = dataclasses.replace(SMALL, presigned_gets=presigned)
            async with await load(ckpt, p, options=options) as slabs:
                _bit_exact(slabs, small_checkpoint)
            payload = proxy.matching(_payload)
            assert payload
            if presigned and signed is not None:
                assert all(signed in r.query and "authorization" not in r.headers for r in payload)
                assert obstore_gets == []
                assert copies == []
            else:
                assert not any(signed and signed in r.query for r in payload)
                assert len(obstore_gets) >= len(payload)
                assert sum(copies) == p.nbytes


async def test_a_store_that_cannot_sign_is_read_through_obstore(
    az_server: AzuriteServer, small_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An anonymous reader of a public container (``skip_signature``), an ``HTTPS_PROXY``
    the standard library's client would not use, and a store whose signing fails (no
    signing credentials; tried once a load): each load goes through obstore, bit-exact."""
    import obstore

    for path in sorted(small_checkpoint.root.rglob("*")):
        if path.is_file():
            key = f"unsigned/{path.relative_to(small_checkpoint.root).as_posix()}"
            for bucket in (PUBLIC_CONTAINER, "models"):
                az_server.put(key, path.read_bytes(), bucket=bucket)
    anonymous = {
        "skip_signature": True,
        "account_name": AZURE_ACCOUNT,
        "endpoint": f"{az_server.endpoint}/{AZURE_ACCOUNT}",
    }
    signs: list[str] = []
    real_sign = obstore.sign

    def refusing(store: Any, method: str, paths: Any, expires_in: Any) -> Any:
        signs.append(str(paths))
        raise obstore.exceptions.GenericError("no signing credentials")

    with az_server.proxy() as proxy:
        endpoint = {"endpoint": f"{proxy.endpoint}/{AZURE_ACCOUNT}"}
        public = Checkpoint.open(
            f"az://{PUBLIC_CONTAINER}/unsigned", storage_options={**anonymous, **endpoint}
        )
        private = _open(az_server, "az://models/unsigned", proxy.endpoint)
        for ckpt, why in ((public, "anonymous"), (private, "proxy"), (private, "unsigned")):
            with monkeypatch.context() as patch:
                if why == "proxy":
                    patch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
                if why == "unsigned":
                    patch.setattr(obstore, "sign", refusing)
                proxy.requests.clear()
                p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
                async with await load(ckpt, p, options=SMALL) as slabs:
                    _bit_exact(slabs, small_checkpoint)
            payload = proxy.matching(_payload)
            assert payload
            assert not any(SIGNED_QUERY["az"] in r.query for r in payload)
    assert len(signs) == 1  # the store could not sign: not asked again in that load
    assert real_sign is obstore.sign


class _Responses:
    """obstore's ranged GETs of a load, spied on: each response's body handed over as an
    object whose lifetime can be watched, and what each I/O thread still held when its next
    response's headers came, and when its body was collected."""

    class Body(bytearray):  # a subclass: bytearray itself takes no weak references
        pass

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import obstore

        self.alive: list[weakref.ref[_Responses.Body]] = []
        self.at_headers: list[bool] = []  # the thread's previous body alive: one per GET
        self.at_body: list[bool] = []
        self._last: dict[int, weakref.ref[_Responses.Body]] = {}
        self._lock = threading.Lock()
        get = obstore.get

        def spied(store: object, key: str, *, options: object = None) -> object:
            result = get(store, key, options=options)  # type: ignore[arg-type]
            before = self._last.get(threading.get_ident())
            with self._lock:
                self.at_headers.append(before is not None and before() is not None)
            return _Responses._Result(self, result, before)

        monkeypatch.setattr(obstore, "get", spied)

    class _Result:
        def __init__(self, spy: _Responses, result: Any, before: Any) -> None:
            self.meta, self._spy, self._result, self._before = result.meta, spy, result, before

        def bytes(self) -> _Responses.Body:
            spy = self._spy
            body = _Responses.Body(self._result.bytes())
            ref = weakref.ref(body)
            with spy._lock:
                spy.at_body.append(self._before is not None and self._before() is not None)
                spy.alive.append(ref)
            spy._last[threading.get_ident()] = ref
            return body

    def held(self) -> int:
        return sum(ref() is not None for ref in self.alive)

    def clear(self) -> None:
        with self._lock:
            self.alive.clear()
            self.at_headers.clear()
            self.at_body.clear()


async def test_each_thread_frees_its_response_when_the_next_ones_headers_arrive(
    object_server: ObjectServer,
    object_small: str,
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An I/O thread keeps its last response until the next one's headers have come, and
    frees it before collecting that body: never two of its own at once, and the allocator
    can hand the freed buffer to the next body (freed earlier, the request's own small
    allocations would be carved out of it; see _strategy_remote). None outlives the load."""
    ckpt = _open(object_server, object_small)
    p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
    spy = _Responses(monkeypatch)
    for transfer in ("auto", "staged"):
        spy.clear()
        options = dataclasses.replace(SMALL, transfer=transfer, presigned_gets=False)
        async with await load(ckpt, p, options=options) as slabs:
            assert spy.held() == 0
            _bit_exact(slabs, small_checkpoint)
        gets = len(spy.at_headers)
        assert gets == len(spy.at_body) >= 2 * SMALL.request_concurrency
        assert not any(spy.at_body)
        # Every GET but each thread's first found that thread's last response still held.
        assert sum(spy.at_headers) >= gets - SMALL.request_concurrency


async def test_io_threads_copy_responses_without_torch(
    object_server: ObjectServer,
    object_small: str,
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Onto the CPU, direct or staged, every response obstore collects is copied by
    ``host_copy`` on its I/O thread, never by a torch copy (whose OpenMP team per thread
    ``test_host_copies_start_no_thread`` shows); the slabs are bit-exact."""
    from asyncslab.loading import _copy, _strategy_remote

    torch_copies: list[str] = []
    host_copies: list[str] = []
    real_copy_ = torch.Tensor.copy_
    real_host = _copy.host_copy

    def spied_copy_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        torch_copies.append(threading.current_thread().name)
        return real_copy_(self, *args, **kwargs)

    def spied_host(dst: int, src: int, nbytes: int) -> None:
        host_copies.append(threading.current_thread().name)
        real_host(dst, src, nbytes)

    real_all = _copy._copy_all

    def spied_all(dst: Any, src: Any, **kwargs: Any) -> None:
        torch_copies.append(threading.current_thread().name)
        real_all(dst, src, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spied_copy_)
    monkeypatch.setattr(_copy, "_copy_all", spied_all)
    monkeypatch.setattr(_copy, "host_copy", spied_host)
    monkeypatch.setattr(_strategy_remote, "host_copy", spied_host)
    ckpt = _open(object_server, object_small)
    p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
    for transfer in ("auto", "staged"):
        torch_copies.clear()
        host_copies.clear()
        options = dataclasses.replace(SMALL, transfer=transfer, presigned_gets=False)
        async with await load(ckpt, p, options=options) as slabs:
            _bit_exact(slabs, small_checkpoint)
        assert not [name for name in torch_copies if name.startswith("asyncslab-io")]
        assert host_copies
        assert all(name.startswith("asyncslab-io") for name in host_copies)


async def test_progress_readiness_and_reload_in_place(
    s3_server: SeaweedServer, s3_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    ckpt = _open(s3_server, s3_small)
    p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
    seen: list[asyncslab.LoadStatistics] = []
    ready: list[str] = []

    async def on_unit_ready(unit: str, slabs: SlabSet) -> None:
        ready.append(unit)

    async with SlabSet(p) as slabs:
        slabs.start(ckpt, options=SMALL, on_unit_ready=on_unit_ready, progress=seen.append)
        for unit in p.units:
            await slabs.ready(unit)
        await slabs.ready()
        pointers = {name: slabs.slab(name).data_ptr() for name in p.slabs}
        assert sorted(ready) == sorted(p.units)
        assert seen[-1].state == "complete"
        assert seen[-1].bytes_landed == p.nbytes
        # Reset, then again in place: the same memory, the same bytes.
        slabs.reset()
        with pytest.raises(IncompleteLoadError):
            slabs.slab(next(iter(p.slabs)))
        await slabs.load(ckpt, options=SMALL)
        assert {name: slabs.slab(name).data_ptr() for name in p.slabs} == pointers
        _bit_exact(slabs, small_checkpoint)


async def test_an_object_replaced_after_planning_is_refused_naming_it(
    object_server: ObjectServer, small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}
    object_server.put("replaced/m.safetensors", save(tensors))
    uri = f"{object_server.scheme}://models/replaced"
    ckpt = _open(object_server, uri)
    p = asyncslab.plan(ckpt)
    etag = ckpt.files[0].source.etag
    tensors["w0"] = tensors["w0"] + 1
    object_server.put("replaced/m.safetensors", save(tensors))
    async with SlabSet(p) as slabs:
        with pytest.raises(FileChangedError, match=f"{uri}/m.safetensors") as err:
            await slabs.load(ckpt, options=SMALL)
        details = err.value.details
        assert (details["bucket"], details["key"], details["expected"]) == (
            "models",
            "replaced/m.safetensors",
            etag,
        )
        assert details["got"] not in (None, etag)
        # The checkpoint is no longer the one planned: a checkpoint error too, not only a
        # failed load.
        assert isinstance(err.value, asyncslab.CheckpointError)
        assert slabs.state == "failed"
    assert await wait_io_threads_gone() == []


async def test_a_body_cut_mid_way_is_retried_and_lands_bit_exact(
    proxied: tuple[FaultProxy, Checkpoint, Plan], small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    proxy, ckpt, p = proxied
    cut = proxy.add(Fault("cut", _payload, after=100, times=3))
    async with await load(ckpt, p, options=SMALL) as slabs:
        _bit_exact(slabs, small_checkpoint)
    assert cut.hits == 3


async def test_a_body_cut_every_time_fails_naming_object_and_range(
    proxied: tuple[FaultProxy, Checkpoint, Plan], small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    proxy, ckpt, p = proxied
    proxy.add(Fault("cut", _payload, after=10, times=-1))
    options = LoadOptions(request_size=4096, request_concurrency=2, request_retries=2)
    async with SlabSet(p) as slabs:
        with pytest.raises(ReadError, match=r"://models/small/.*GET of bytes \d+-\d+ "):
            await slabs.load(ckpt, options=options)
        assert slabs.state == "failed"
        assert_units_all_or_nothing(slabs, Checkpoint.open(small_checkpoint.root))
    assert await wait_io_threads_gone() == []


async def test_a_server_that_stops_answering_fails_the_load_within_read_timeout(
    proxied: tuple[FaultProxy, Checkpoint, Plan], small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    proxy, ckpt, p = proxied
    proxy.add(Fault("stall", _payload, after=10, times=-1))
    options = LoadOptions(
        request_size=4096, request_concurrency=2, read_timeout=2.0, request_retries=1
    )
    async with SlabSet(p) as slabs:
        with pytest.raises(ReadTimeoutError, match=r"://models/small/"):
            await slabs.load(ckpt, options=options)
        assert slabs.state == "failed"
        assert await wait_io_threads_gone() == []
        await until(lambda: proxy.open_connections == 0)
        # Every GET ended within the drain: the slabs stay usable once the server answers.
        proxy.faults.clear()
        proxy.release()
        await slabs.load(ckpt, options=options)
        _bit_exact(slabs, small_checkpoint)


async def test_cancelling_a_load_mid_way_leaves_no_thread_or_connection(
    proxied_s3: tuple[FaultProxy, Checkpoint, Plan],
    small_checkpoint: SyntheticCheckpoint,
    gets: str,
) -> None:
    proxy, ckpt, p = proxied_s3
    # The first payload GET goes through; every later one stalls after 10 bytes.
    first = threading.Event()
    proxy.add(Fault("before", _payload, hook=lambda r: first.set()))
    proxy.add(Fault("stall", _payload, after=10, times=-1))
    async with SlabSet(p) as slabs:
        task = asyncio.create_task(slabs.load(ckpt, options=SMALL))
        await asyncio.to_thread(first.wait)
        await until(lambda: len(proxy.matching(_payload)) >= 2)  # one is stalled
        task.cancel()
        proxy.release()  # the stalled responses end: their threads return
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slabs.state == "cancelled"
        assert_units_all_or_nothing(slabs, Checkpoint.open(small_checkpoint.root))
    assert await wait_io_threads_gone() == []
    await until(lambda: proxy.open_connections == 0)


async def test_an_object_replaced_behind_a_server_ignoring_if_match_is_still_refused(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint, gets: str
) -> None:
    """The ETag of every response is checked too: a response of another version (a server
    that ignored If-Match, as fake-gcs-server does; the proxy sets its ETag) is refused."""
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, object_small, proxy.endpoint)
        p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
        proxy.add(Fault("etag", _payload, etag='"another-version"'))
        async with SlabSet(p) as slabs:
            with pytest.raises(FileChangedError, match='"another-version"') as err:
                await slabs.load(ckpt, options=SMALL)
            assert err.value.details["got"] == '"another-version"'
            assert slabs.state == "failed"


async def test_an_object_deleted_or_forbidden_during_a_load_is_a_clear_error(
    proxied: tuple[FaultProxy, Checkpoint, Plan], object_server: ObjectServer, gets: str
) -> None:
    proxy, ckpt, p = proxied
    proxy.add(Fault("status", _payload, status=403, times=-1))
    async with SlabSet(p) as slabs:
        with pytest.raises(ReadError, match=r"://models/small/.*access denied"):
            await slabs.load(ckpt, options=SMALL)
    proxy.faults.clear()
    key = ckpt.files[0].source.key
    data = object_server.get(key)
    object_server.delete(key)
    try:
        async with SlabSet(p) as slabs:
            with pytest.raises(FileChangedError, match=r"is gone") as err:
                await slabs.load(ckpt, options=SMALL)
            assert err.value.details["got"] is None
    finally:
        # Put back as it was: the session's other tests open it afresh (a GCS upload is a
        # new generation, an Azure one a new ETag; the bytes are the same).
        object_server.put(key, data)


async def test_aclose_during_a_load_from_s3_releases_everything(
    proxied_s3: tuple[FaultProxy, Checkpoint, Plan], gets: str
) -> None:
    proxy, ckpt, p = proxied_s3
    first = threading.Event()
    proxy.add(Fault("before", _payload, hook=lambda r: first.set()))
    proxy.add(Fault("stall", _payload, after=10, times=-1))
    slabs = SlabSet(p)
    slabs.start(ckpt, options=SMALL)
    await asyncio.to_thread(first.wait)
    # Closed only once a stalled GET is in flight: the load needs more than one request, so
    # the second comes whatever the machine's speed; closing before it was sent would leave
    # nothing for the close to tear down, and nothing to wait for here.
    await until(lambda: len(proxy.matching(_payload)) >= 2)
    asked = asyncio.Event()

    async def close() -> None:
        asked.set()
        await slabs.aclose()  # cancels the load before its first await

    closing = asyncio.create_task(close())
    # The stalled GETs end (cut) only once the cancel is asked for: else their failure could
    # end the load first, as a failure rather than a cancellation.
    await asked.wait()
    proxy.release()
    await closing
    assert slabs.state == "cancelled"
    assert await wait_io_threads_gone() == []
    await until(lambda: proxy.open_connections == 0)


async def test_the_object_store_options_refuse_values_with_no_meaning() -> None:
    with pytest.raises(ValueError, match="request_size"):
        LoadOptions(request_size=0)
    with pytest.raises(ValueError, match="request_concurrency"):
        LoadOptions(request_concurrency=0)
    with pytest.raises(ValueError, match="request_retries"):
        LoadOptions(request_retries=-1)
    with pytest.raises(TypeError, match="request_concurrency"):
        LoadOptions(request_concurrency=1.5)  # type: ignore[arg-type]
    assert LoadOptions(request_retries=0).request_retries == 0


@pytest.mark.parametrize(("request_size", "concurrency"), [(1000, 1), (1000, 7), (1 << 20, 2)])
async def test_any_request_size_and_concurrency_lands_bit_exact(
    s3_server: SeaweedServer,
    s3_small: str,
    small_checkpoint: SyntheticCheckpoint,
    request_size: int,
    concurrency: int,
) -> None:
    """Requests smaller than a tensor (its chunks in several GETs), or holding many."""
    ckpt = _open(s3_server, s3_small)
    p = asyncslab.plan(ckpt, tier_map=small_checkpoint.tier_map_path)
    options = LoadOptions(request_size=request_size, request_concurrency=concurrency)
    async with await load(ckpt, p, options=options) as slabs:
        _bit_exact(slabs, small_checkpoint)
        assert slabs.statistics().reads >= p.nbytes // request_size

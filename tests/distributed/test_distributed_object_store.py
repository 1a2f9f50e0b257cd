"""Distributed loads of a checkpoint in object storage: real gloo groups of spawned ranks
(``test_distributed._spawn``) reading from the real stores the tests start: SeaweedFS
(``support/s3server.py``), fake-gcs-server and Azurite (``support/object_servers.py``).

Each rank opens the checkpoint through a fault-injecting proxy of its own, started in its
own process, so that the requests that proxy records are that rank's and no other's: the
tests prove from them which byte ranges each rank asked for, and inject faults into one
rank's requests only. Every load is compared byte for byte with a load of the same plan
from the local copy of the checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import asyncslab
from asyncslab import Checkpoint, LoadOptions
from asyncslab.distributed import _session as distributed
from asyncslab.distributed import _sources as sources
from asyncslab.distributed import rank_plan
from asyncslab.testing import SyntheticCheckpoint
from support.faults import HANG_S, raw_bytes
from support.object_servers import SIGNED_QUERY, attached
from support.s3server import Fault, FaultProxy, Request, SeaweedServer
from tests.conftest import ObjectServer
from tests.distributed.test_distributed import _error, _spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

#: Bytes read == bytes needed (no read-through), GETs smaller than a chunk (several per
#: chunk, three in flight).
OPTIONS = LoadOptions(coalesce_gap=0, request_size=16 << 10, request_concurrency=3)
CHUNK = 64 << 10
MODES = ("replicated", "rows", "experts")
#: The children's process-group timeout: longer than any fault below takes to surface, so
#: that a rank hears of another's failure in the agreement, never by a collective's timeout.
PG_TIMEOUT = 30.0
HERE = "tests.distributed.test_distributed_object_store"
READ_ERRORS = ("ReadError", "ReadTimeoutError")


# --- child side --------------------------------------------------------------------------


def _config(root: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((root / "s3.json").read_text())
    return config


def _server(config: dict[str, Any]) -> ObjectServer:
    """The store the parent started, as this rank reaches it."""
    return attached(config["scheme"], config["endpoint"])


def _open(config: dict[str, Any], proxy: FaultProxy) -> Checkpoint:
    options = _server(config).options(proxy.endpoint)
    return Checkpoint.open(config["uri"], storage_options=options)


def _digest(slabs: asyncslab.SlabSet) -> str:
    h = hashlib.sha256()
    for name in sorted(slabs.plan.slabs):
        h.update(raw_bytes(slabs.slab(name)).numpy().tobytes())
    return h.hexdigest()


def _gets(proxy: FaultProxy, since: int) -> list[Request]:
    return [r for r in proxy.matching(lambda r: True)[since:] if r.method == "GET"]


async def _load_from_store(
    ckpt: Checkpoint,
    local: Checkpoint,
    mode: str,
    share: bool,
    proxy: FaultProxy,
    server: ObjectServer,
) -> dict[str, Any]:
    """One distributed load of ``ckpt``: its slabs against the local load of the same plan,
    and every GET this rank made for it."""
    plan = rank_plan(ckpt, mode=mode)  # type: ignore[arg-type]
    since = len(proxy.matching(lambda r: True))
    loaded = await distributed.load(
        ckpt, plan, share_reads=share, options=OPTIONS, chunk_bytes=CHUNK
    )
    async with loaded:
        gets = _gets(proxy, since)
        local_plan = rank_plan(local, mode=mode)  # type: ignore[arg-type]
        async with await asyncslab.load(local, local_plan, options=OPTIONS) as reference:
            expected = _digest(reference)
        etags = {f.path.name: f.source.etag for f in ckpt.files if f.source is not None}
        stats = loaded.slabs.statistics()
        return {
            "state": stats.state,
            "units": [stats.units_complete, stats.units],
            "transfer": stats.transfer,
            "digest": _digest(loaded.slabs),
            "expected": expected,
            "needed": [
                [r.file.name, r.src_offset, r.src_offset + r.nbytes]
                for r in plan.routes
                if r.nbytes
            ],
            "gets": [
                [_name(server, r), r.range[0], r.range[1] + 1] for r in gets if r.range is not None
            ],
            "unranged": [r.path for r in gets if r.range is None],
            # Where the store signs, every GET a presigned URL with no credentials of its own.
            "presigned": all(
                SIGNED_QUERY[server.scheme] in r.query and "authorization" not in r.headers
                for r in gets
            )
            if server.scheme in SIGNED_QUERY
            else None,
            "pinned": all(r.headers.get("if-match") == etags[_name(server, r)] for r in gets),
            # GCS: each GET asks for the generation opened too (the emulator ignores If-Match).
            "generations": all(server.pin_of(r) == _version(ckpt, _name(server, r)) for r in gets)
            if server.scheme == "gs"
            else True,
            "bytes_read": [r.bytes_read for r in loaded.ranks],
        }


def _readers() -> list[str]:
    """The shared reads' threads still alive: none once a load returned (its reader and GET
    threads are joined before the protocol hands its verdict over)."""
    names = ("asyncslab-dist-read", "asyncslab-dist-get")
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


def _name(server: ObjectServer, request: Request) -> str:
    where = server.key_of(request)
    assert where is not None, request
    return where[1].rpartition("/")[2]


def _version(ckpt: Checkpoint, name: str) -> str | None:
    return next(f.source.version for f in ckpt.files if f.path.name == name and f.source)


async def _modes(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Every mode, own reads and shared reads, from the store through this rank's proxy."""
    config = _config(root)
    server = _server(config)
    local = Checkpoint.open(config["local"])
    loads: dict[str, Any] = {}
    with server.proxy() as proxy:
        ckpt = _open(config, proxy)
        for mode in MODES:
            for share in (False, True):
                key = f"{mode}/{'share' if share else 'own'}"
                loads[key] = await _load_from_store(ckpt, local, mode, share, proxy, server)
    result["loads"] = loads
    result["threads"] = _readers()


def _payload(request: Request) -> bool:
    """A GET of payload bytes (the counting starts after the open's header GETs)."""
    return request.method == "GET" and request.range is not None


async def _faults(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Faults injected into rank 1's requests only, each load's outcome on every rank; then
    a good load in the same group."""
    config = _config(root)
    server = _server(config)
    out: dict[str, Any] = {}
    with server.proxy() as proxy:
        for share in (False, True):
            for case in ("replaced", "deleted", "cut-always", "cut-twice", "stalled"):
                ckpt = _open(config, proxy)  # after the last case's object was put back
                plan = rank_plan(ckpt, mode="replicated")
                keys = {f.source.key: f.source.etag for f in ckpt.files if f.source is not None}
                originals = {k: server.get(k) for k in keys}
                options = OPTIONS
                if rank == 1:
                    options = _inject(case, proxy, server, originals)
                since = len(proxy.matching(lambda r: True))
                got = await _attempt_digest(ckpt, plan, share, options)
                got["faults"] = sum(f.hits for f in proxy.faults)
                got["gets"] = len(_gets(proxy, since))
                out[f"{case}/{share}"] = got
                proxy.faults.clear()
                proxy.release()  # stalled responses end
                if rank == 1:
                    for key, data in originals.items():
                        server.put(key, data)
                dist.barrier()  # no rank opens again before the objects are back
        out["opened-apart"] = await _opened_apart(rank, config, proxy, server)
    result["faults"] = out
    result["threads"] = _readers()
    # Every object as it was (an Azure upload of the same bytes has another ETag).
    result["objects_back"] = all(server.get(k) == originals[k] for k in keys)
    local = Checkpoint.open(config["local"])
    plan = rank_plan(local, mode="replicated")
    async with await asyncslab.load(local, plan, options=OPTIONS) as reference:
        result["expected"] = _digest(reference)


async def _opened_apart(
    rank: int, config: dict[str, Any], proxy: FaultProxy, server: ObjectServer
) -> dict[str, Any]:
    """Rank 0 opens the checkpoint; then one of its objects is replaced by another version of
    the same layout, and rank 1 opens it: the group refuses before a byte is read."""
    ckpt = _open(config, proxy)
    dist.barrier()  # rank 0 has opened it
    location = ckpt.files[-1].source
    assert location is not None
    original = server.get(location.key)
    if rank == 1:
        server.put(location.key, _another_version(original))
        ckpt = _open(config, proxy)
    plan = rank_plan(ckpt, mode="replicated")
    since = len(proxy.matching(lambda r: True))
    got = await _attempt_digest(ckpt, plan, True, OPTIONS)
    got["gets"] = len(_gets(proxy, since))
    if rank == 1:
        server.put(location.key, original)
    dist.barrier()  # the object is back
    return got


def _another_version(data: bytes) -> bytes:
    """``data`` with its last byte (payload) changed: the same layout, another ETag."""
    changed = bytearray(data)
    changed[-1] ^= 0xFF
    return bytes(changed)


def _inject(
    case: str, proxy: FaultProxy, server: ObjectServer, originals: dict[str, bytes]
) -> LoadOptions:
    """Arm ``case`` on this rank's proxy; the options its load runs with."""

    def key_of(request: Request) -> str:
        where = server.key_of(request)
        assert where is not None, request
        return where[1]

    def replace(request: Request) -> None:
        key = key_of(request)
        server.put(key, _another_version(originals[key]))

    def delete(request: Request) -> None:
        server.delete(key_of(request))

    if case == "replaced":
        proxy.add(Fault("before", _payload, hook=replace))
    elif case == "deleted":
        proxy.add(Fault("before", _payload, hook=delete))
    elif case == "cut-always":
        proxy.add(Fault("cut", _payload, after=10, times=-1))
        return LoadOptions(coalesce_gap=0, request_size=16 << 10, request_retries=1)
    elif case == "cut-twice":
        proxy.add(Fault("cut", _payload, after=100, times=2))
    elif case == "stalled":
        proxy.add(Fault("stall", _payload, after=10, times=-1))
        return LoadOptions(
            coalesce_gap=0, request_size=16 << 10, request_retries=1, read_timeout=2.0
        )
    return OPTIONS


async def _attempt_digest(
    ckpt: Checkpoint,
    plan: asyncslab.Plan,
    share: bool,
    options: LoadOptions,
    deadline: float | None = None,
) -> dict[str, Any]:
    try:
        loaded = await distributed.load(
            ckpt, plan, share_reads=share, options=options, chunk_bytes=CHUNK, timeout=deadline
        )
    except BaseException as err:
        got = _error(err, 0.0)
        got["errors"] = {str(k): v for k, v in getattr(err, "errors", {}).items()}
        return got
    async with loaded:
        return {"type": None, "state": loaded.slabs.state, "digest": _digest(loaded.slabs)}


async def _deadline(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Rank 1's GETs stall with no read_timeout, and its shared load passes its own
    ``timeout=``: it raises, its protocol finishes the collectives without waiting for the
    GET, the others hear of it in step; the reader and its GET threads, left waiting on the
    server, end once the server answers."""
    config = _config(root)
    with _server(config).proxy() as proxy:
        ckpt = _open(config, proxy)
        plan = rank_plan(ckpt, mode="replicated")
        if rank == 1:
            proxy.add(Fault("stall", _payload, after=10, times=-1))
        options = LoadOptions(coalesce_gap=0, request_size=16 << 10, read_timeout=None)
        deadline = 1.0 if rank == 1 else None
        result["outcome"] = await _attempt_digest(ckpt, plan, True, options, deadline)
        if rank == 1:
            protocol = [t for t in threading.enumerate() if t.name == "asyncslab-dist"]
            for thread in protocol:
                await asyncio.to_thread(thread.join, HANG_S)
            result["protocol_finished"] = not any(t.is_alive() for t in protocol)
            result["left"] = _readers()  # still waiting on the stalled server
            proxy.faults.clear()
            proxy.release()  # the stalled responses end; the GETs' retries are answered
            limit = time.monotonic() + HANG_S  # a hang guard, not a measure
            while _readers() and time.monotonic() < limit:  # noqa: ASYNC110 - threads
                await asyncio.sleep(0.02)
            result["after_release"] = _readers()
    result["group_broken"] = True  # a timeout leaves the group unusable


# --- parent side -------------------------------------------------------------------------


def _write_config(
    directory: Path, server: ObjectServer, uri: str, local: SyntheticCheckpoint
) -> Path:
    directory.mkdir()
    config = {
        "scheme": server.scheme,
        "endpoint": server.endpoint,
        "uri": uri,
        "local": str(local.root),
    }
    (directory / "s3.json").write_text(json.dumps(config))
    return directory


def _spans(ranges: Iterable[list[Any]]) -> dict[str, list[tuple[int, int]]]:
    """``(name, start, end)`` ranges as each file's merged spans."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, s, e in sorted(ranges):
        spans = by_file.setdefault(name, [])
        if spans and s <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], e))
        else:
            spans.append((s, e))
    return by_file


def _bytes(spans: dict[str, list[tuple[int, int]]]) -> int:
    return sum(e - s for v in spans.values() for s, e in v)


def _minus(
    a: dict[str, list[tuple[int, int]]], b: dict[str, list[tuple[int, int]]]
) -> dict[str, list[tuple[int, int]]]:
    """The bytes of ``a`` outside ``b``, per file."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name, spans in a.items():
        for s, e in spans:
            pos = s
            for bs, be in b.get(name, []):
                if be <= pos or bs >= e:
                    continue
                if bs > pos:
                    out.setdefault(name, []).append((pos, bs))
                pos = max(pos, be)
            if pos < e:
                out.setdefault(name, []).append((pos, e))
    return out


@pytest.fixture
def small_on_s3(
    tmp_path: Path,
    s3_server: SeaweedServer,
    s3_small: str,
    small_checkpoint: SyntheticCheckpoint,
) -> Path:
    """``s3_small`` as the spawned ranks reach it: the folder of their config."""
    return _write_config(tmp_path / "s3", s3_server, s3_small, small_checkpoint)


#: SeaweedFS in the fast tier; the emulators' runs (the same code, other clients) slow.
STORES = [
    "s3",
    pytest.param("gs", marks=pytest.mark.slow),
    pytest.param("az", marks=pytest.mark.slow),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("object_server", STORES, indirect=True)
def test_ranks_load_from_each_store_bit_exact_each_requesting_only_its_own_ranges(
    tmp_path: Path,
    object_server: ObjectServer,
    object_small: str,
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    config = _write_config(tmp_path / "store", object_server, object_small, small_checkpoint)
    results = _spawn(tmp_path, 2, f"{HERE}:_modes", config, pg_timeout=PG_TIMEOUT, wait=200)
    assert all(r is not None for r in results), results
    assert [r["threads"] for r in results if r is not None] == [[], []]
    ranks = [r["loads"] for r in results if r is not None]
    for key in ranks[0]:
        loads = [r[key] for r in ranks]
        needed = [_spans(x["needed"]) for x in loads]
        gets = [_spans(x["gets"]) for x in loads]
        for rank, x in enumerate(loads):
            assert x["state"] == "complete", (key, rank)
            assert x["units"][0] == x["units"][1], (key, rank)
            assert x["digest"] == x["expected"], (key, rank)  # bit-exact with the local load
            assert x["pinned"], (key, rank)  # every GET If-Match the ETag recorded at open
            assert x["generations"], (key, rank)  # and on GCS its generation
            assert x["unranged"] == [], (key, rank)  # never a whole object
            assert x["presigned"] is not False, (key, rank)  # gs://: None, never signed for
            assert all(e - s <= OPTIONS.request_size for _, s, e in x["gets"]), (key, rank)
            # Each byte a rank asked for once: its GETs never overlap.
            assert _bytes(gets[rank]) == sum(e - s for _, s, e in x["gets"]), (key, rank)
            assert x["bytes_read"][rank] == _bytes(gets[rank]), (key, rank)
        if key.endswith("/own"):
            assert [x["transfer"] for x in loads] == ["remote", "remote"], key
            # Exactly its own ranges: nothing outside them, all of them.
            assert gets == needed, key
        else:
            assert [x["transfer"] for x in loads] == ["shared", "shared"], key
            union = _spans([r for x in loads for r in x["needed"]])
            # The group asked for every needed byte once, and for nothing else.
            assert _minus(gets[0], gets[1]) == gets[0], key
            assert _spans([r for x in loads for r in x["gets"]]) == union, key
            # What only one rank needs, only that rank asked for.
            for rank in (0, 1):
                private = _minus(needed[rank], needed[1 - rank])
                assert _minus(private, gets[rank]) == {}, (key, rank)
        if key.startswith(("rows", "experts")):
            assert needed[0] != needed[1], key  # the ranks' parts differ: the check bites


@pytest.mark.timeout(300)
@pytest.mark.parametrize("object_server", STORES, indirect=True)
def test_faults_in_one_ranks_requests_fail_every_rank_in_step_naming_the_object(
    tmp_path: Path,
    object_server: ObjectServer,
    small_checkpoint: SyntheticCheckpoint,
) -> None:
    for path in sorted(small_checkpoint.root.rglob("*")):
        if path.is_file():
            object_server.put(f"dist-faults/{path.name}", path.read_bytes())
    uri = f"{object_server.scheme}://models/dist-faults"
    config = _write_config(tmp_path / "store", object_server, uri, small_checkpoint)
    results = _spawn(tmp_path, 2, f"{HERE}:_faults", config, pg_timeout=PG_TIMEOUT, wait=260)
    assert all(r is not None for r in results), results
    faults = [r["faults"] for r in results if r is not None]
    assert [r["objects_back"] for r in results if r is not None] == [True, True]
    assert [r["threads"] for r in results if r is not None] == [[], []]
    for share in (False, True):
        for case in ("replaced", "deleted"):
            for rank, f in enumerate(faults):
                got = f[f"{case}/{share}"]
                assert got["type"] == "DistributedLoadError", (case, share, rank, got)
                assert got["load_error"]
                # Rank 1 changed it; rank 0, asking for the object after that, may fail too,
                # and with shared reads the first chunk that failed stops the group: either
                # rank or both are named, alike on every rank, always for the changed object.
                assert got["ranks"] in ([0], [1], [0, 1]), (case, share, rank, got)
                assert got["ranks"] == faults[0][f"{case}/{share}"]["ranks"]
                for error in got["errors"].values():
                    assert error.startswith(f"FileChangedError: {uri}/"), error
                    assert "object changed since the checkpoint was opened" in error, error
                    assert "bucket 'models', key 'dist-faults/" in error, error
                    assert ("is gone" in error) == (case == "deleted"), error
                assert "Timed out" not in got["message"], got  # in step, not by timeout
                if rank in got["ranks"]:
                    assert got["cause"] == "FileChangedError", (case, share, rank, got)
        # A server that stops answering fails rank 1 within read_timeout: by the loader's
        # watch (ReadTimeoutError) or by its GET's last attempt (the client's body error),
        # whichever ends first, as a single-process load from s3 does; no rank hangs.
        for case, errors in (("cut-always", ("ReadError",)), ("stalled", READ_ERRORS)):
            for rank, f in enumerate(faults):
                got = f[f"{case}/{share}"]
                assert got["type"] == "DistributedLoadError", (case, share, rank, got)
                assert got["ranks"] == [1], (case, share, rank, got)  # only rank 1 faulted
                said = got["message"].partition("failed on rank 1 of 2: ")[2]
                assert said.startswith(tuple(f"{e}: {uri}/" for e in errors))
                assert "Timed out" not in got["message"], got
            assert faults[1][f"{case}/{share}"]["cause"] in errors
        assert "GET of bytes " in faults[1][f"cut-always/{share}"]["message"]
        # A body cut short is retried: the load completes bit-exact, on every rank.
        for rank, f in enumerate(faults):
            got = f[f"cut-twice/{share}"]
            assert got["type"] is None, (share, rank, got)
            assert got["digest"] == results[rank]["expected"], (share, rank)  # type: ignore[index]
            assert got["faults"] == (2 if rank == 1 else 0), (share, rank)  # rank 1's proxy only
    for f in faults:
        got = f["opened-apart"]
        assert got["type"] == "DistributedLoadError", got
        assert got["ranks"] == [1], got
        assert f"opened another version of {uri}/" in got["message"], got
        assert "(ranks disagree before loading)" in got["message"], got
        assert got["gets"] == 0, got  # refused before any payload was asked for


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_shared_load_past_its_deadline_leaves_its_stalled_gets_behind_and_frees_them(
    tmp_path: Path, small_on_s3: Path
) -> None:
    # The group's timeout is past this test's: every rank must hear of rank 1 in step.
    results = _spawn(tmp_path, 2, f"{HERE}:_deadline", small_on_s3, pg_timeout=300.0, wait=100)
    mine, other = results[1], results[0]
    assert mine is not None, results
    assert other is not None, results
    got = mine["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert "did not finish within timeout=1.0 s" in got["message"], got
    got = other["outcome"]
    assert got["type"] == "DistributedLoadError", got
    assert got["ranks"] == [1], got
    assert "failed on rank 1 of 2: load timed out after 1.0 s" in got["message"], got
    assert mine["protocol_finished"]
    assert "asyncslab-dist-read" in mine["left"], mine  # left behind with its GETs ...
    assert any(n.startswith("asyncslab-dist-get") for n in mine["left"]), mine
    assert mine["after_release"] == [], mine  # ... and gone once they returned


def test_versions_are_compared_only_where_ranks_opened_the_same_object() -> None:
    """Rank 0's ETags against the others', by URI: a mirror in another bucket (its own
    ETags) or a local copy (none) is no other version."""

    def hello(rank: int, versions: dict[str, str]) -> dict[str, Any]:
        return {"rank": rank, "versions": versions}

    a, b = "s3://models/m/a.safetensors", "s3://models/m/b.safetensors"
    mirror = "s3://mirror/m/a.safetensors"
    hellos = [
        hello(0, {a: '"1"', b: '"2"'}),
        hello(1, {a: '"1"', b: '"2"'}),
        hello(2, {mirror: '"9"'}),
        hello(3, {}),
        hello(4, {a: '"1"', b: '"3"'}),
    ]
    problems = sources.version_problems(hellos)
    assert list(problems) == [4]
    assert problems[4].startswith(f'opened another version of {b} than rank 0 (ETag "3"; ')
    assert 'rank 0: "2")' in problems[4]

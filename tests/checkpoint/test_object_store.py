"""Opening checkpoints in object storage, against a real S3 server (SeaweedFS, see
``tests/s3server.py``): the same headers, rules and errors as local files, only headers read,
every request pinned to the ETag listed, and no secret in any message."""

from __future__ import annotations

import json
from pathlib import Path

import obstore
import pytest
import torch
from safetensors.torch import save

import asyncslab
from asyncslab import Checkpoint
from asyncslab.errors import (
    CheckpointError,
    IndexFileError,
    MissingFileError,
    PayloadSizeError,
    UnsafePathError,
)
from asyncslab.testing import SyntheticCheckpoint
from tests.s3server import SECRET_KEY, Fault, FaultProxy, Request, SeaweedServer

ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def _shard(seed: int, n: int = 3) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return save({f"t{seed}.{i}": torch.randn(4, 8, generator=g) for i in range(n)})


def _put(server: SeaweedServer, key: str, data: bytes) -> None:
    obstore.put(server.store(), key, data)


def _same_tensors(remote: Checkpoint, local: Checkpoint) -> None:
    assert list(remote.tensors) == list(local.tensors)
    for name, info in remote.tensors.items():
        mine = local.tensors[name]
        assert (info.dtype, info.shape, info.offset, info.nbytes) == (
            mine.dtype,
            mine.shape,
            mine.offset,
            mine.nbytes,
        )
        assert str(info.file) == f"s3://models/small/{mine.file.name}"


def test_a_prefix_with_an_index_opens_as_the_local_checkpoint_does(
    s3_server: SeaweedServer, s3_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    remote = Checkpoint.open(s3_small, storage_options=s3_server.options())
    local = Checkpoint.open(small_checkpoint.root)
    _same_tensors(remote, local)
    assert str(remote.root) == "s3://models/small"
    assert str(remote.index) == "s3://models/small/model.safetensors.index.json"
    for shard, mine in zip(remote.files, local.files, strict=True):
        assert shard.source is not None
        assert shard.source.etag
        assert (shard.size, shard.header_len) == (mine.size, mine.header_len)
    # The plan is the local one's, file for file.
    planned = asyncslab.plan(remote, tier_map=small_checkpoint.tier_map_path)
    expected = asyncslab.plan(local, tier_map=small_checkpoint.tier_map_path)
    assert planned.layout_fingerprint == expected.layout_fingerprint
    assert len(planned.routes) == len(expected.routes)


def test_the_index_or_one_object_open_by_their_uri(
    s3_server: SeaweedServer, s3_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    options = s3_server.options()
    by_index = Checkpoint.open(f"{s3_small}/model.safetensors.index.json", storage_options=options)
    _same_tensors(by_index, Checkpoint.open(small_checkpoint.root))
    first = small_checkpoint.files[0]
    one = Checkpoint.open(f"{s3_small}/{first.name}", storage_options=options)
    _same_tensors(one, Checkpoint.open(first))


def test_opening_reads_only_headers_with_ranged_gets(
    s3_server: SeaweedServer, s3_small: str
) -> None:
    with FaultProxy(s3_server.endpoint) as proxy:
        ckpt = Checkpoint.open(s3_small, storage_options=s3_server.options(proxy.endpoint))
        gets = proxy.matching(lambda r: r.method == "GET" and not r.query)
    shards = {f"/models/small/{f.path.name}": f for f in ckpt.files}
    payload_reads = 0
    for request in gets:
        if request.path in shards:
            assert request.range is not None, request
            assert request.headers.get("if-match") == shards[request.path].source.etag
            shard = shards[request.path]
            start, last = request.range
            payload_reads += last >= shard.data_start + (1 << 20)
    assert payload_reads == 0
    assert {r.path for r in gets} >= set(shards)


def test_a_prefix_of_more_than_a_thousand_keys_is_listed_whole(s3_server: SeaweedServer) -> None:
    store = s3_server.store()
    for i in range(1005):
        obstore.put(store, f"many/notes/{i:04d}.txt", b"x")
    # Listed after the thousand others: found only on the listing's second page.
    _put(s3_server, "many/zz-1.safetensors", _shard(1))
    _put(s3_server, "many/zz-2.safetensors", _shard(2))
    ckpt = Checkpoint.open("s3://models/many", storage_options=s3_server.options())
    assert [f.path.name for f in ckpt.files] == ["zz-1.safetensors", "zz-2.safetensors"]
    assert len(ckpt.tensors) == 6


def test_the_environment_configures_the_client_and_storage_options_override_it(
    s3_server: SeaweedServer, s3_small: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = s3_server.options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert len(Checkpoint.open(s3_small).files) == 3  # http:// endpoint, no further flag
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-from-env")
    with pytest.raises(MissingFileError, match="access denied") as refused:
        Checkpoint.open(s3_small)
    assert "wrong-secret-from-env" not in str(refused.value)
    ckpt = Checkpoint.open(s3_small, storage_options={"secret_access_key": SECRET_KEY})
    assert len(ckpt.files) == 3


def test_bad_credentials_are_refused_without_showing_the_secret(
    s3_server: SeaweedServer, s3_small: str
) -> None:
    options = {**s3_server.options(), "secret_access_key": "not-the-secret-0123456789"}
    with pytest.raises(MissingFileError, match=r"s3://models/small.*access denied") as refused:
        Checkpoint.open(s3_small, storage_options=options)
    text = f"{refused.value} {refused.value!r} {refused.value.details}"
    assert "not-the-secret-0123456789" not in text
    assert SECRET_KEY not in text
    assert refused.value.__cause__ is None  # the client's message (with its debug dump) goes


def test_a_missing_bucket_or_object_is_a_missing_file_error(
    s3_server: SeaweedServer, s3_small: str
) -> None:
    options = s3_server.options()
    with pytest.raises(MissingFileError, match=r"s3://no-such-bucket/x.*not found"):
        Checkpoint.open("s3://no-such-bucket/x", storage_options=options)
    with pytest.raises(MissingFileError, match=r"s3://models/small/absent.safetensors"):
        Checkpoint.open(f"{s3_small}/absent.safetensors", storage_options=options)
    with pytest.raises(MissingFileError, match="no \\*.safetensors objects"):
        Checkpoint.open("s3://models/nothing-here/", storage_options=options)


def _index(weight_map: dict[str, str]) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


def test_index_rules_hold_for_objects(s3_server: SeaweedServer) -> None:
    options = s3_server.options()
    _put(s3_server, "idx/a.safetensors", _shard(3, n=1))
    _put(s3_server, "other-prefix/b.safetensors", _shard(4, n=1))
    index = "model.safetensors.index.json"
    _put(s3_server, f"idx/{index}", _index({"t3.0": "../other-prefix/b.safetensors"}))
    with pytest.raises(UnsafePathError, match=r"s3://models/idx/model.safetensors.index.json"):
        Checkpoint.open("s3://models/idx", storage_options=options)
    _put(s3_server, f"idx/{index}", _index({"t3.0": "gone.safetensors"}))
    with pytest.raises(MissingFileError, match=r"s3://models/idx/gone.safetensors.*index"):
        Checkpoint.open("s3://models/idx", storage_options=options)
    _put(s3_server, f"idx/{index}", _index({"t3.0": "a.safetensors", "x": "./a.safetensors"}))
    with pytest.raises(IndexFileError, match="name the same object"):
        Checkpoint.open("s3://models/idx", storage_options=options)
    _put(s3_server, f"idx/{index}", _index({"t3.0": "a.safetensors"}))
    assert list(Checkpoint.open("s3://models/idx", storage_options=options).tensors) == ["t3.0"]


def test_header_rules_hold_for_objects(s3_server: SeaweedServer) -> None:
    options = s3_server.options()
    _put(s3_server, "bad/long.safetensors", _shard(5) + b"\0")
    with pytest.raises(PayloadSizeError, match=r"s3://models/bad/long.safetensors.*trailing"):
        Checkpoint.open("s3://models/bad/long.safetensors", storage_options=options)
    _put(s3_server, "bad/short.safetensors", _shard(5)[:-1])
    with pytest.raises(PayloadSizeError, match=r"s3://models/bad/short.safetensors.*truncated"):
        Checkpoint.open("s3://models/bad/short.safetensors", storage_options=options)
    with pytest.raises(CheckpointError, match="JSON object, not a safetensors"):
        Checkpoint.open("s3://models/bad/config.json", storage_options=options)


def test_an_object_replaced_while_opened_is_refused(s3_server: SeaweedServer) -> None:
    _put(s3_server, "swap/m.safetensors", _shard(6))

    def replace(request: Request) -> None:
        _put(s3_server, "swap/m.safetensors", _shard(7))

    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.add(Fault("before", lambda r: r.method == "GET" and not r.query, hook=replace))
        options = s3_server.options(proxy.endpoint)
        with pytest.raises(CheckpointError, match=r"s3://models/swap/m.safetensors.*changed"):
            Checkpoint.open("s3://models/swap", storage_options=options)


def test_gcs_and_azure_are_configured_through_the_same_client(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-key.json")
    with pytest.raises(CheckpointError, match=r"gs://bucket.*(configure|credential|no-such)"):
        Checkpoint.open("gs://bucket/prefix", storage_options={"service_account_path": missing})
    with pytest.raises(CheckpointError, match=r"az://container") as refused:
        Checkpoint.open(
            "az://container/prefix",
            storage_options={
                "account_name": "devstoreaccount1",
                "account_key": "c2VjcmV0LWtleS1uZXZlci1zaG93bg==",
                "use_emulator": True,
                "endpoint": "http://127.0.0.1:9",  # nothing listens: refused at once
                "allow_http": True,
                "timeout": "5s",
            },
        )
    assert "c2VjcmV0LWtleS1uZXZlci1zaG93bg==" not in str(refused.value)


def test_storage_options_are_for_uris_and_obstore_is_not_imported_by_asyncslab() -> None:
    import subprocess
    import sys

    with pytest.raises(TypeError, match="storage_options"):
        Checkpoint.open("local/dir", storage_options={"region": "x"})
    code = "import sys, asyncslab; print('obstore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_header_larger_than_the_first_read_is_fetched_whole(s3_server: SeaweedServer) -> None:
    """The first GET of an object takes its first MiB; a larger header takes one more."""
    data = save({"w": torch.ones(3)}, metadata={"note": "x" * ((1 << 20) + 100)})
    _put(s3_server, "big-header/m.safetensors", data)
    ckpt = Checkpoint.open("s3://models/big-header", storage_options=s3_server.options())
    assert ckpt.files[0].header_len > 1 << 20
    assert ckpt.files[0].metadata["note"] == "x" * ((1 << 20) + 100)


def test_no_repr_shows_a_secret(s3_server: SeaweedServer, s3_small: str) -> None:
    ckpt = Checkpoint.open(s3_small, storage_options=s3_server.options())
    shown = f"{ckpt!r} {ckpt.files!r} {ckpt.tensors!r}"
    assert SECRET_KEY not in shown
    assert "s3://models/small/model-00001-of-00003.safetensors" in shown

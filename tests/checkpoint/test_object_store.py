"""Opening checkpoints in object storage, against each real store the tests start: SeaweedFS
(``s3://``, ``support/s3server.py``), fake-gcs-server (``gs://``) and Azurite (``az://``,
``support/object_servers.py``): the same headers, rules and errors as local files, only headers
read, every request pinned to the version listed, and no secret in any message."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
from support.object_servers import (
    AZURE_ACCOUNT,
    AZURE_KEY,
    PUBLIC_CONTAINER,
    AzuriteServer,
    GcsServer,
)
from support.s3server import SECRET_KEY, Fault, Request, SeaweedServer
from tests.conftest import ObjectServer

ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def _shard(seed: int, n: int = 3) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return save({f"t{seed}.{i}": torch.randn(4, 8, generator=g) for i in range(n)})


def _open(server: ObjectServer, uri: str, endpoint: str | None = None) -> Checkpoint:
    return Checkpoint.open(uri, storage_options=server.options(endpoint))


def _same_tensors(remote: Checkpoint, local: Checkpoint, scheme: str = "s3") -> None:
    assert list(remote.tensors) == list(local.tensors)
    for name, info in remote.tensors.items():
        mine = local.tensors[name]
        assert (info.dtype, info.shape, info.offset, info.nbytes) == (
            mine.dtype,
            mine.shape,
            mine.offset,
            mine.nbytes,
        )
        assert str(info.file) == f"{scheme}://models/small/{mine.file.name}"


def test_a_prefix_with_an_index_opens_as_the_local_checkpoint_does(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    scheme = object_server.scheme
    remote = _open(object_server, object_small)
    local = Checkpoint.open(small_checkpoint.root)
    _same_tensors(remote, local, scheme)
    assert str(remote.root) == f"{scheme}://models/small"
    assert str(remote.index) == f"{scheme}://models/small/model.safetensors.index.json"
    for shard, mine in zip(remote.files, local.files, strict=True):
        assert shard.source is not None
        assert shard.source.etag
        # A GCS object is pinned to its generation too (its emulator ignores If-Match).
        assert (shard.source.version is not None) == (scheme == "gs")
        assert (shard.size, shard.header_len) == (mine.size, mine.header_len)
    # The plan is the local one's, file for file.
    planned = asyncslab.plan(remote, tier_map=small_checkpoint.tier_map_path)
    expected = asyncslab.plan(local, tier_map=small_checkpoint.tier_map_path)
    assert planned.layout_fingerprint == expected.layout_fingerprint
    assert len(planned.routes) == len(expected.routes)


def test_the_index_or_one_object_open_by_their_uri(
    object_server: ObjectServer, object_small: str, small_checkpoint: SyntheticCheckpoint
) -> None:
    scheme = object_server.scheme
    by_index = _open(object_server, f"{object_small}/model.safetensors.index.json")
    _same_tensors(by_index, Checkpoint.open(small_checkpoint.root), scheme)
    first = small_checkpoint.files[0]
    one = _open(object_server, f"{object_small}/{first.name}")
    _same_tensors(one, Checkpoint.open(first), scheme)


def test_opening_reads_only_headers_with_ranged_gets(
    object_server: ObjectServer, object_small: str
) -> None:
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, object_small, proxy.endpoint)
        gets = proxy.matching(lambda r: r.method == "GET" and object_server.key_of(r) is not None)
    shards = {f.source.key: f for f in ckpt.files if f.source is not None}
    payload_reads = 0
    read = set()
    for request in gets:
        where = object_server.key_of(request)
        if where is None or where[1] not in shards:
            continue
        shard = shards[where[1]]
        read.add(where[1])
        assert request.range is not None, request
        assert request.headers.get("if-match") == shard.source.etag
        start, last = request.range
        payload_reads += last >= shard.data_start + (1 << 20)
    assert payload_reads == 0
    assert read == set(shards)


def _put_many(server: ObjectServer, items: list[tuple[str, bytes]]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: server.put(*item), items))


#: Keys a listing page holds at most: SeaweedFS and S3 1000, Azurite and Azure 5000;
#: fake-gcs-server lists every key in one page (GCS: 1000), so on it the listing is whole
#: but no second page is asked for.
PAGE = {"s3": 1000, "gs": 1000, "az": 5000}


@pytest.mark.timeout(300)  # a hang guard: 5,005 uploads to Azurite on a loaded machine
@pytest.mark.parametrize(
    "object_server", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)], indirect=True
)
def test_a_prefix_of_more_than_a_page_of_keys_is_listed_whole(
    object_server: ObjectServer,
) -> None:
    scheme = object_server.scheme
    notes = [(f"many/notes/{i:05d}.txt", b"x") for i in range(PAGE[scheme] + 5)]
    _put_many(object_server, notes)
    # Listed after the others: found only on the listing's second page.
    object_server.put("many/zz-1.safetensors", _shard(1))
    object_server.put("many/zz-2.safetensors", _shard(2))
    with object_server.proxy() as proxy:
        ckpt = _open(object_server, f"{scheme}://models/many", proxy.endpoint)
        pages = proxy.matching(lambda r: r.method == "GET" and "prefix=many" in r.query)
    assert [f.path.name for f in ckpt.files] == ["zz-1.safetensors", "zz-2.safetensors"]
    assert len(ckpt.tensors) == 6
    assert len(pages) == (1 if scheme == "gs" else 2)


def test_the_environment_configures_the_s3_client_and_storage_options_override_it(
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


def _service_account(path: Path, **extra: object) -> str:
    """A service-account key file, with a fresh RSA key: the client signs its own token
    with it (a JWT), which the emulator takes as any other."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    account = {
        "type": "service_account",
        "project_id": "asyncslab-tests",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "loader@asyncslab-tests.iam.gserviceaccount.com",
        "client_id": "1",
        **extra,
    }
    path.write_text(json.dumps(account))
    return pem


def _jwt_claims(authorization: str) -> dict[str, object]:
    token = authorization.removeprefix("Bearer ")
    payload = token.split(".")[1]
    claims: dict[str, object] = json.loads(base64.urlsafe_b64decode(payload + "=" * 4))
    return claims


def test_the_environment_configures_the_gcs_client(
    gs_server: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gs_server.put("env/m.safetensors", _shard(8))
    uri = "gs://models/env"
    # STORAGE_EMULATOR_HOST (host:port, as google-cloud-storage takes it): anonymous.
    host = gs_server.endpoint.removeprefix("http://")
    with gs_server.proxy() as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint.removeprefix("http://"))
        assert len(Checkpoint.open(uri).tensors) == 3
        assert all("authorization" not in r.headers for r in proxy.requests)
        # GOOGLE_APPLICATION_CREDENTIALS: a service account's key signs each request's token.
        pem = _service_account(tmp_path / "account.json")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "account.json"))
        proxy.requests.clear()
        assert len(Checkpoint.open(uri).tensors) == 3
        claims = _jwt_claims(proxy.requests[0].headers["authorization"])
        assert claims["iss"] == "loader@asyncslab-tests.iam.gserviceaccount.com"
    # storage_options override the environment key by key: here the base URL.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")  # nothing listens
    assert len(Checkpoint.open(uri, storage_options={"base_url": f"http://{host}"}).files) == 1
    # A key the client cannot use is refused without showing it.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    (tmp_path / "account.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "account.json").read_text()), "private_key": pem[:200]}
        )
    )
    with pytest.raises(CheckpointError, match=r"gs://models") as refused:
        Checkpoint.open(uri)
    assert pem[40:200] not in f"{refused.value} {refused.value.details}"


def test_a_gcs_service_account_file_may_name_the_emulator(
    gs_server: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GOOGLE_SERVICE_ACCOUNT: a key file with ``gcs_base_url`` and ``disable_oauth``, the
    object_store crate's way to reach an emulator without any other setting."""
    gs_server.put("sa/m.safetensors", _shard(9))
    _service_account(tmp_path / "sa.json", gcs_base_url=gs_server.endpoint, disable_oauth=True)
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(tmp_path / "sa.json"))
    ckpt = Checkpoint.open("gs://models/sa", storage_options={"allow_http": True})
    assert list(ckpt.tensors) == ["t9.0", "t9.1", "t9.2"]


def test_the_environment_configures_the_azure_client(
    az_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    az_server.put("env/m.safetensors", _shard(10))
    uri = "az://models/env"
    # A connection string, as Azure's SDKs and tools take it.
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", az_server.connection_string())
    assert len(Checkpoint.open(uri).tensors) == 3
    wrong = "d3Jvbmcta2V5LWZyb20tYS1jb25uZWN0aW9uLXN0cmluZw=="
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        az_server.connection_string().replace(AZURE_KEY, wrong),
    )
    with pytest.raises(MissingFileError, match=r"az://models/env.*access denied") as refused:
        Checkpoint.open(uri)
    assert wrong not in f"{refused.value} {refused.value.details}"
    # storage_options override its parts key by key.
    assert len(Checkpoint.open(uri, storage_options={"account_key": AZURE_KEY}).files) == 1
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    # Account, key and endpoint, each in its variable.
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURE_KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", f"{az_server.endpoint}/{AZURE_ACCOUNT}")
    assert len(Checkpoint.open(uri).tensors) == 3
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong)
    with pytest.raises(MissingFileError, match="access denied") as refused:
        Checkpoint.open(uri)
    assert wrong not in f"{refused.value} {refused.value.details}"
    for name in (
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_ENDPOINT",
    ):
        monkeypatch.delenv(name)
    # The emulator switch: the development account, at AZURITE_BLOB_STORAGE_URL.
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", az_server.endpoint)
    assert len(Checkpoint.open(uri).tensors) == 3


def test_a_public_azure_container_is_read_anonymously(az_server: AzuriteServer) -> None:
    az_server.put("open/m.safetensors", _shard(11), bucket=PUBLIC_CONTAINER)
    az_server.put("closed/m.safetensors", _shard(11))
    anonymous = {
        "skip_signature": True,
        "account_name": AZURE_ACCOUNT,
        "endpoint": f"{az_server.endpoint}/{AZURE_ACCOUNT}",
    }
    ckpt = Checkpoint.open(f"az://{PUBLIC_CONTAINER}/open", storage_options=anonymous)
    assert len(ckpt.tensors) == 3
    with pytest.raises(MissingFileError, match=r"az://models/closed.*access denied"):
        Checkpoint.open("az://models/closed", storage_options=anonymous)


def test_bad_credentials_are_refused_without_showing_the_secret(
    object_server: ObjectServer, object_small: str
) -> None:
    bad = "not-the-secret-0123456789"
    wrong = {
        "s3": {"secret_access_key": bad},
        "gs": {"bearer_token": bad},
        "az": {"account_key": base64.b64encode(bad.encode()).decode()},
    }[object_server.scheme]
    with object_server.proxy() as proxy:
        if object_server.scheme == "gs":  # the emulator checks no token: refuse as GCS does
            proxy.add(Fault("status", lambda r: True, status=401, times=-1))
        options = {**object_server.options(proxy.endpoint), **wrong}
        pattern = rf"{object_server.scheme}://models/small.*access denied"
        with pytest.raises(MissingFileError, match=pattern) as refused:
            Checkpoint.open(object_small, storage_options=options)
    text = f"{refused.value} {refused.value!r} {refused.value.details}"
    for secret in (*wrong.values(), object_server.secret):
        assert secret not in text
    assert refused.value.__cause__ is None  # the client's message (with its debug dump) goes


def test_a_missing_bucket_or_object_is_a_missing_file_error(
    object_server: ObjectServer, object_small: str
) -> None:
    options = object_server.options()
    scheme = object_server.scheme
    if scheme == "gs":
        # fake-gcs-server answers the listing of a bucket it lacks with a 500 (GCS: 404),
        # retried, then reported naming the bucket.
        with pytest.raises(CheckpointError, match=r"gs://no-such-bucket/x.*500"):
            Checkpoint.open("gs://no-such-bucket/x", storage_options=options)
    else:
        with pytest.raises(MissingFileError, match=rf"{scheme}://no-such-bucket/x.*not found"):
            Checkpoint.open(f"{scheme}://no-such-bucket/x", storage_options=options)
    with pytest.raises(MissingFileError, match=rf"{scheme}://models/small/absent.safetensors"):
        Checkpoint.open(f"{object_small}/absent.safetensors", storage_options=options)
    with pytest.raises(MissingFileError, match="no \\*.safetensors objects"):
        Checkpoint.open(f"{scheme}://models/nothing-here/", storage_options=options)


def _index(weight_map: dict[str, str]) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


def test_index_rules_hold_for_objects(object_server: ObjectServer) -> None:
    options = object_server.options()
    put, scheme = object_server.put, object_server.scheme
    put("idx/a.safetensors", _shard(3, n=1))
    put("other-prefix/b.safetensors", _shard(4, n=1))
    index = "model.safetensors.index.json"
    put(f"idx/{index}", _index({"t3.0": "../other-prefix/b.safetensors"}))
    uri = f"{scheme}://models/idx"
    with pytest.raises(UnsafePathError, match=rf"{uri}/model.safetensors.index.json"):
        Checkpoint.open(uri, storage_options=options)
    put(f"idx/{index}", _index({"t3.0": "gone.safetensors"}))
    with pytest.raises(MissingFileError, match=rf"{uri}/gone.safetensors.*index"):
        Checkpoint.open(uri, storage_options=options)
    put(f"idx/{index}", _index({"t3.0": "a.safetensors", "x": "./a.safetensors"}))
    with pytest.raises(IndexFileError, match="name the same object"):
        Checkpoint.open(uri, storage_options=options)
    put(f"idx/{index}", _index({"t3.0": "a.safetensors"}))
    assert list(Checkpoint.open(uri, storage_options=options).tensors) == ["t3.0"]


def test_header_rules_hold_for_objects(object_server: ObjectServer) -> None:
    options = object_server.options()
    uri = f"{object_server.scheme}://models/bad"
    object_server.put("bad/long.safetensors", _shard(5) + b"\0")
    with pytest.raises(PayloadSizeError, match=rf"{uri}/long.safetensors.*trailing"):
        Checkpoint.open(f"{uri}/long.safetensors", storage_options=options)
    object_server.put("bad/short.safetensors", _shard(5)[:-1])
    with pytest.raises(PayloadSizeError, match=rf"{uri}/short.safetensors.*truncated"):
        Checkpoint.open(f"{uri}/short.safetensors", storage_options=options)
    with pytest.raises(CheckpointError, match="JSON object, not a safetensors"):
        Checkpoint.open(f"{uri}/config.json", storage_options=options)


def test_an_object_replaced_while_opened_is_refused(object_server: ObjectServer) -> None:
    object_server.put("swap/m.safetensors", _shard(6))

    def replace(request: Request) -> None:
        object_server.put("swap/m.safetensors", _shard(7))

    def shard_get(request: Request) -> bool:
        return request.method == "GET" and object_server.key_of(request) == (
            "models",
            "swap/m.safetensors",
        )

    with object_server.proxy() as proxy:
        proxy.add(Fault("before", shard_get, hook=replace))
        options = object_server.options(proxy.endpoint)
        uri = f"{object_server.scheme}://models/swap"
        with pytest.raises(CheckpointError, match=rf"{uri}/m.safetensors.*changed"):
            Checkpoint.open(uri, storage_options=options)


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


def test_a_header_larger_than_the_first_read_is_fetched_whole(
    object_server: ObjectServer,
) -> None:
    """The first GET of an object takes its first MiB; a larger header takes one more (on
    GCS pinned to the generation the first one found)."""
    data = save({"w": torch.ones(3)}, metadata={"note": "x" * ((1 << 20) + 100)})
    object_server.put("big-header/m.safetensors", data)
    ckpt = _open(object_server, f"{object_server.scheme}://models/big-header")
    assert ckpt.files[0].header_len > 1 << 20
    assert ckpt.files[0].metadata["note"] == "x" * ((1 << 20) + 100)


def test_no_repr_shows_a_secret(object_server: ObjectServer, object_small: str) -> None:
    ckpt = _open(object_server, object_small)
    shown = f"{ckpt!r} {ckpt.files!r} {ckpt.tensors!r}"
    assert object_server.secret not in shown
    assert f"{object_small}/model-00001-of-00003.safetensors" in shown


def test_the_test_command_installs_the_azurite_the_fixture_names() -> None:
    from support.object_servers import AZURITE_VERSION

    root = Path(__file__).parents[2]
    for name in ("README.md", ".ci/run"):
        assert f"npm install --prefix .venv azurite@{AZURITE_VERSION}" in (root / name).read_text()


def test_a_missing_emulator_fails_under_ci_and_skips_elsewhere_naming_its_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from support.object_servers import AZURITE_VERSION, missing

    install = f"npm install --prefix .venv azurite@{AZURITE_VERSION}"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"Azurite is not installed: {install}"):
        missing("Azurite", install)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=f"Azurite is not installed: {install}"):
        missing("Azurite", install)

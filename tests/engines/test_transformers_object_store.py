"""``asyncslab.transformers.from_pretrained("s3://...")`` against a real S3 server (SeaweedFS
on 127.0.0.1, ``support/s3server.py``): the config and generation config fetched by
asyncslab's own client, the weights read with ranged GETs straight into the parameters,
the model bit-identical to transformers' ``from_pretrained`` of the same files (which
cannot read ``s3://`` at all)."""

from __future__ import annotations

from pathlib import Path

import pytest

import asyncslab.transformers as ast
from asyncslab.errors import CoverageError, MissingFileError
from support.s3server import SeaweedServer, upload
from tests.engines.test_transformers import _drop, _rewrite, assert_same_model
from tests.engines.transformers_models import build, save

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("name", "fused"), [("qwen3_moe", False), ("llama_tied", True)])
def test_from_s3_equals_from_pretrained_of_the_files(
    s3_server: SeaweedServer, tmp_path: Path, name: str, fused: bool
) -> None:
    directory = save(build(name), tmp_path / name, fused=fused)
    upload(s3_server.store(), f"transformers/{name}", directory)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model, report = ast.load(
        f"s3://models/transformers/{name}",
        storage_options=s3_server.options(),
        request_size=4096,  # several GETs per tensor
    )
    assert_same_model(ref, model)
    assert model.name_or_path == f"s3://models/transformers/{name}"
    assert report.files > 1
    assert not report.converted


def test_from_s3_a_missing_tensor_or_config_is_named(
    s3_server: SeaweedServer, tmp_path: Path
) -> None:
    directory = save(build("mixtral"), tmp_path / "m")
    missing = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    bad = _rewrite(directory, tmp_path / "bad", _drop(missing))
    store = s3_server.store()
    upload(store, "transformers/missing", bad)
    (bad / "config.json").unlink()
    upload(store, "transformers/no-config", bad)
    options = s3_server.options()
    with pytest.raises(
        CoverageError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.1"
    ):
        ast.from_pretrained("s3://models/transformers/missing", storage_options=options)
    with pytest.raises(MissingFileError, match="no config.json under s3://models/transformers/no"):
        ast.from_pretrained("s3://models/transformers/no-config", storage_options=options)


def test_from_object_storage_fewer_gets_are_in_flight_through_obstore_unless_set(
    s3_server: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Presigned GETs hold no memory: the loader's 16 in flight. Through obstore each client
    thread keeps its freed responses resident, so this path lowers the in-flight default
    there (``gs://``, a proxy in the environment, ``presigned_gets=False``); an option set
    by the caller wins either way."""
    from asyncslab import Checkpoint
    from asyncslab.engines._transformers import (
        OBJECT_STORE_REQUESTS,
        PRESIGNED_REQUESTS,
        _load_options,
    )
    from asyncslab.loading._options import LoadOptions

    def in_flight(options: LoadOptions) -> dict[str, int]:
        return {
            "request_concurrency": options.request_concurrency,
            "request_size": options.request_size,
        }

    uri = "s3://models/transformers/in-flight"
    upload(s3_server.store(), "transformers/in-flight", save(build("mixtral"), tmp_path / "m"))
    opened = Checkpoint.open(uri, storage_options=s3_server.options())
    assert in_flight(_load_options(uri, {}, opened)) == PRESIGNED_REQUESTS
    assert PRESIGNED_REQUESTS == in_flight(LoadOptions())  # the loader's own
    asked = _load_options(uri, {"request_concurrency": 3, "io_workers": 2}, opened)
    assert (asked.request_concurrency, asked.io_workers) == (3, 2)
    for source, options, checkpoint in (
        (uri, {}, None),  # not open yet: the options are only checked
        (uri, {"presigned_gets": False}, opened),
        ("gs://models/m", {}, None),
        ("az://models/m", {}, None),
    ):
        assert in_flight(_load_options(source, options, checkpoint)) == OBJECT_STORE_REQUESTS
    assert (
        OBJECT_STORE_REQUESTS["request_concurrency"] * OBJECT_STORE_REQUESTS["request_size"]
        < LoadOptions().request_concurrency * LoadOptions().request_size
    )
    assert _load_options("/models/m", {}) == LoadOptions()
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # http.client would not use it
    assert in_flight(_load_options(uri, {}, opened)) == OBJECT_STORE_REQUESTS
    asked = _load_options(uri, {"request_concurrency": 3, "io_workers": 2}, opened)
    assert (asked.request_concurrency, asked.io_workers) == (3, 2)

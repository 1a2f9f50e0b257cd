"""``asyncslab inspect`` and ``asyncslab load`` of an s3:// checkpoint, against a real S3
server (SeaweedFS), and of gs:// and az:// ones against their emulators, credentials and
endpoint from the environment."""

from __future__ import annotations

import json

import pytest

from asyncslab import Checkpoint
from asyncslab.cli._main import main
from asyncslab.testing import SyntheticCheckpoint
from support.object_servers import AzuriteServer, GcsServer
from support.s3server import SeaweedServer
from tests.conftest import ObjectServer


@pytest.fixture
def s3_env(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    options = s3_server.options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.mark.usefixtures("s3_env")
def test_inspect_and_load_an_s3_checkpoint(
    s3_small: str, small_checkpoint: SyntheticCheckpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    tier_map = str(small_checkpoint.tier_map_path)
    assert main(["inspect", s3_small, "--tier-map", tier_map, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"]["path"] == s3_small
    names = [f["name"] for f in doc["checkpoint"]["files"]]
    assert names == [f.path.name for f in Checkpoint.open(small_checkpoint.root).files]
    assert main(["load", s3_small, "--tier-map", tier_map, "--no-progress", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "complete"
    assert report["bytes_landed"] == report["bytes_needed"] > 0


@pytest.mark.usefixtures("s3_env")
def test_load_refuses_verify_for_an_s3_checkpoint(
    s3_small: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", s3_small, "--verify", "--no-progress"]) == 2
    assert "--verify" in capsys.readouterr().err


@pytest.mark.parametrize("object_server", ["gs", "az"], indirect=True)
def test_inspect_and_load_a_gcs_or_azure_checkpoint(
    object_server: ObjectServer,
    object_small: str,
    small_checkpoint: SyntheticCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The cloud's own variables, as a user sets them in a shell."""
    if isinstance(object_server, GcsServer):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", object_server.endpoint)
    elif isinstance(object_server, AzuriteServer):
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", object_server.connection_string())
    tier_map = str(small_checkpoint.tier_map_path)
    assert main(["inspect", object_small, "--tier-map", tier_map, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"]["path"] == object_small
    command = ["load", object_small, "--tier-map", tier_map, "--no-progress", "--json", "-"]
    assert main(command) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "complete"
    assert report["bytes_landed"] == report["bytes_needed"] > 0

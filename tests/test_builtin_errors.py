"""asyncslab's errors are also the builtins a caller catches the standard way: a missing file
is a ``FileNotFoundError``, a read that timed out a ``TimeoutError`` (as ``asyncio.timeout``
raises), raised by real loads, not only by the classes' bases."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import asyncslab
from asyncslab import Checkpoint, LoadOptions, SlabSet, plan
from asyncslab.loading import _copy
from asyncslab.loading._read import pread_scatter
from asyncslab.testing import SyntheticCheckpoint
from support.faults import HANG_S
from tests.helpers import wait_io_threads_gone


def test_a_shard_the_index_names_but_is_absent_is_a_file_not_found(tmp_path: Path) -> None:
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError) as caught:
        Checkpoint.open(tmp_path)
    assert isinstance(caught.value, asyncslab.errors.MissingFileError)
    assert isinstance(caught.value, asyncslab.CheckpointError)
    assert "model-00001-of-00001.safetensors" in str(caught.value)


@pytest.mark.asyncio
async def test_a_read_that_makes_no_progress_is_a_timeout_error(
    moe_checkpoint: SyntheticCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every read waits until the test lets it go, after the load has timed out: the
    # timeout fires whatever the machine's speed.
    release = threading.Event()

    def held(*args: object, **kwargs: object) -> int:
        release.wait(HANG_S)
        return pread_scatter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_copy, "pread_scatter", held)
    ckpt = Checkpoint.open(moe_checkpoint.root)
    slabs = SlabSet(plan(ckpt))
    try:
        with pytest.raises(TimeoutError) as caught:
            await slabs.load(ckpt, options=LoadOptions(read_timeout=0.05))
        assert isinstance(caught.value, asyncslab.errors.ReadTimeoutError)
        assert isinstance(caught.value, asyncslab.LoadError)
        assert "read_timeout=0.05" in str(caught.value)
    finally:
        release.set()
        await slabs.aclose()
    assert await wait_io_threads_gone() == []

"""The object-store client is an extra (``asyncslab[s3]``): without it, a URI is refused by
an ``ImportError`` that says what to install, whichever stage reached the bucket first."""

from __future__ import annotations

import sys

import pytest

import asyncslab
from asyncslab._objects import client, store_spec


def test_a_bucket_without_obstore_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore raises ImportError
    with pytest.raises(ImportError, match=r"s3://models needs obstore.*asyncslab\[s3\]"):
        client(store_spec("s3", "models", {}))
    with pytest.raises(ImportError, match=r"gs://weights needs obstore"):
        asyncslab.Checkpoint.open("gs://weights/llama")

"""Reads pinned to the version of an object that was found: ``If-Match`` its ETag, the ETag
of every response checked too (a GCS emulator ignores ``If-Match``), and where the first
response names the object's generation (GCS), that generation asked for by every later
request. An object replaced meanwhile is refused, never read as a mix of two versions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import FileChangedError
from ._location import ObjectLocation

if TYPE_CHECKING:
    from obstore import GetOptions

__all__ = ["changed", "check_etag", "current_etag", "etag_of", "pinned", "with_version"]

#: Schemes whose first response's version (a GCS object's generation) pins later requests;
#: an S3 version id needs a permission of its own (s3:GetObjectVersion) that a reader may
#: lack, and Azure honours If-Match.
_PINNED_VERSIONS = frozenset({"gs"})


def etag_of(meta: Mapping[str, Any]) -> str | None:
    """An object's ETag as a response header gives it (quoted): a listing of GCS or Azure
    gives it bare, and ``If-Match`` wants the quoted form."""
    etag = meta.get("e_tag")
    if etag is None:
        return None
    etag = str(etag)
    return etag if etag.startswith(('"', "W/")) else f'"{etag}"'


def pinned(location: ObjectLocation, start: int, end: int) -> GetOptions:
    """The options of a GET of bytes ``[start, end)`` of ``location`` as it was found:
    ``If-Match`` its ETag, and its generation where one was recorded (GCS)."""
    options: GetOptions = {"range": (start, end)}
    if location.etag is not None:
        options["if_match"] = location.etag
    if location.version is not None:
        options["version"] = location.version
    return options


def with_version(location: ObjectLocation, meta: Mapping[str, Any]) -> ObjectLocation:
    """``location`` pinned to the version a response's ``meta`` names, where its store's
    later requests are to ask for it and none was recorded yet."""
    version = meta.get("version")
    if location.version is None and version and location.store.scheme in _PINNED_VERSIONS:
        return dataclasses.replace(location, version=str(version))
    return location


def check_etag(location: ObjectLocation, got: str | None) -> None:
    """Refuse a response whose ETag is not the one ``location`` was found with."""
    if location.etag is not None and got is not None and got != location.etag:
        raise changed(location, got)


def current_etag(store: Any, key: str) -> str | None:
    """The ETag ``key`` has now; None where it is gone (or unreachable)."""
    import obstore

    try:
        return etag_of(obstore.head(store, key))
    except Exception:  # gone, or unreachable: the error says "absent"
        return None


def changed(location: ObjectLocation, got: str | None) -> FileChangedError:
    """The error of a read that found ``location`` replaced (``got``: its ETag now; None:
    gone)."""
    now = "is gone" if got is None else f"now has ETag {got}"
    return FileChangedError(
        f"object changed since the checkpoint was opened (bucket {location.store.bucket!r}, "
        f"key {location.key!r}: ETag {location.etag} expected, it {now}); open and plan it "
        "again",
        file=location.path,
        bucket=location.store.bucket,
        key=location.key,
        expected=location.etag,
        got=got,
    )

"""Objects found: a prefix listed (every page of it), or one object asked for by name; each
as obstore's metadata (``path``, ``size``, ``e_tag``, ``last_modified``, ``version``)."""

from __future__ import annotations

from typing import Any

from ._client import refused
from ._location import ObjectPath, StoreSpec

__all__ = ["head", "listing"]


def listing(
    store: Any, spec: StoreSpec, prefix: str, what: str | None = None
) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (all pages), by key; a refusal says ``what`` was
    being done (by default: listing the bucket)."""
    import obstore

    where = ObjectPath.of(spec.scheme, spec.bucket, prefix)
    try:
        pages = obstore.list(store, prefix + "/" if prefix else None, chunk_size=1000)
        return {meta["path"]: dict(meta) for page in pages for meta in page}
    except Exception as err:
        what = what or f"listing bucket {spec.bucket!r}"
        raise refused(err, what, where, spec) from None


def head(store: Any, spec: StoreSpec, key: str) -> dict[str, Any]:
    """The object ``key``'s metadata (:class:`~asyncslab.errors.MissingFileError` where
    there is none)."""
    import obstore

    try:
        return dict(obstore.head(store, key))
    except Exception as err:
        where = ObjectPath.of(spec.scheme, spec.bucket, key)
        raise refused(err, "no such object", where, spec) from None

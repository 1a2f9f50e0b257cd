"""Public names shown under their public module, as httpx's ``__init__`` does: reprs,
tracebacks and pickles read ``asyncslab.Plan``, not ``asyncslab.planning._plan.Plan``."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

__all__ = ["publish"]


def publish(namespace: Mapping[str, Any]) -> None:
    """Gives each class and function in ``namespace["__all__"]`` that a private module of
    ours defines the ``__module__`` of ``namespace``. Pickle finds them there, since that
    module exports them; a class pickled that no public module exports keeps its own module.

    A name both at the top level and in a submodule (``asyncslab.rules.Dense``) shows as
    the top level's (the top level imports the submodules first, so it has the last word).
    The errors keep ``asyncslab.errors``, which defines them and draws their tree."""
    module = namespace["__name__"]
    for name in namespace["__all__"]:
        obj = namespace[name]
        if not isinstance(obj, (type, types.FunctionType)):
            continue
        current = getattr(obj, "__module__", "")
        if not current.startswith("asyncslab.") or obj.__qualname__ != name:
            continue  # not ours, or exported under another name: pickle would not find it
        private = any(part.startswith("_") for part in current.split("."))
        if private or (module == "asyncslab" and current != "asyncslab.errors"):
            obj.__module__ = module

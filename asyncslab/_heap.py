"""Two ways past the Python heap's per-object costs, which every stage meets once a
checkpoint has hundreds of thousands of tensors: the cyclic collector paused while many
acyclic objects are made, and frozen dataclasses built a field at a time."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

__all__ = ["frozen_columns", "gc_paused"]

_T = TypeVar("_T")


def frozen_columns(
    cls: type[_T], n: int, columns: Mapping[str, Sequence[Any]], same: Mapping[str, Any]
) -> list[_T]:
    """``n`` instances of the frozen, slotted dataclass ``cls``, built a field at a time
    rather than an instance at a time: field ``f`` of instance ``i`` is ``columns[f][i]``,
    or ``same[f]``, or the field's default.

    A frozen dataclass's ``__init__`` assigns each field through ``object.__setattr__``, a
    Python-level cost per field per instance that adds up to seconds for a few hundred
    thousand tensors (figures in docs/performance.md). Filling one slot of every instance
    with ``map`` over the slot's descriptor runs the loop in C; the instances are the same
    frozen objects ``__init__`` makes (there is no ``__post_init__`` to skip), as
    ``test_columns_make_the_objects_init_makes`` checks.
    """
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} checks its fields in __post_init__; build it per instance")
    fields = dataclasses.fields(cast(Any, cls))
    names = {f.name for f in fields}
    if unknown := (columns.keys() | same.keys()) - names:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    instances: list[_T] = list(map(object.__new__, itertools.repeat(cls, n)))
    for f in fields:
        column: Iterable[Any]
        if f.name in columns:
            column = columns[f.name]
            if len(column) != n:
                raise ValueError(f"{cls.__name__}.{f.name}: {len(column)} values for {n}")
        elif f.name in same:
            column = itertools.repeat(same[f.name])
        elif f.default is not dataclasses.MISSING:
            column = itertools.repeat(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            column = (f.default_factory() for _ in range(n))
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: give its values")
        collections.deque(map(getattr(cls, f.name).__set__, instances, column), maxlen=0)
    return instances


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    # Parsing a large checkpoint creates millions of small containers, none cyclic; each
    # allocation burst would trigger a collection over everything parsed so far, so the
    # collector's work would grow with the square of the tensor count and find nothing to
    # free (figures in docs/performance.md).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

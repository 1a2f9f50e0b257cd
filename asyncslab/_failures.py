"""What an error raised or kept here holds of another failure: the first line of its
message, or a copy of it without frames. The errors themselves: ``asyncslab.errors``."""

from __future__ import annotations

import copy
import traceback

__all__ = ["detached", "first_line"]


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its repr when the message is empty): what an
    error raised here quotes of the one it wraps."""
    return (str(err).splitlines() or [repr(err)])[0]


def detached(error: BaseException) -> BaseException:
    """A copy of ``error`` that holds no frame: its type, message and fields, its cause and
    context detached in turn, and where it was raised kept as text in a note.

    What a long-lived object keeps of a failure: the error itself holds its traceback, the
    traceback every frame it went through, and those frames their locals; kept by the object
    that appears in those locals, it is a cycle that frees the object's memory only at the
    collector's next full pass. Pinned by
    ``test_a_dropped_slabset_whose_load_failed_frees_its_slabs_without_the_collector``.
    """
    return _detached(error, {})


def _detached(error: BaseException, seen: dict[int, BaseException]) -> BaseException:
    if id(error) in seen:
        return seen[id(error)]
    clone: BaseException
    try:
        if isinstance(error, BaseExceptionGroup):
            clone = error.derive([_detached(e, seen) for e in error.exceptions])
        else:
            clone = copy.copy(error)
    except Exception:  # an error type that cannot be rebuilt from its arguments
        clone = RuntimeError(f"{type(error).__name__}: {error}")
    seen[id(error)] = clone
    clone.__traceback__ = None
    notes = [note for note in getattr(error, "__notes__", ()) if isinstance(note, str)]
    if error.__traceback__ is not None:
        where = "".join(traceback.format_tb(error.__traceback__)).rstrip()
        notes.append(f"raised at (traceback kept as text):\n{where}")
    if notes:
        clone.__notes__ = notes
    if error.__cause__ is not None:
        clone.__cause__ = _detached(error.__cause__, seen)
    if error.__context__ is not None:
        clone.__context__ = _detached(error.__context__, seen)
    clone.__suppress_context__ = error.__suppress_context__
    return clone

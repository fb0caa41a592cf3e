"""Sections of the main thread that a signal handler's exception must not break in the middle of.

``kelastic local`` turns Ctrl-C during its start-up into an exception raised in
the main thread wherever it happens to be (see ``cli._Stopper``). Two places must
not be cut in two: between starting a child process and recording it (the child
would be left running, unknown to whoever stops things) and inside ``fork()``
(Python runs at-fork hooks there, and an exception raised in one is printed and
dropped). Code marks such a place with :func:`uninterrupted`; a handler raises
through :func:`interrupt`, which postpones the exception to the end of the section.

The bookkeeping is per thread: handlers run in the main thread, and only what
that thread does is shielded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["interrupt", "uninterrupted"]

_state = threading.local()


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Postpone :func:`interrupt` exceptions to the end of this block (blocks may nest)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    except BaseException:
        if depth == 0:
            _state.pending = None  # something else is raised already
        raise
    finally:
        _state.depth = depth
    if depth == 0:
        pending, _state.pending = getattr(_state, "pending", None), None
        if pending is not None:
            raise pending


def interrupt(exc: BaseException) -> None:
    """Raise ``exc`` now, or at the end of the current :func:`uninterrupted` block."""
    if getattr(_state, "depth", 0):
        _state.pending = exc
        return
    raise exc

"""The handshake between console tailers and the node's progress display.

``progbar_events`` is a ``dict[str, threading.Event]`` made by :func:`new_progbar_events`
and owned by the display (``kelastic.agent.progress.ProgressDisplay.events``). The
display is the only writer of the bar and the arbiter of the console:

- ``active``  (display): set while a display is running; tailers ignore the rest otherwise.
- ``want``    (tailer):  a tailer has lines to print.
- ``granted`` (display): the bar is erased; the display writes nothing until ``done``.
- ``done``    (tailer):  the tailer has printed its lines; the display may redraw.

Every wait on either side is bounded, so a slow, busy or dead display delays a batch of
lines by at most ``grant_timeout`` and never blocks a tailer indefinitely. Tailers that
share one display take turns through :data:`CONSOLE_LOCK`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = [
    "ACTIVE",
    "CONSOLE_LOCK",
    "DONE",
    "GRANTED",
    "WANT",
    "console_turn",
    "new_progbar_events",
]

ACTIVE = "active"
WANT = "want"
GRANTED = "granted"
DONE = "done"

#: Serialises console writes of all tailers in this process (they share one terminal).
CONSOLE_LOCK = threading.Lock()


def new_progbar_events() -> dict[str, threading.Event]:
    """A fresh, inactive set of handshake events."""
    return {key: threading.Event() for key in (ACTIVE, WANT, GRANTED, DONE)}


@contextmanager
def console_turn(events: Mapping[str, threading.Event] | None, grant_timeout: float = 0.5) -> Iterator[bool]:
    """Tailer side: hold the console for one batch of lines.

    Yields True if an active display erased its bar for us, False if there is no active
    display or it did not answer within ``grant_timeout`` s (the lines are printed anyway).
    The caller must hold :data:`CONSOLE_LOCK` (or its own lock shared by all tailers).
    """
    if not events or ACTIVE not in events or not events[ACTIVE].is_set():
        yield False
        return
    events[DONE].clear()
    events[WANT].set()
    granted = events[GRANTED].wait(grant_timeout)
    try:
        yield granted
    finally:
        events[GRANTED].clear()
        events[WANT].clear()
        events[DONE].set()

"""What the agent waits for, said while it waits, and named when a signal ends the wait.

A wait that may last (the rendezvous store, the peers of a round, the controller's
bounds) runs inside a :class:`Wait`: ``with Wait("the rendezvous store at h:p", log) as w``.
Its loop calls :meth:`Wait.tell` whenever it wakes (and wakes by :meth:`Wait.next_at`
at the latest): a wait that has lasted :data:`FIRST_NOTICE` seconds says what it waits
for at once, then every :data:`NOTICE_EVERY` seconds, so no wait is silent and a short
one prints nothing. :meth:`Wait.update` changes what it waits for as the wait learns
more (what answers at the endpoint, how many peers joined).

An exception that ends a wait (a signal's ``SignalException``, above all) is
remembered with the wait's description: :func:`ended_by` gives it back to whoever
catches that exception, which then says in one line what the agent was waiting for.
Meant for the agent's main thread (where signals are handled); it keeps no lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["FIRST_NOTICE", "NOTICE_EVERY", "Wait", "ended_by", "next_notice"]

#: A wait says what it waits for once it lasted this long (seconds) ...
FIRST_NOTICE = 5.0
#: ... and again this often.
NOTICE_EVERY = 30.0

# The newest exception that ended a wait, and what that wait waited for.
_ended: tuple[BaseException, str] | None = None


def next_notice(started: float, said: float | None) -> float:
    """When a wait begun at ``started`` and last said at ``said`` (None: never) says it next (pure)."""
    return started + FIRST_NOTICE if said is None else said + NOTICE_EVERY


def ended_by(exc: BaseException) -> str | None:
    """What the wait that ``exc`` ended waited for (the innermost one), or None if none did."""
    if _ended is not None and _ended[0] is exc:
        return _ended[1]
    return None


class Wait:
    """One wait of the agent's main thread (see the module docstring).

    ``what`` completes "waiting for …"; ``clock`` is monotonic seconds (injectable for tests).
    """

    def __init__(
        self, what: str, logger: logging.Logger, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self._log = logger
        self._clock = clock
        self.started = clock()
        self.said: float | None = None

    def update(self, what: str) -> None:
        """What the wait waits for now (said at the next notice)."""
        self.what = what

    def next_at(self) -> float:
        """The monotonic instant of the next notice: a loop waits no longer before it calls :meth:`tell`."""
        return next_notice(self.started, self.said)

    def tell(self, what: Callable[[], str] | None = None) -> bool:
        """Log what the wait waits for if a notice is due; True if it did.

        ``what``: computes the description only when due (a store read, say).
        """
        now = self._clock()
        if now < self.next_at():
            return False
        if what is not None:
            self.what = what()
        self.said = now
        self._log.info("waiting for %s (%.0f s)", self.what, now - self.started)
        return True

    def __enter__(self) -> Wait:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _ended
        # The innermost wait names the exception: an outer one it also ends keeps that name.
        if exc is not None and (_ended is None or _ended[0] is not exc):
            _ended = (exc, self.what)

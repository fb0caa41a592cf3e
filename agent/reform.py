"""A re-form's stop off its critical path: the old workers stop while the next group forms.

A restart stops the node's workers (SIGTERM, then waiting for them to exit: hundreds of
milliseconds for a worker inside a collective, running its exit handlers or finishing a save)
and joins the next rendezvous round. The round closes when its last member joined, so when
every node stopped its workers first, the slowest stop of the group was on every node's path.
:class:`OverlappedStop` runs the stop in a thread while the agent joins the round and
exchanges the ranks with its peers; the agent waits for it (:meth:`OverlappedStop.wait`)
before it tells the checkpoint ring the new members and starts the new workers. So the old
and the new workers never run side by side, and the old workers' last commits replicate on
the old ring.

``KELASTIC_STOP_BEFORE_JOIN=1`` (:data:`STOP_BEFORE_JOIN_ENV`) stops the workers before the
join, as kelastic did before (:func:`overlap_enabled`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["STOP_BEFORE_JOIN_ENV", "OverlappedStop", "overlap_enabled"]

#: Environment variable: ``1`` stops the old workers before joining the next round.
STOP_BEFORE_JOIN_ENV = "KELASTIC_STOP_BEFORE_JOIN"


def overlap_enabled(env: Mapping[str, str]) -> bool:
    """Whether a restart stops the old workers while it joins (the default), from ``env``."""
    return env.get(STOP_BEFORE_JOIN_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


class OverlappedStop:
    """One restart's stop of the old workers, in a thread of its own (or at once: ``overlap`` False).

    ``stop`` is the agent's stop of its workers; ``done(seconds, ended)`` is called on the
    agent's thread by the first :meth:`wait` once the stop is over: what it took, and when it
    ended (wall clock: the first wait may come later, after the join). :meth:`wait` re-raises what the
    stop raised; it may be called any number of times (the later calls return at once).
    """

    def __init__(
        self,
        stop: Callable[[], None],
        done: Callable[[float, float], None],
        overlap: bool | None = None,
    ) -> None:
        self._stop = stop
        self._done: Callable[[float, float], None] | None = done
        self._error: BaseException | None = None
        self._began = time.monotonic()
        self._seconds = 0.0
        self._ended = 0.0
        self._thread: threading.Thread | None = None
        if overlap if overlap is not None else overlap_enabled(os.environ):
            self._thread = threading.Thread(target=self._run, name="kelastic-stop-workers", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self._stop()
        except BaseException as exc:  # re-raised on the agent's thread by wait()
            self._error = exc
        self._seconds = time.monotonic() - self._began
        self._ended = time.time()

    @property
    def overlapped(self) -> bool:
        """Whether the stop runs beside the join (in a thread)."""
        return self._thread is not None

    def wait(self) -> None:
        """Block until the old workers are stopped; re-raise the stop's exception (once)."""
        if self._thread is not None:
            self._thread.join()
        done, self._done = self._done, None
        error, self._error = self._error, None
        if done is not None:
            done(self._seconds, self._ended)
        if error is not None:
            raise error

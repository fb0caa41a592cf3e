"""The event watcher of a rendezvous handler: one blocking ``get`` per store event, then wake the waiters.

Anything another node must react to pushes an *event* (``protocol.push_event``):
``add(ev, 1)`` then set ``ev/<n>`` to what happened. :class:`EventWatcher` takes
the events one by one on a connection of its own (the thread :meth:`EventWatcher.run`),
records what they tell (the size and worker store of a closed round, that the job
is closed), bumps a *generation* and notifies a condition variable. The handler's
waiters block on that condition (:meth:`EventWatcher.wait_event`) with their own
deadlines, never on a sleep loop.

The watcher's *epoch* changes whenever events may have been missed (it
reconnected, or it skipped events whose writer died); :meth:`EventWatcher.epoch`
is None while it is disconnected. A waiter that saw the same epoch before and
after reading a key knows that no event about that key was missed meanwhile.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from .protocol import (
    JOB_CLOSED_EVENT,
    RECONNECT_TIMEOUT,
    Fate,
    RoundClose,
    RunKeys,
    connect_store,
    first_line,
    parse_close_event,
    read_counter,
    reconnect_backoff,
)

__all__ = ["EventWatcher"]

log = logging.getLogger(__name__)

#: How long the watcher blocks on one event key before re-arming (no meaning beyond that).
_EVENT_WAIT = datetime.timedelta(hours=1)


class EventWatcher:
    """What the events told, and the condition its waiters block on (thread-safe).

    ``stop`` (shared with the handler) ends :meth:`run` and every wait.
    """

    def __init__(self, keys: RunKeys, host: str, port: int, stop: threading.Event) -> None:
        self._keys = keys
        self._host, self._port = host, port
        self._stop = stop
        self._wake = threading.Condition()
        self._generation = 0
        self._watching = False
        self._epoch = 0
        # Closes of recent rounds, as their events told.
        self._closes: dict[int, RoundClose] = {}
        # Rounds in which a fate was claimed, as the job's (signed) events told.
        self._fated: set[int] = set()
        self.job_closed = threading.Event()  # set once the job's closed event arrived
        # Wakes the watcher from its reconnect back-off: the store answered another thread.
        self.retry_now = threading.Event()

    @property
    def generation(self) -> int:
        """Bumped by every event and every local change a waiter must look at."""
        return self._generation

    @property
    def stopped(self) -> bool:
        """Whether the handler was shut down: every :meth:`wait_event` returns at once from then on."""
        return self._stop.is_set()

    def bump(self) -> None:
        """Wake every waiter (they re-evaluate what they wait for)."""
        with self._wake:
            self._generation += 1
            self._wake.notify_all()

    def wait_event(self, generation: int, timeout: float) -> bool:
        """Block until the generation differs from ``generation``, stop, or ``timeout`` s;
        False on the timeout."""
        with self._wake:
            return self._wake.wait_for(
                lambda: self._generation != generation or self._stop.is_set(), max(timeout, 0.0)
            )

    def set_watching(self, connected: bool) -> None:
        """A new epoch: events of the old one may have been missed."""
        with self._wake:
            self._watching = connected
            self._epoch += 1

    def epoch(self) -> int | None:
        """The watcher's epoch, None while it is disconnected (events are being missed)."""
        with self._wake:
            return self._epoch if self._watching else None

    def close_of(self, r: int) -> RoundClose | None:
        """How round ``r`` closed, if its event arrived."""
        with self._wake:
            return self._closes.get(r)

    def fate_claimed(self, r: int) -> bool:
        """Whether an event signed by the job told of a fate claimed in round ``r``."""
        with self._wake:
            return r in self._fated

    def forget_closes(self) -> None:
        """The store restarted: the closes it told are of rounds of the old store."""
        with self._wake:
            self._closes.clear()

    def on_event(self, stored: bytes, n: int) -> bool:
        """Record what event ``n`` tells and wake the waiters; False once the job is closed.

        An event the job did not sign (a stranger's) tells nothing, neither a close nor the
        job's end; it may hide the job's own event of that number (written after it, never
        read), so it starts a new epoch: the waiters read what they wait for from the store.
        """
        kind = self._keys.verify(self._keys.event(n), stored)
        if kind is None:
            self.set_watching(True)
            self.bump()
            return True
        if kind == JOB_CLOSED_EVENT.encode():
            self.job_closed.set()
            self.bump()
            return False
        closed = parse_close_event(kind)
        fated = _fate_round(kind)
        with self._wake:
            if fated is not None:
                self._fated.add(fated)
                self._fated.difference_update([n for n in self._fated if n < fated - 2])
            if closed is not None:
                r, close = closed
                self._closes[r] = close
                for old in [n for n in self._closes if n < r - 2]:  # only recent rounds are waited on
                    del self._closes[old]
            self._generation += 1
            self._wake.notify_all()
        return True

    def run(
        self,
        first: dist.TCPStore,
        seq: int,
        current: Callable[[], bool],
        reattach: Callable[[], None],
        lost: Callable[[], None],
    ) -> None:
        """The thread: take the events after ``seq`` one by one (a blocking get of the next event key).

        One store call per event (torch's ``get`` waits for the key, then reads it),
        whose value is all a waiter needs from it. ``current()`` False: this thread
        was replaced by one on a fresh connection, and exits. After a lost store it
        reconnects with a back-off, then calls ``reattach()`` (the handler connects
        again and re-establishes its round); ``lost()`` when the store is lost.
        """
        k = self._keys
        store: dist.TCPStore | None = first
        first.set_timeout(_EVENT_WAIT)
        failures = 0
        while not self._stop.is_set():
            if not current():
                return  # replaced by a watcher on a fresh connection
            try:
                if store is None:
                    store = connect_store(self._host, self._port, RECONNECT_TIMEOUT)
                    store.set_timeout(_EVENT_WAIT)
                    reattach()
                    seq = read_counter(store, k.events)
                    failures = 0
                    self.set_watching(True)
                    self.bump()
                # Checked after reading seq: the handler sets stop before pushing its event.
                if self._stop.is_set():
                    return
                try:
                    kind = store.get(k.event(seq + 1))
                except dist.DistStoreError:
                    # The long wait expired, or whoever took event seq+1 died before setting
                    # it: go on from the latest event (waiters re-read what they skipped).
                    latest = read_counter(store, k.events)
                    if latest > seq:
                        seq = latest
                        self.set_watching(True)
                    continue
                seq += 1
                if not current():
                    return
                if not self.on_event(kind, seq):
                    return  # the job is finished: nothing left to watch
            except (dist.DistError, RendezvousConnectionError, RuntimeError) as exc:
                if not current():
                    return
                self.set_watching(False)
                if store is not None and not self._stop.is_set():
                    log.warning("kelastic rendezvous: event watch lost the store: %s", first_line(exc))
                    lost()
                store = None
                failures += 1
                self.retry_now.wait(reconnect_backoff(failures))
                self.retry_now.clear()


def _fate_round(kind: bytes) -> int | None:
    """The round of a fate event (``<fate> <R> <name>``, see ``protocol.claim_fate``), else None."""
    parts = kind.split(b" ")
    if len(parts) != 3 or parts[0].decode(errors="replace") not in {f.value for f in Fate}:
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None

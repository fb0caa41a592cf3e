"""The keep-alive of a rendezvous handler: its heartbeat, and its watch over the peers it must judge.

A thread (:meth:`KeepAlive.run`, on a store connection of its own) writes its next signed
heartbeat to ``hb/<name>`` every ``keep_alive_interval`` (:mod:`.memberrecords`) and then:

- claims ``dead`` for the peers whose peer link closed (:meth:`KeepAlive.suspect`,
  called by the handler's ``PeerLink``; kept until the store takes the claim, so a
  peer lost while the store was away is claimed once it is back);
- judges the heartbeat of its ring successor (one round trip) and, while this node
  waits in slots 0-2 of an open round (a *decider*), the heartbeats of every member
  of the previous round (the *sweep*: several deaths at once are still found). A
  heartbeat that did not move for ``node_timeout`` on this node's monotonic clock,
  over at least three readings, means ``dead`` (``liveness.HeartbeatTracker``).

What this node is (a member, a joiner, its latest round) is read through the
``rounds`` callable under the handler's lock, so the thread always sees the
handler's current state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from .closewait import DECIDERS
from .liveness import HeartbeatTracker
from .memberrecords import Beats, beat, read_members
from .protocol import (
    RECONNECT_TIMEOUT,
    Fate,
    RunKeys,
    claim_fate,
    connect_store,
    first_line,
    get_or_none,
    reconnect_backoff,
)
from .rounds import Joining, Member
from .settings import RendezvousSettings

__all__ = ["KeepAlive", "Rounds"]

log = logging.getLogger(__name__)

#: Readings of an unmoved heartbeat (besides its age) before its node counts as dead.
_MIN_READINGS = 3

#: This node's round as a member (None while it joins), the round it waits in (None
#: while it runs), and the latest round it was a member of (kept while it re-joins).
Rounds = Callable[[], tuple[Member | None, Joining | None, Member | None]]


class KeepAlive:
    """This node's heartbeat and peer watch; ``poke`` wakes the thread early, ``stop`` ends it."""

    def __init__(
        self,
        settings: RendezvousSettings,
        keys: RunKeys,
        lock: threading.RLock,
        rounds: Rounds,
        stop: threading.Event,
    ) -> None:
        self._s = settings
        self._keys = keys
        self._lock = lock
        self._rounds = rounds
        self._stop = stop
        self._suspects: list[tuple[int, str]] = []
        self.poke = threading.Event()

    def suspect(self, r: int, name: str) -> None:
        """The peer link of ``name`` (member of round r) closed: claim ``dead`` at the next beat."""
        with self._lock:
            self._suspects.append((r, name))

    def run(self, first: dist.TCPStore, current: Callable[[], bool]) -> None:
        """The thread: beat every keep_alive_interval; watch the ring successor and, when sweeping, the old round.

        ``current()`` False: this thread was replaced by one on a fresh connection.
        """
        tracker = HeartbeatTracker(self._s.node_timeout, min_readings=_MIN_READINGS)
        beats = Beats()
        members_cache: dict[int, list[str]] = {}
        store: dist.TCPStore | None = first
        failures = 0
        while True:
            try:
                if store is None:
                    store = connect_store(self._s.host, self._s.port, RECONNECT_TIMEOUT)
                    members_cache.clear()
                    # Every peer starts a fresh timer: a restarted store counts heartbeats
                    # from 1 again, and a value read there equal to one read before the
                    # restart is no proof that the heartbeat stood still all along.
                    tracker.retain(set())
                    beats.retain(set())
                beat(store, self._keys, self._s.node_name)
                self.claim_suspects(store)
                self._watch_peers(store, tracker, beats, members_cache)
                failures = 0
            except (dist.DistError, RendezvousConnectionError, RuntimeError) as exc:
                if store is not None:
                    log.debug("kelastic rendezvous: keep-alive lost the store: %s", first_line(exc))
                store = None
                failures += 1
            pause = self._s.keep_alive_interval if not failures else reconnect_backoff(failures)
            self.poke.wait(pause)
            self.poke.clear()
            if self._stop.is_set() or not current():
                return

    def claim_suspects(self, store: dist.TCPStore) -> None:
        """Claim ``dead`` for the peers whose link closed (kept for a later try if the store fails)."""
        with self._lock:
            suspects, self._suspects = self._suspects, []
            last = self._rounds()[2]
        for i, (r, name) in enumerate(suspects):
            # The latest round this node was a member of, also while it re-joins: a peer
            # lost while the store was away is claimed in the round the store got back.
            if last is None or last.round != r:
                continue
            try:
                claimed = claim_fate(store, self._keys, r, name, Fate.DEAD, self._s.node_name)
            except dist.DistError:
                with self._lock:
                    self._suspects[:0] = suspects[i:]
                raise
            if claimed:
                # After the job finished, a peer whose process ended is no news: it is done.
                finished = bool(store.check([self._keys.closed]))
                log.log(
                    logging.DEBUG if finished else logging.WARNING,
                    "kelastic rendezvous: %s (round %d) closed its link: its process is gone; marked dead%s",
                    name,
                    r,
                    " (the job finished)" if finished else "",
                )

    def _watch_peers(
        self,
        store: dist.TCPStore,
        tracker: HeartbeatTracker,
        beats: Beats,
        members_cache: dict[int, list[str]],
    ) -> None:
        k, me = self._keys, self._s.node_name
        with self._lock:
            member, joining, _ = self._rounds()
        targets: list[tuple[int, str]] = []
        if member is not None and member.successor is not None:
            targets.append((member.round, member.successor))
        if joining is not None and joining.slot < DECIDERS and joining.round > 1:
            previous = joining.round - 1
            if previous not in members_cache:
                names = read_members(store, k, previous)
                if names is not None:
                    members_cache.clear()
                    members_cache[previous] = names
            targets.extend((previous, n) for n in members_cache.get(previous, []) if n != me)
        tracker.retain({name for _, name in targets})
        beats.retain({name for _, name in targets})
        if not targets:
            return
        hb_keys = [k.heartbeat(name) for _, name in targets]
        if len(hb_keys) == 1:  # the usual case, a member watching its successor: one round trip
            # Absent only on a restarted store the successor never reached: a value that
            # never moves, so a successor lost while the store was away is found in time.
            values: list[bytes | None] = [get_or_none(store, hb_keys[0])]
        elif store.check(hb_keys):
            values = list(store.multi_get(hb_keys))
        else:
            return
        now = time.monotonic()
        for (r, name), value in zip(targets, values, strict=True):
            # The highest signed beat read: a stranger's value (or none) is no beat.
            if tracker.observe(name, beats.reading(k, name, value), now):
                tracker.forget(name)
                if claim_fate(store, k, r, name, Fate.DEAD, me):
                    log.warning(
                        "kelastic rendezvous: %s (round %d) missed heartbeats for %.1fs; marked dead",
                        name,
                        r,
                        self._s.node_timeout,
                    )

"""The ``kelastic`` rendezvous backend: a dynamic rendezvous built for fast recovery.

Agents meet in a ``torch.distributed.TCPStore`` served by ``kelastic-rendezvous``
(a process that is not a worker). The key layout is in ``protocol``; this module
describes the algorithm and holds the handler, which composes its parts:

- ``join``: take a slot, wait for the round to close (decided by the pure state
  machine ``closewait``, applied with the store reads and writes of ``rounds``),
  become a member; it hosts the worker store in slot 0;
- ``watcher``: the event watcher; ``keepalive``: the heartbeat and peer sweep;
- ``connection``: the store connection, restarts, and the threads on it;
- the handler itself: torch's ``RendezvousHandler`` API, the answers about this
  node's round (``membership_changed``, ``wait_member_lost``), leaving and closing.

Rounds
------
Rounds are numbered 1, 2, ...; exactly one is *open* for joining (``open + 1``),
every earlier one is closed. A node joins the open round R with O(1) store
operations: ``add(r/R/joined, 1)`` hands it a slot (its group rank if it makes
it into the round), then it writes ``r/R/node/<slot>`` and ``r/R/slot/<name>``.
No blob of all nodes is ever read-modified-written.

Round R is closed by a compare-and-set on ``r/R/size`` (first writer wins) with
N members: the nodes in slots 0..N-1. A node whose slot is >= N came too late;
it joins round R+1 at once and is thereby *waiting* (it shows up in
``num_nodes_waiting`` of the running members). The closer bumps ``open``, pushes
an event and writes the member list for the controller. The node in slot 0 (rank 0
whenever the round closes) hosts a fresh worker TCPStore on its ``local_addr`` as
soon as it joins (port bound by itself, handed to the store with
``master_listen_fd``) and puts the port in its node record (``r/R/node/0``, field
``wstore``); that is ``bootstrap_store_info``, the workers' MASTER_ADDR/MASTER_PORT.

When a round closes (``protocol.decide_close``, evaluated by every joiner once
after its own join, then on every event by the *deciders* only, the nodes in
slots 0-2, and by the others every few seconds in case every decider died; first
to see it true closes):

- never while the previous round R-1 is intact (it has members and none of them
  is accounted for): nodes arriving then are spare and wait;
- at once when ``max`` nodes joined;
- with a controller: at once when every node it lists has joined or is known
  gone, i.e. has a fate other than rejoin in R-1 (>= min joined). A dead node the
  controller still lists (the controller is down or slow) never delays the round;
- without: at once when every member of R-1 is accounted for (re-joined, dead,
  left or dropped) and >= min joined; in the very first round after a short
  last call (``last_call_timeout``) once ``min`` joined;
- fall-back timers (``rejoin_timeout``, ``controller_timeout``) only when an
  expected node never shows up.

Standbys
--------
A node that is no member of the current round R takes a slot in R+1 only for one
of its places (``standby``): the members R lost plus the room ``max`` leaves (for
a node started with ``standby=1``, the lost members only). It claims the place
(``r/R+1/claimed``) and takes its slot; with no place free it *parks*: no slot, no
rank, ``standby/<name>`` written, woken by the events like any waiter, and no
deadline while it waits. A full group is thus never re-formed for an arriving
node, and the loss of a member, which wakes the parked nodes with the survivors,
is replaced in the same round: the group re-forms once, at its old size. Without
a controller the round waits (``rejoin_timeout`` at most) for the standbys parked
for it to arrive; with one, a listed standby that has not joined holds it anyway.

Every member of R-1 gets exactly one *fate* (``r/R-1/fate/<name>``, first claim
wins, counted in ``r/R-1/accounted``): ``rejoin`` when it joins R, ``dead`` when
its process or heartbeat is gone, ``left`` on a graceful shutdown, ``dropped`` when the
controller no longer lists it. "All accounted" therefore means: nobody else from
the old round will come, so the new round closes without any timer.

Waking up without polling
-------------------------
Anything another node must react to pushes an *event*: ``add(ev, 1)`` then set
``ev/<n>`` to what happened. Each handler runs one watcher thread (``watcher``) that takes the
events one by one, each with a single blocking ``get`` of the next event key;
it bumps a local generation counter and notifies a condition variable.
Deciders and ``wait_membership_change`` block on that condition (with their own
deadlines), never on a sleep loop, so a round closes as soon as its condition
holds. The close of a round travels in its event (``closed <R> <size value>``:
the size and rank 0's worker store, which the closer read from rank 0's record),
so the other waiters of the open round read nothing when woken: one store call
per node (the watcher's) tells every waiter the outcome. They read the size key
only when the event may have been missed (before the first event, after the
watcher reconnected) and on their fall-back evaluation. Events are rare: first
join of a round after the first (slot 0's joiner, or a later one that finds no signed
record in slot 0: a stranger's add took it), ``min`` reached, round closed, a fate other
than rejoin (plus the first fate of a round), controller publication, job closed. A
running group below its maximum re-forms for nodes that wait only when the coming round
holds a join record the job signed (``rounds.nodes_waiting``), never for its count alone.

Cost at scale
-------------
A node's join, wait and start take O(1) store operations on O(1)-sized values
(its own listing key and the controller's bounds, never the full list): six
calls to join and wait in the first round (reading ``open`` and the bounds,
taking a slot, writing the record, a heartbeat, the close rule's ``joined``; in a
later round, past slot 0, one more: whether slot 0 holds the job's record), then two (check, read) for its ring successor's record once the round closed,
plus the watcher's one per event. The job's ``closed`` key is read once per
watcher connection, the round's size only when its close event may have been
missed.
O(N) data is read only by the closer (the member list) and, in a controlled
round, by the joiner whose own join completed the listed count (``slot + 1 +
gone >= listed``; it waits for records still on the way) and by the deciders
once the count is complete, never by every node that reads a complete count.

Failure detection
-----------------
Each member of a running round watches one peer, its ring successor (rank + 1
mod N), two ways:

- a *peer link*: every node listens on its ``local_addr`` (port in its join
  record) and its predecessor keeps a TCP connection to it, on which both proved the
  job's secret (``liveness.PeerLink``; without a secret there is no peer link). When a node's process
  dies (crash, OOM kill, SIGKILL) the kernel closes the connection and the
  watcher claims ``dead`` within milliseconds;
- a heartbeat: a keep-alive thread (``keepalive``) increments ``hb/<name>`` every
  ``keep_alive_interval``; a heartbeat that did not move for
  ``keep_alive_interval * keep_alive_max_attempt`` (see ``settings``; judged on
  the observer's monotonic clock, so clock skew does not matter, and only on at
  least three readings, so an observer that was itself stalled judges nobody) also
  means ``dead``. This covers what closes no socket: a frozen process, a lost machine.

The whole job reads O(N) keys per interval. The fate ``dead`` wakes everyone.
Nodes waiting in slots 0-2 of an open round also sweep the heartbeats of all
members of the previous round, so several deaths at once (a watcher dying with
its successor) are still detected.

A node marked dead while its process lived was cut off (a partition, a frozen
machine). Before it joins again (``next_rendezvous`` reads its own fate in its last
round) it replaces its store connection and its watcher and keep-alive threads:
connections that lived through the cut may wait out TCP's retransmission back-off
(tens of seconds) once the network is back, and the round it joins would wait for
its watcher that long.

A running member's ``membership_changed()`` is True once its round is no longer
current: a fate was claimed in it, a newer round closed, its peer link closed
while the store was away (see Store loss), or nodes wait in the next round while
the round is below ``max``. The agent then
stops its workers and calls ``next_rendezvous``; survivors all re-join, the dead
one is accounted for, and the new round closes immediately.

Store loss
----------
The store keeps no durable state, and the workers never use it (their collectives
meet in the worker store rank 0's agent hosts), so a lost store is no membership
change: the members keep their workers. The event watcher reconnects with a
back-off; when it finds a different ``incarnation`` token it re-establishes the
latest round this node was a member of in the new store (``protocol.restore_round``:
same round, members and ranks; ``open`` raised to it, its ``joined`` counter sealed
so that a later joiner waits in the next round). ``membership_changed()`` meanwhile
turns True only for what tells a real change without the store: the peer link of
the watched successor closing (its fate is claimed once the store is back), or a new
store that holds another round of that number. A store unreachable for
``join_timeout`` raises ``RendezvousConnectionError`` naming the endpoint, from
``membership_changed`` for a running member and from ``next_rendezvous`` for a joiner.
A node that joined a round on the new store before the members came back finds
``open`` past its round and goes on to the next one.

Closing
-------
``set_closed()`` marks the job finished: joiners get ``RendezvousClosedError``.
``shutdown()`` is a graceful leave (fate ``left``), not a job close, so a pod
removed by scale-down lets the others re-form at once.

Use from an agent
-----------------
``next_rendezvous()`` after (re)starting; then, while workers run, block in
``wait_membership_change(monitor_interval)`` (or poll the cheap, event-cached
``membership_changed()``); when it is True stop the workers and call
``next_rendezvous()`` again. When the workers fail, ``wait_member_lost(loss_notice)``
tells whether a member was lost (the failure is its consequence: restart for
free) or a peer re-joined without a loss (the group's own failure). Before
stopping its workers on a signal, an agent calls ``announce_leaving()`` (counter
``r/<R>/leaving``), so that the failures its leave causes are judged losses.
``RendezvousInfo.store`` is a ``PrefixStore``
private to the round over this node's own store connection. At the end:
``set_closed()`` then ``shutdown()`` on success, only ``shutdown()`` when the
node is stopped. The agent publishes its progress for ``control.read_status``
itself (``kelastic.agent.progress_publisher``), over a connection of its own.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from . import fastpath
from .connection import StoreConnection
from .finish import FinishMark
from .join import Joiner, LinkTarget, RendezvousTimings
from .keepalive import KeepAlive
from .liveness import PeerLink
from .protocol import (
    Fate,
    RunKeys,
    claim_fate,
    count_fates,
    first_line,
    job_closed,
    new_token,
    push_event,
    read_bounds,
    read_counter,
    read_fate,
    restore_round,
    round_moved_on,
    set_job_closed,
)
from .records import RecordSigner
from .rounds import Joining, Member, nodes_waiting
from .settings import RendezvousSettings, settings_from_params
from .watcher import EventWatcher

__all__ = [
    "BACKEND",
    "KelasticRendezvousHandler",
    "RendezvousTimings",
    "SecretMismatchError",
    "create_handler",
    "current_round",
    "step_aside",
]

log = logging.getLogger(__name__)

BACKEND = "kelastic"


#: Seconds between re-reads of the fates while a verdict waits (``_wait_verdict``), events or
#: not: a member's re-join pushes an event only when it is the first of its round, so the
#: re-joins that complete the count may come without one (when the next round closed at
#: ``max`` before they claimed their fates).
VERDICT_POLL = 0.05


class KelasticRendezvousHandler(RendezvousHandler):
    """Rendezvous handler of the ``kelastic`` backend (see the module docstring).

    ``next_rendezvous``, ``membership_changed``, ``wait_membership_change`` and
    ``num_nodes_waiting`` are meant for the agent's main thread; the others may be
    called from any thread. Background threads (event watcher, keep-alive) start
    at the first store connection and stop in ``shutdown``. Its parts
    (``Joiner``, ``EventWatcher``, ``KeepAlive``, ``StoreConnection``) share its lock.
    """

    def __init__(self, settings: RendezvousSettings) -> None:
        self._s = settings
        self._keys = RunKeys(settings.run_id, RecordSigner.for_job(settings.job_key), settings.controlled)
        self._token = new_token()
        self._lock = threading.RLock()
        self._member: Member | None = None
        # The latest round this node was a member of, kept while it re-joins: a restarted
        # store gets it back from this node too, so that its fate there can be claimed.
        self._last_member: Member | None = None
        # The round this node was a member of when it last began to re-join: whether
        # it lost a member is asked after the re-join (``wait_previous_round_lost``).
        self._before: Member | None = None
        # Known while the store was unreachable: a member of this node's round is gone
        # (the peer link closed), or the restarted store holds another round of its number.
        self._detached_change = False
        self._stop = threading.Event()
        # The event watcher (what the events told; waiters block on it) and the keep-alive.
        self._events = EventWatcher(self._keys, settings.host, settings.port, self._stop)
        self._keep = KeepAlive(settings, self._keys, self._lock, self._rounds, self._stop)
        self._joiner = Joiner(
            settings,
            self._keys,
            self._token,
            self._lock,
            self._events,
            lambda: self._link,
            lambda: _advertised_addr(settings),
            self._became,
            lambda: self._last_member.round if self._last_member is not None else None,
        )
        self._conn = StoreConnection(
            settings,
            self._keys,
            self._lock,
            self._events,
            self._keep,
            self._restore,
            self._start_threads,
            self._drop_connection,
        )
        self._link_target: LinkTarget | None = None
        self._changed_cache: tuple[int, bool] | None = None
        self._link: PeerLink | None = None
        self._timings: RendezvousTimings | None = None

    # -- RendezvousHandler -------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """Workers connect to the round's worker store as clients (rank 0 hosts it)."""
        return True

    def get_run_id(self) -> str:
        return self._s.run_id

    @property
    def settings(self) -> RendezvousSettings:
        return self._s

    @property
    def node_name(self) -> str:
        return self._s.node_name

    def round_signer(self) -> RecordSigner | None:
        """The signer of this node's round's private store (``RendezvousInfo.store``), scoped to the
        run and the round; None without a job secret (records unsigned) or a round."""
        member = self._member
        if member is None or not self._keys.signer.signing:
            return None
        return self._keys.signer.scoped(f"{self._s.run_id} round {member.round}")

    @property
    def last_timings(self) -> RendezvousTimings | None:
        """Phases of the latest ``next_rendezvous`` call (None before the first)."""
        return self._timings

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the open round and return once it closed with this node as a member.

        Raises RendezvousClosedError if the job was closed, RendezvousConnectionError
        if the store stayed unreachable, RendezvousTimeoutError if no round admitted
        this node, each after at most ``join_timeout`` seconds.
        """
        if self._stop.is_set():
            raise RendezvousClosedError(
                f"this node's handler for rendezvous {self._s.run_id} was shut down; create a new one to rejoin"
            )
        deadline = time.monotonic() + self._s.join_timeout
        self._timings = RendezvousTimings(started=time.time())
        with self._lock:
            self._before = self._last_member
            self._member = None
            self._detached_change = False
            self._changed_cache = None
            self._joiner.close_worker_store()
        self._watch_link(None)
        self._renew_if_cut_off(deadline)
        while True:
            try:
                store = self._conn.get(deadline)
                return self._joiner.join(store, deadline, self._timings)
            except dist.DistNetworkError as exc:
                log.warning(
                    "kelastic rendezvous: lost the store at %s (%s); reconnecting",
                    self._s.endpoint,
                    first_line(exc),
                )
                self._drop_connection()
                # A parked standby waits without a deadline: only its last join_timeout counts.
                deadline = max(deadline, self._joiner.park_deadline)
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"lost the kelastic rendezvous store at {self._s.endpoint} and could not "
                        f"rejoin within join_timeout={self._s.join_timeout:g}s: {first_line(exc)}"
                    ) from exc

    def is_closed(self) -> bool:
        store = self._conn.get(time.monotonic() + min(self._s.join_timeout, 30.0))
        with self._lock:
            return job_closed(store, self._keys)

    def set_closed(self) -> None:
        """Mark the job finished: every later or pending join raises RendezvousClosedError."""
        store = self._conn.get(time.monotonic() + min(self._s.join_timeout, 30.0))
        with self._lock:
            set_job_closed(store, self._keys)

    def num_nodes_waiting(self) -> int:
        """>0 when this node's round is no longer current (nodes wait, or a member changed)."""
        if not self.membership_changed():
            return 0
        with self._lock:
            member, store = self._member, self._conn.store
            if member is None or store is None:
                return 1
            try:
                return max(1, read_counter(store, self._keys.joined(member.round + 1)))
            except dist.DistError:
                return 1

    def shutdown(self) -> bool:
        """Leave gracefully (fate ``left``, survivors re-form at once) and stop the threads.

        Does not close the job; call ``set_closed`` for that. Returns False if the
        store could not be told.
        """
        ok = True
        with self._lock:
            member, store = self._member, self._conn.store
            if store is not None:
                self._joiner.unpark_quietly(store)
            if member is not None and store is not None:
                try:
                    if not job_closed(store, self._keys):
                        claim_fate(
                            store, self._keys, member.round, self._s.node_name, Fate.LEFT, self._s.node_name
                        )
                except dist.DistError as exc:
                    log.warning("kelastic rendezvous: could not announce leaving: %s", first_line(exc))
                    ok = False
            self._member = None
            self._joiner.close_worker_store()
        self._stop.set()
        self._events.bump()
        ok = self._stop_threads() and ok
        _live_handlers.discard(self)
        return ok

    def _stop_threads(self) -> bool:
        """Stop the background threads and the peer link; False if the store could not be told."""
        self._stop.set()
        self._keep.poke.set()
        self._events.retry_now.set()
        if self._link is not None:
            self._link.close()
        return self._conn.stop_threads()

    # -- kelastic extensions -----------------------------------------------

    def membership_changed(self) -> bool:
        """Non-blocking: True once this node's round is no longer current.

        A lost store alone changes nothing: the workers' collectives do not use it,
        and the round is re-established when the store is back. While it is away, a
        member whose peer link closed is known lost (True at once). Raises
        RendezvousConnectionError naming the endpoint once the store stayed
        unreachable for ``join_timeout``.
        """
        return bool(self._ask_own_round(self._changed_cached, self._changed_detached))

    def _changed_detached(self) -> bool:
        """membership_changed() while this node's round is not established in a store."""
        with self._lock:
            since, changed = self._conn.lost_since, self._detached_change
        if changed:
            return True
        if since is not None and time.monotonic() - since > self._s.join_timeout:
            raise RendezvousConnectionError(
                f"the kelastic rendezvous store at {self._s.endpoint} has been unreachable for "
                f"{time.monotonic() - since:.0f}s (join_timeout={self._s.join_timeout:g}s); "
                f"giving up on rendezvous {self._s.run_id}"
            )
        return False

    def _ask_own_round(
        self,
        question: Callable[[dist.TCPStore, Member], bool | None],
        detached: Callable[[], bool | None] = lambda: True,
    ) -> bool | None:
        """``question(store, member)`` about this node's round, asked under the lock.

        Not a member: False. This node's round not established in the store (the
        connection lost, now or while asking, or not restored yet): ``detached()``.
        """
        if self._conn.lost.is_set():
            return detached() if self._member is not None else False
        with self._lock:
            member, store = self._member, self._conn.store
            if member is None:
                return False
            if store is not None:
                try:
                    return question(store, member)
                except dist.DistNetworkError:
                    pass
        self._drop_connection()
        return detached()

    def _changed_cached(self, store: dist.TCPStore, member: Member) -> bool:
        """:meth:`_evaluate_changed`, read from the store once per event generation."""
        generation = self._events.generation
        if self._changed_cache is not None and self._changed_cache[0] == generation:
            return self._changed_cache[1]
        changed = self._evaluate_changed(store, member)
        self._changed_cache = (generation, changed)
        return changed

    def wait_membership_change(self, timeout: float) -> bool:
        """Block (on store events, not a sleep loop) up to ``timeout`` s; True if membership changed."""
        return self._wait_verdict(lambda: True if self.membership_changed() else None, timeout)

    def wait_member_lost(self, timeout: float) -> bool:
        """After this node's workers failed: was a member of its round lost?

        Blocks on store events (not a sleep loop) for up to ``timeout`` seconds.
        True as soon as a member of this node's round has a fate other than rejoin
        (dead, left, dropped) or while the store is unreachable (then nothing tells a
        loss from a failure of the group's own, and a loss is the likelier cause: no
        restart is spent on it). False as soon as a peer re-joined while no member was
        lost (that peer's workers failed too, or it saw nodes waiting: the failure
        is the group's own), when ``timeout`` passes, or when this node is not a
        member of a round.
        """
        return self._wait_verdict(self._member_lost_now, timeout)

    def wait_previous_round_lost(self, timeout: float) -> bool:
        """After ``next_rendezvous`` returned: was a member of the round this node left lost?

        Blocks on store events for up to ``timeout`` seconds. True as soon as a
        member of that round has a fate other than rejoin (dead, left, dropped), or
        when the store no longer knows the round (it restarted meanwhile: nothing
        tells a loss from the group's own failure, and a loss is the likelier cause,
        as in :meth:`wait_member_lost`). False as soon as every member of it is
        accounted for without a loss, when ``timeout`` passes, or when this node was
        in no round before.
        """
        before = self._before
        if before is None:
            return False
        return self._wait_verdict(lambda: self._previous_loss_verdict(before), timeout)

    def _previous_loss_verdict(self, before: Member) -> bool | None:
        if self._conn.lost.is_set():
            return None
        with self._lock:
            store = self._conn.store
            if store is None:
                return None
            try:
                accounted, lost = count_fates(store, self._keys, before.round, before.size)
            except dist.DistNetworkError:
                return None
        return fastpath.previous_loss_verdict(accounted, lost, before.size)

    def _wait_verdict(self, verdict: Callable[[], bool | None], timeout: float) -> bool:
        """Re-evaluate ``verdict`` on every store event (and poll) until not None; False after ``timeout`` s."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            _check_secret(self._link, self._s)
            generation = self._events.generation
            answer = verdict()
            if answer is not None:
                return answer
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                return False
            self._events.wait_event(generation, min(remaining, VERDICT_POLL))

    def _member_lost_now(self) -> bool | None:
        """True: a member was lost; False: a peer re-joined without a loss, or not a member; None: neither yet."""
        return self._ask_own_round(lambda st, m: fastpath.loss_verdict(*self._fates(st, m)))

    def _fates(self, store: dist.TCPStore, member: Member) -> tuple[int, bool]:
        return count_fates(store, self._keys, member.round, member.size)

    def round_over(self) -> bool:
        """A member of this node's round re-joined the next round or was lost (``fastpath.round_over``)."""
        return bool(
            self._ask_own_round(lambda st, m: fastpath.round_over(self._fates(st, m)[0]), lambda: None)
        )

    def announce_leaving(self) -> None:
        """Tell the round's members that this node is stopping its workers to leave.

        For the agent to call before it stops its workers on a signal: a failure
        the others see meanwhile is then judged a loss (:meth:`wait_member_lost`),
        however long the workers take to stop. It does not end the round for
        anyone (``shutdown`` does, with the fate ``left``). Best effort.
        """
        with self._lock:
            member, store = self._member, self._conn.store
            if member is None or store is None:
                return
            try:
                store.add(self._keys.leaving(member.round), 1)
                push_event(store, self._keys, f"leaving {member.round} {self._s.node_name}")
            except dist.DistError as exc:
                log.warning("kelastic rendezvous: could not announce leaving: %s", first_line(exc))

    def wait_all_finished(self, timeout: float) -> bool:
        """The exit barrier: mark this member's workers finished; block until every member's are.

        Blocks on store events for up to ``timeout`` seconds. True once every member
        of this node's round marked itself finished; False once a member that had not
        was lost, on timeout, after ``shutdown``, or when this node is in no round. A
        store that restarts during the barrier loses nothing (:mod:`.finish`): while it
        is away the barrier waits.
        """
        mark = FinishMark(
            self._keys, lambda store, r: count_fates(store, self._keys, r, self._round_size(r))[1]
        )
        return self._wait_verdict(lambda: self._ask_own_round(mark.all_finished, lambda: None), timeout)

    @property
    def loss_notice(self) -> float:
        """How long after a member's process is gone its loss may take to show, at most.

        With the peer link the watcher sees the connection close at once: two
        keep-alive periods cover a loaded machine. Without it only the heartbeat
        tells: ``node_timeout`` plus one keep-alive period.
        """
        if self._link is not None:
            return 2.0 * self._s.keep_alive_interval
        return self._s.node_timeout + self._s.keep_alive_interval

    # -- joining -----------------------------------------------------------

    def _became(self, member: Member, link_target: LinkTarget | None) -> None:
        """This node is a member of ``member.round`` now (the joiner tells, before it returns)."""
        with self._lock:
            self._member = self._last_member = member
            self._changed_cache = None
        self._watch_link(link_target)

    def _watch_link(self, target: LinkTarget | None) -> None:
        """Point the peer link at ``target``; waking its thread only for a change."""
        if self._link is not None and target != self._link_target:
            self._link_target = target
            self._link.watch(target)

    # -- membership --------------------------------------------------------

    def _evaluate_changed(self, store: dist.TCPStore, member: Member) -> bool:
        k, r = self._keys, member.round
        if round_moved_on(store, k, r, member.size, seen=self._events.fate_claimed(r)):
            return True
        limits = self._s.bounds(read_bounds(store, k))
        if limits is None:
            # Controlled, and the (restarted) store has no bounds of the controller yet: no
            # size to judge the round by (its own --nnodes may be above the controller's).
            return False
        max_nodes = limits[1]
        waiting = nodes_waiting(store, k, r + 1, max_nodes)  # signed join records, not the count
        # Over max (the controller lowered it): re-form at max; the nodes past it park.
        return member.size > max_nodes or (waiting and member.size < max_nodes)

    # -- connection, events, threads ----------------------------------------

    def _restore(self, store: dist.TCPStore) -> None:
        """Re-establish the latest round this node was a member of in the restarted ``store``."""
        last = self._last_member
        if last is None or last.close is None:
            log.warning(
                "kelastic rendezvous: the store at %s was restarted; joining afresh", self._s.endpoint
            )
            return
        r = last.round
        restored = restore_round(store, self._keys, r, last.close, last.rank, last.record, last.names)
        if restored:
            log.warning(
                "kelastic rendezvous: the store at %s was restarted; re-established round %d "
                "(%s rank %d of %d) there",
                self._s.endpoint,
                r,
                self._s.node_name,
                last.rank,
                last.size,
            )
        elif self._member is not None:
            log.warning(
                "kelastic rendezvous: the store at %s was restarted and holds another round %d; "
                "re-forming the group",
                self._s.endpoint,
                r,
            )
            self._detached_change = True

    def _drop_connection(self) -> None:
        with self._lock:
            self._changed_cache = None
            self._conn.drop()

    def _start_threads(self) -> None:
        if self._s.job_key is None:
            log.warning(
                "kelastic rendezvous: no job secret, so no peer link; dead nodes are found by heartbeat only"
            )
        else:
            try:
                self._link = PeerLink(_advertised_addr(self._s), self._peer_lost, self._s.job_key)
            except OSError as exc:
                log.warning(
                    "kelastic rendezvous: no peer link (%s); dead nodes are found by heartbeat only", exc
                )
        self._conn.spawn_threads()
        _live_handlers.add(self)

    def _renew_if_cut_off(self, deadline: float) -> None:
        """Before re-joining: if the others found this node dead, open fresh connections first.

        A node marked ``dead`` while its process lived was cut off (a network partition,
        a frozen machine). Its connections to the store lived through the cut: those
        with data in flight wait out TCP's retransmission back-off, which grows to tens
        of seconds, after the network is back. Its event watcher would then learn of
        the round it joins that much later, while the members it made stop their
        workers wait for it; so it reconnects before joining, and costs the running
        group what any joining node costs.
        """
        last = self._last_member
        with self._lock:
            store = self._conn.store
        if last is None or store is None:
            return
        try:
            fate = read_fate(store, self._keys, last.round, self._s.node_name)
        except dist.DistError:
            return  # the join reconnects anyway
        if fate is not Fate.DEAD:
            return
        log.warning(
            "kelastic rendezvous: %s was found dead in round %d while it ran (cut off from the store "
            "or its peers); reconnecting before it joins again",
            self._s.node_name,
            last.round,
        )
        self._conn.renew(deadline)

    def _peer_lost(self, r: int, name: str) -> None:
        """Called by the peer link when the watched peer's process is gone.

        Known at once even while the store is unreachable: the round is then no
        longer current, and the fate is claimed once the store is back.
        """
        with self._lock:
            self._keep.suspect(r, name)
            if self._member is not None and self._member.round == r:
                self._detached_change = True
        self._keep.poke.set()
        self._events.bump()

    def _round_size(self, r: int) -> int:
        """The size of round r if this node was a member of it (0: unknown)."""
        return next((m.size for m in (self._member, self._last_member) if m is not None and m.round == r), 0)

    def _rounds(self) -> tuple[Member | None, Joining | None, Member | None]:
        """For the keep-alive (under the lock): this node's round, the round it waits in, its latest."""
        return self._member, self._joiner.joining, self._last_member


class SecretMismatchError(RendezvousError):
    """This node does not hold the job's secret: a peer refused its proof, or it refused theirs."""


def _check_secret(link: PeerLink | None, s: RendezvousSettings) -> None:
    """Raise :class:`SecretMismatchError` once the peer link met a peer with another secret."""
    if link is not None and link.mismatch is not None:
        raise SecretMismatchError(
            f"node {s.node_name} does not hold the job secret of rendezvous {s.run_id}'s other nodes "
            f"({link.mismatch}); give every agent of the job the same --job-secret-file"
        )


def _advertised_addr(s: RendezvousSettings) -> str:
    """The address peers reach this node on: ``local_addr``, else the route to the store."""
    if s.local_addr:
        return s.local_addr
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((s.host, s.port))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


def create_handler(params: RendezvousParameters) -> KelasticRendezvousHandler:
    """Create the handler for backend ``kelastic`` (ValueError on bad parameters)."""
    if params.backend != BACKEND:
        raise ValueError(f"create_handler is for rdzv backend {BACKEND!r}, not {params.backend!r}")
    return KelasticRendezvousHandler(settings_from_params(params))


#: Handlers with running threads. A thread blocked inside the store's C++ code when
#: the interpreter finalizes aborts the process, so they are stopped at exit.
_live_handlers: weakref.WeakSet[KelasticRendezvousHandler] = weakref.WeakSet()


@atexit.register
def _stop_live_handlers() -> None:
    for handler in list(_live_handlers):
        handler._stop_threads()


rendezvous_handler_registry.register(BACKEND, create_handler)


def current_round(handler: KelasticRendezvousHandler) -> int | None:
    """The round ``handler``'s node is a member of (None while it is in none)."""
    member = handler._member
    return None if member is None else member.round


def step_aside(handler: KelasticRendezvousHandler) -> bool:
    """Leave the round as a straggler replaced by a standby does, and become a standby.

    Claims the node's fate ``left`` in its round (its peers re-form at once, a parked
    standby takes its place) and keeps the handler running: the next ``next_rendezvous``
    parks the node as a standby (``Joiner.step_aside``). Returns False (and changes
    nothing) when the node is in no round or the store cannot be told.
    """
    with handler._lock:
        member, store = handler._member, handler._conn.store
        if member is None or store is None:
            return False
        try:
            handler._joiner.step_aside(store, member.round)
        except dist.DistError as exc:
            log.warning("kelastic rendezvous: could not step aside: %s", first_line(exc))
            return False
        handler._last_member = None
        return True

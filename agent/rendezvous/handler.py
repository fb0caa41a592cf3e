"""The ``kelastic`` rendezvous backend: a dynamic rendezvous built for fast recovery.

Agents meet in a ``torch.distributed.TCPStore`` served by ``kelastic-rendezvous``
(a process that is not a worker). The key layout is in ``protocol``; this module
is the algorithm, in parts: a joiner's wait for its round to close is decided by
the pure state machine ``closewait`` (this module applies its actions, with the
store reads and writes of ``rounds``), the event watcher is ``watcher``, the
heartbeat and peer watch ``keepalive``; the handler keeps the join, the
connection, the worker store and the questions about this node's round.

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
join of a round after the first, ``min`` reached, round closed, a fate other than
rejoin (plus the first fate of a round), controller publication, job closed.

Cost at scale
-------------
A node's join, wait and start take O(1) store operations on O(1)-sized values
(its own listing key and the controller's bounds, never the full list): six
calls to join and wait in the first round (reading ``open`` and the bounds,
taking a slot, writing the record, a heartbeat, the close rule's ``joined``),
then two (check, read) for its ring successor's record once the round closed,
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
  record) and its predecessor keeps a TCP connection to it. When a node's process
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
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from . import closewait
from .keepalive import KeepAlive
from .liveness import PeerLink
from .protocol import (
    JOB_CLOSED_EVENT,
    RECONNECT_TIMEOUT,
    ControllerBounds,
    Fate,
    RoundClose,
    RoundView,
    RunKeys,
    TimerKind,
    claim_fate,
    connect_store,
    first_line,
    get_or_none,
    new_token,
    open_round,
    push_event,
    read_bounds,
    read_close,
    read_counter,
    read_membership,
    restore_round,
)
from .rounds import (
    UNREAD,
    Joining,
    Member,
    account_previous_round,
    observe_round,
    read_records,
    try_close,
)
from .server import ServedStore, serve_store
from .settings import RendezvousSettings, settings_from_params
from .watcher import EventWatcher

__all__ = ["BACKEND", "KelasticRendezvousHandler", "RendezvousTimings", "create_handler"]

log = logging.getLogger(__name__)

BACKEND = "kelastic"


@dataclass
class RendezvousTimings:
    """Wall-clock instants (``time.time()``) of one ``next_rendezvous`` call, for benchmarks.

    ``joined``: this node holds a slot and wrote its record; ``closed``: it learned
    the size of the round it is a member of; ``worker_store``: it knows (rank 0:
    published) the worker store; ``returned``: the call returned. None until reached.
    Wall clock so that nodes in different processes of one machine can be compared.
    """

    started: float
    joined: float | None = None
    closed: float | None = None
    worker_store: float | None = None
    returned: float | None = None


class KelasticRendezvousHandler(RendezvousHandler):
    """Rendezvous handler of the ``kelastic`` backend (see the module docstring).

    ``next_rendezvous``, ``membership_changed``, ``wait_membership_change`` and
    ``num_nodes_waiting`` are meant for the agent's main thread; the others may be
    called from any thread. Background threads (event watcher, keep-alive) start
    at the first store connection and stop in ``shutdown``.
    """

    def __init__(self, settings: RendezvousSettings) -> None:
        self._s = settings
        self._keys = RunKeys(settings.run_id)
        self._token = new_token()
        self._lock = threading.RLock()
        self._store: dist.TCPStore | None = None
        self._incarnation: str | None = None
        self._member: Member | None = None
        # The latest round this node was a member of, kept while it re-joins: a restarted
        # store gets it back from this node too, so that its fate there can be claimed.
        self._last_member: Member | None = None
        # Names of rounds this node closed (it read them then), for ``Member.names``.
        self._closed_names: dict[int, tuple[str, ...]] = {}
        self._joining: Joining | None = None
        self._worker_store: ServedStore | None = None
        # Set while this node's round is not established in the connected store: the
        # connection is lost, or the store restarted and the round is not restored yet.
        self._lost = threading.Event()
        self._lost_since: float | None = None  # monotonic; when the store was lost
        # Known while the store was unreachable: a member of this node's round is gone
        # (the peer link closed), or the restarted store holds another round of its number.
        self._detached_change = False
        self._stop = threading.Event()
        # The event watcher (what the events told; waiters block on it) and the keep-alive.
        self._events = EventWatcher(self._keys, settings.host, settings.port, self._stop)
        self._keep = KeepAlive(settings, self._keys, self._lock, self._rounds, self._stop)
        # The watcher epoch in which the store said the job is not closed: while the
        # watcher stays connected, its closed-job event tells the rest.
        self._closed_checked: int | None = None
        self._link_target: tuple[int, str, str, int] | None = None
        self._changed_cache: tuple[int, bool] | None = None
        self._threads: list[threading.Thread] = []
        # Bumped when the background threads are replaced (``_renew_connections``): a thread
        # of an older generation, still blocked on a stale connection, exits when it wakes.
        self._thread_gen = 0
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
            self._member = None
            self._detached_change = False
            self._changed_cache = None
            self._close_worker_store()
        self._watch_link(None)
        self._renew_if_cut_off(deadline)
        while True:
            try:
                store = self._connected(deadline)
                return self._join(store, deadline)
            except dist.DistNetworkError as exc:
                log.warning(
                    "kelastic rendezvous: lost the store at %s (%s); reconnecting",
                    self._s.endpoint,
                    first_line(exc),
                )
                self._drop_connection()
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"lost the kelastic rendezvous store at {self._s.endpoint} and could not "
                        f"rejoin within join_timeout={self._s.join_timeout:g}s: {first_line(exc)}"
                    ) from exc

    def is_closed(self) -> bool:
        store = self._connected(time.monotonic() + min(self._s.join_timeout, 30.0))
        with self._lock:
            return bool(store.check([self._keys.closed]))

    def set_closed(self) -> None:
        """Mark the job finished: every later or pending join raises RendezvousClosedError."""
        store = self._connected(time.monotonic() + min(self._s.join_timeout, 30.0))
        with self._lock:
            store.set(self._keys.closed, "1")
            push_event(store, self._keys, JOB_CLOSED_EVENT)

    def num_nodes_waiting(self) -> int:
        """>0 when this node's round is no longer current (nodes wait, or a member changed)."""
        if not self.membership_changed():
            return 0
        with self._lock:
            member, store = self._member, self._store
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
            member, store = self._member, self._store
            if member is not None and store is not None:
                try:
                    if not store.check([self._keys.closed]):
                        claim_fate(
                            store, self._keys, member.round, self._s.node_name, Fate.LEFT, self._s.node_name
                        )
                except dist.DistError as exc:
                    log.warning("kelastic rendezvous: could not announce leaving: %s", first_line(exc))
                    ok = False
            self._member = None
            self._close_worker_store()
        self._stop.set()
        self._events.bump()
        ok = self._stop_threads() and ok
        _live_handlers.discard(self)
        return ok

    def _stop_threads(self) -> bool:
        """Stop the background threads; the watcher blocks in the store, so wake it with an event."""
        self._stop.set()
        self._keep.poke.set()
        self._events.retry_now.set()
        if self._link is not None:
            self._link.close()
        watcher = next((t for t in self._threads if t.name.startswith("kelastic-rdzv-events")), None)
        ok = True
        if watcher is not None and watcher.is_alive():
            with self._lock:
                store = self._store
                if store is not None:
                    try:
                        push_event(store, self._keys, f"bye {self._s.node_name}")
                    except dist.DistError:
                        ok = False
        for thread in self._threads:
            thread.join(timeout=5.0)
        return ok

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
            since, changed = self._lost_since, self._detached_change
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
        if self._lost.is_set():
            return detached() if self._member is not None else False
        with self._lock:
            member, store = self._member, self._store
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

    def _wait_verdict(self, verdict: Callable[[], bool | None], timeout: float) -> bool:
        """Re-evaluate ``verdict`` on every store event until it is not None; False after ``timeout`` s."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            generation = self._events.generation
            answer = verdict()
            if answer is not None:
                return answer
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                return False
            self._events.wait_event(generation, remaining)

    def _member_lost_now(self) -> bool | None:
        """True: a member was lost; False: a peer re-joined without a loss, or not a member; None: neither yet."""
        return self._ask_own_round(self._loss_verdict)

    def _loss_verdict(self, store: dist.TCPStore, member: Member) -> bool | None:
        # ``claim_fate`` counts a loss in ``gone`` before ``accounted``: reading
        # ``accounted`` first, a loss it includes is always seen in ``gone``.
        accounted = read_counter(store, self._keys.accounted(member.round))
        gone = read_counter(store, self._keys.gone(member.round))
        leaving = read_counter(store, self._keys.leaving(member.round))
        if gone > 0 or leaving > 0:
            return True
        return False if accounted > 0 else None

    def announce_leaving(self) -> None:
        """Tell the round's members that this node is stopping its workers to leave.

        For the agent to call before it stops its workers on a signal: a failure
        the others see meanwhile is then judged a loss (:meth:`wait_member_lost`),
        however long the workers take to stop. It does not end the round for
        anyone (``shutdown`` does, with the fate ``left``). Best effort.
        """
        with self._lock:
            member, store = self._member, self._store
            if member is None or store is None:
                return
            try:
                store.add(self._keys.leaving(member.round), 1)
                push_event(store, self._keys, f"leaving {member.round} {self._s.node_name}")
            except dist.DistError as exc:
                log.warning("kelastic rendezvous: could not announce leaving: %s", first_line(exc))

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

    def _join(self, store: dist.TCPStore, deadline: float) -> RendezvousInfo:
        k, s, name = self._keys, self._s, self._s.node_name
        next_round = 0
        while True:
            generation = self._events.generation
            # Read before the open round: from here on every event reaches this node
            # (unless the epoch changes), the job's and the round's close included.
            epoch = self._events.epoch()
            if epoch is None or epoch != self._closed_checked:
                if store.check([k.closed]):
                    raise RendezvousClosedError(f"the rendezvous {s.run_id} at {s.endpoint} is closed")
                self._closed_checked = epoch
            if self._events.job_closed.is_set():
                raise RendezvousClosedError(f"the rendezvous {s.run_id} at {s.endpoint} is closed")
            bounds = read_bounds(store, k)
            if bounds is not None and not store.check([k.listed(name)]):
                # The controller has not admitted this node (yet): wait for a publication.
                if time.monotonic() >= deadline:
                    listed = read_membership(store, k)
                    raise RendezvousTimeoutError(
                        f"node {name} was not listed by the controller of rendezvous {s.run_id} at "
                        f"{s.endpoint} within join_timeout={s.join_timeout:g}s (listed: "
                        f"{list(listed.nodes) if listed is not None else []})"
                    )
                self._events.wait_event(generation, deadline - time.monotonic())
                continue
            r = max(open_round(store, k), next_round)
            slot = int(store.add(k.joined(r), 1)) - 1
            addr = self._local_addr()
            link = self._link.port if self._link is not None else None
            record: dict[str, object] = {
                "name": name,
                "addr": addr,
                "link": link,
                "local_world_size": s.local_world_size,
            }
            if slot == 0:
                # Slot 0 is rank 0 of the round whenever it closes: host the worker store
                # now, so that the closed round needs no second broadcast.
                record["wstore"] = self._serve_worker_store(addr)
            # torch implements Store.multi_set; its stubs do not declare it.
            store.multi_set([k.node(r, slot), k.slot(r, name)], [json.dumps(record), str(slot)])  # type: ignore[attr-defined]
            store.add(k.heartbeat(name), 1)
            with self._lock:
                self._joining = Joining(r, slot)
            if self._timings is not None:
                self._timings.joined = time.time()
            if slot == 0 and r > 1:
                push_event(store, k, f"join {r}")  # running members learn that nodes wait
            account_previous_round(store, k, name, r)
            try:
                close = self._wait_closed(store, r, slot, deadline, epoch, bounds)
            finally:
                with self._lock:
                    self._joining = None
            if slot < close.size:
                return self._become_member(store, r, slot, close, addr, json.dumps(record), deadline)
            if slot == 0:
                self._close_worker_store()
            log.info(
                "kelastic rendezvous: %s came too late for round %d; waiting for round %d", name, r, r + 1
            )
            next_round = r + 1

    def _serve_worker_store(self, addr: str) -> int:
        with self._lock:
            self._close_worker_store()
            served = serve_store(addr, 0)
            self._worker_store = served
        return served.port

    def _wait_closed(
        self,
        store: dist.TCPStore,
        r: int,
        slot: int,
        deadline: float,
        epoch: int | None,
        bounds: ControllerBounds | None,
    ) -> RoundClose:
        """Block until round r is closed (closing it if this node sees the condition); how it closed.

        ``closewait.step`` decides every move; this applies its actions (the reads,
        the close, the ``min`` event, the wait for an event) and feeds it the answers.
        Every joiner evaluates the close rule once, right after its join. Afterwards
        only the deciders (slots below ``closewait.DECIDERS``) evaluate it on each
        event and run its timers; the others evaluate only every
        ``closewait.FALLBACK_EVALUATION`` s, in case every decider died (without the O(N) listed check: their timers close
        the round then), and otherwise read nothing: the round's close event
        carries its size and worker store, which the watcher hands over. So an event
        costs O(1) per node and the round O(N) in all.

        ``epoch``: the watcher's epoch when this node read the open round (None: the
        watcher was not connected); while it holds, the close event cannot have been
        missed and the size key is not read. ``bounds``: the controller's bounds
        read then, for the first evaluation.
        """
        k, s = self._keys, self._s
        state = closewait.start(r, slot, deadline, epoch, {kind: s.timer(kind) for kind in TimerKind})
        # The answer to the action just applied (at most one is set).
        stored: RoundClose | None = None
        opened: int | None = None
        observed: RoundView | None = None
        while True:
            # The generation first: an event after it wakes the wait this pass ends in.
            generation = self._events.generation
            epoch = self._events.epoch()
            event_close = self._events.close_of(r)
            view = closewait.WaitView(
                generation, epoch, event_close, self._events.job_closed.is_set(), stored, opened, observed
            )
            state, action = closewait.step(state, view, time.monotonic())
            stored, opened, observed = None, None, None
            if isinstance(action, closewait.ReadClose):
                stored = read_close(store, k, r)
            elif isinstance(action, closewait.ReadOpen):
                opened = read_counter(store, k.open)
            elif isinstance(action, closewait.Observe):
                # The first evaluation reuses the bounds read right before joining.
                first_bounds = bounds if action.own_count is not None else UNREAD
                observed = observe_round(store, k, s, r, first_bounds, action.own_count, action.deep)
            elif isinstance(action, closewait.Close):
                names = try_close(store, k, r, action.size, s.node_name, self._token)
                if names is not None:
                    with self._lock:
                        self._closed_names[r] = names
            elif isinstance(action, closewait.AnnounceMin):
                push_event(store, k, f"min {r}")  # min reached: the deciders start their timers
            elif isinstance(action, closewait.Wait):
                # Woken by the event watcher, which has already read the close event's value.
                # Not blocked in ``store.wait`` on the size key: every expired wait raises
                # through torch (with a C++ backtrace), and the close would wake each node
                # twice (store and event).
                self._events.wait_event(action.generation, action.until - time.monotonic())
            elif isinstance(action, closewait.Return):
                return action.close
            elif action.reason is closewait.FailReason.JOB_CLOSED:
                raise RendezvousClosedError(f"the rendezvous {s.run_id} at {s.endpoint} is closed")
            else:
                joined = read_counter(store, k.joined(r))
                raise RendezvousTimeoutError(
                    f"rendezvous {s.run_id} at {s.endpoint}: round {r} did not close within "
                    f"join_timeout={s.join_timeout:g}s ({joined} joined, min {s.min_nodes}, max "
                    f"{s.max_nodes} unless the controller set other bounds)"
                )

    def _become_member(
        self,
        store: dist.TCPStore,
        r: int,
        rank: int,
        close: RoundClose,
        addr: str,
        own_record: str,
        deadline: float,
    ) -> RendezvousInfo:
        """Read the ring successor's record (and rank 0's, if the close did not name its store).

        Two calls when the record is there, as it nearly always is (members write it
        right after taking their slot); a bounded wait otherwise.
        """
        k, timings, size = self._keys, self._timings, close.size
        if timings is not None:
            timings.closed = time.time()
        successor_rank = (rank + 1) % size
        wanted = {successor_rank} if size > 1 else set()
        if rank != 0 and not close.master_port:
            wanted.add(0)
        records = read_records(store, k, self._s.run_id, r, sorted(wanted), deadline)
        successor: str | None = None
        link_target: tuple[int, str, str, int] | None = None
        if size > 1:
            record = records[successor_rank]
            successor = str(record["name"])
            if record.get("link") and self._link is not None:
                link_target = (r, successor, str(record["addr"]), int(str(record["link"])))
        if rank == 0:
            with self._lock:
                served = self._worker_store
            if served is None:  # shut down meanwhile
                raise RendezvousClosedError(
                    f"this node's handler for rendezvous {self._s.run_id} was shut down"
                )
            master_addr, master_port = addr, served.port
        elif close.master_port:
            master_addr, master_port = close.master_addr, close.master_port
        else:
            master_addr, master_port = str(records[0]["addr"]), int(str(records[0]["wstore"]))
        if timings is not None:
            timings.worker_store = time.time()
        with self._lock:
            names = self._closed_names.pop(r, None)
            self._closed_names.clear()
            self._member = self._last_member = Member(r, rank, size, successor, close, own_record, names)
            self._changed_cache = None
        self._watch_link(link_target)
        # The agent's keys share this node's store connection (opening one per round
        # would add a connect to every recovery); TCPStore clients serialize their ops.
        agent_store = dist.PrefixStore(k.agent_prefix(r), store)
        log.info(
            "kelastic rendezvous: %s is rank %d of %d in round %d (worker store %s:%d)",
            self._s.node_name,
            rank,
            size,
            r,
            master_addr,
            master_port,
        )
        if timings is not None:
            timings.returned = time.time()
        return RendezvousInfo(agent_store, rank, size, RendezvousStoreInfo(master_addr, master_port))

    def _watch_link(self, target: tuple[int, str, str, int] | None) -> None:
        """Point the peer link at ``target``; waking its thread only for a change."""
        if self._link is not None and target != self._link_target:
            self._link_target = target
            self._link.watch(target)

    # -- membership --------------------------------------------------------

    def _evaluate_changed(self, store: dist.TCPStore, member: Member) -> bool:
        k, r = self._keys, member.round
        if open_round(store, k) > r + 1 or read_counter(store, k.accounted(r)) > 0:
            return True
        if read_counter(store, k.joined(r + 1)) == 0:
            return False
        bounds = read_bounds(store, k)
        max_nodes = bounds.max_nodes if bounds is not None else self._s.max_nodes
        return member.size < max_nodes

    # -- connection, events, threads ----------------------------------------

    def _connected(self, deadline: float) -> dist.TCPStore:
        with self._lock:
            if self._store is not None:
                return self._store
        # Connected outside the lock: reaching a store that is down takes up to the whole
        # timeout, and the peer link and keep-alive threads take the lock meanwhile.
        remaining = deadline - time.monotonic()
        try:
            store = connect_store(self._s.host, self._s.port, max(remaining, 0.5))
        except RendezvousConnectionError as exc:
            raise RendezvousConnectionError(
                f"rendezvous {self._s.run_id}: {exc} (gave up after join_timeout={self._s.join_timeout:g}s)"
            ) from exc.__cause__
        return self._install(store)

    def _reattach(self) -> None:
        """After the store was lost: connect again and re-establish this node's round there.

        Run by the event watcher once it reached the store again, so that a member
        whose workers keep running gets its round back without waiting for the agent.
        """
        with self._lock:
            if self._store is not None:
                return
        self._install(connect_store(self._s.host, self._s.port, RECONNECT_TIMEOUT))

    def _install(self, store: dist.TCPStore) -> dist.TCPStore:
        """Make ``store`` this node's connection (unless another one was installed meanwhile).

        On a restarted store (a new ``incarnation``) the latest round this node was a
        member of is re-established there (``protocol.restore_round``): a member whose
        group is intact keeps its workers, and one that re-joins leaves a round in which
        its fate can be claimed. If the new store holds another round of that number,
        the round is no longer current and ``membership_changed()`` says so.
        """
        with self._lock:
            if self._store is not None:
                return self._store
            # A fresh token per connection: one that a handler reused could win again
            # on a restarted store and hide the restart from that very handler.
            got = store.compare_set(self._keys.incarnation, "", new_token())
            incarnation = got.decode() if isinstance(got, bytes) else got
            if self._incarnation is not None and incarnation != self._incarnation:
                self._events.forget_closes()  # rounds of the old store
                self._restore(store)
            self._incarnation = incarnation
            self._store = store
            self._lost.clear()
            self._lost_since = None
            if not self._threads:
                self._start_threads()
        # The store is back: the threads in their reconnect back-off try now, and peers whose
        # link closed while it was away are claimed dead at once (the survivors re-form).
        self._events.retry_now.set()
        self._keep.poke.set()
        try:
            self._keep.claim_suspects(store)
        except dist.DistError:
            pass  # the keep-alive thread claims them
        self._events.bump()
        return store

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
            self._store = None
            self._changed_cache = None
            if self._lost_since is None:
                self._lost_since = time.monotonic()
        self._lost.set()
        self._events.bump()

    def _start_threads(self) -> None:
        try:
            self._link = PeerLink(self._local_addr(), self._peer_lost)
        except OSError as exc:
            log.warning("kelastic rendezvous: no peer link (%s); dead nodes are found by heartbeat only", exc)
        self._spawn_threads()
        _live_handlers.add(self)

    def _spawn_threads(self) -> None:
        """Start the event watcher and the keep-alive thread of the current generation."""
        # Each thread gets its own connection (a store client is not shared across threads).
        assert self._store is not None
        tag = f"{self._s.run_id}/{self._s.node_name}"
        # Read here, not in the thread: every event after the first connection is seen,
        # including the close of a round this node is about to join.
        seq = read_counter(self._store, self._keys.events)
        gen = self._thread_gen

        def current() -> bool:
            return gen == self._thread_gen

        self._events.set_watching(True)
        # torch's stubs lack TCPStore.clone.
        watch = (self._store.clone(), seq, current, self._reattach, self._drop_connection)  # type: ignore[attr-defined]
        beat = (self._store.clone(), current)  # type: ignore[attr-defined]
        self._threads = [
            threading.Thread(
                target=self._events.run, args=watch, name=f"kelastic-rdzv-events {tag}", daemon=True
            ),
            threading.Thread(
                target=self._keep.run, args=beat, name=f"kelastic-rdzv-keepalive {tag}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

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
            store = self._store
        if last is None or store is None:
            return
        try:
            fate = get_or_none(store, self._keys.fate(last.round, self._s.node_name))
        except dist.DistError:
            return  # the join reconnects anyway
        if fate is None or fate.decode().split("|", 1)[0] != Fate.DEAD.value:
            return
        log.warning(
            "kelastic rendezvous: %s was found dead in round %d while it ran (cut off from the store "
            "or its peers); reconnecting before it joins again",
            self._s.node_name,
            last.round,
        )
        with self._lock:
            self._thread_gen += 1  # the old threads exit when their stale connections wake them
            self._store = None
        self._connected(deadline)
        with self._lock:
            self._spawn_threads()

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

    def _rounds(self) -> tuple[Member | None, Joining | None, Member | None]:
        """For the keep-alive (under the lock): this node's round, the round it waits in, its latest."""
        return self._member, self._joining, self._last_member

    # -- helpers -------------------------------------------------------------

    def _local_addr(self) -> str:
        """The address peers reach this node on: ``local_addr``, else the route to the store."""
        if self._s.local_addr:
            return self._s.local_addr
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((self._s.host, self._s.port))
                return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostname()

    def _close_worker_store(self) -> None:
        if self._worker_store is not None:
            self._worker_store.close()
            self._worker_store = None


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

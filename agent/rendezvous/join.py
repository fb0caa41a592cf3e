"""The join of a rendezvous handler: take a slot in the open round, wait for it to close, become a member.

A node joins the open round R with O(1) store operations (see the handler's module
docstring for the protocol): ``add(r/R/joined, 1)`` hands it a slot, then it writes
its record (``r/R/node/<slot>``, with its address, its peer link's port and, in
slot 0, the port of the worker store it hosts) and ``r/R/slot/<name>``. It then
waits for the round to close: ``closewait.step`` decides every move of that wait,
:meth:`Joiner._wait_closed` applies its actions with the store reads and writes of
``rounds``. A node whose slot is below the round's size becomes a member: it reads
its ring successor's record (and rank 0's when the close did not name the worker
store); a node that came too late joins the next round at once.

Before it takes a slot, a node that is no member of the current round asks
``standby.decide`` whether the open round has a place for it: it then claims the
place and takes its slot, or *parks* without one (a standby): it waits for the
next event and asks again, with no deadline while it waits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from kelastic.agent.waiting import Wait

from . import closewait, standby
from .liveness import PeerLink
from .memberrecords import beat, slot_value, standby_value
from .protocol import (
    ControllerBounds,
    Fate,
    RoundClose,
    RoundView,
    RunKeys,
    TimerKind,
    claim_fate,
    job_closed,
    listed,
    open_round,
    push_event,
    read_bounds,
    read_close,
    read_counter,
    read_membership,
    read_size,
)
from .rounds import (
    UNREAD,
    Joining,
    Member,
    account_previous_round,
    first_signed_joiner,
    observe_round,
    read_records,
    successor_from_members,
    try_close,
    unsigned_note,
)
from .server import ServedStore, serve_store
from .settings import RendezvousSettings
from .watcher import EventWatcher

__all__ = ["PARKED_RECHECK", "Joiner", "LinkTarget", "RendezvousTimings"]

log = logging.getLogger(__name__)

#: A parked node decides again at least this often (seconds), in case an event was missed.
PARKED_RECHECK = 5.0
#: A standby says again that it waits when it parks behind a new round this long after it last did.
PARKED_LOG_EVERY = 300.0
#: A node the controller has not admitted yet says again that it waits this often (seconds).
AWAITING_LOG_EVERY = 30.0

#: What a member's peer link connects to: (round, successor's name, its address, its link port).
LinkTarget = tuple[int, str, str, int]


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


class Joiner:
    """The join and close of one handler; it hosts the worker store while this node is in slot 0.

    ``became(member, link_target)`` is called once this node is a member, before
    :meth:`join` returns. ``last_round()`` is the latest round this node was a member
    of (None: never). ``joining`` is the round this node waits in (read under
    ``lock``; None while it does not wait). ``parked`` is the round it waits for
    without a slot, as a standby (None while it does not park); ``park_deadline``
    the deadline its join has while it parks (a parked node waits without one).
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        keys: RunKeys,
        token: str,
        lock: threading.RLock,
        events: EventWatcher,
        link: Callable[[], PeerLink | None],
        local_addr: Callable[[], str],
        became: Callable[[Member, LinkTarget | None], None],
        last_round: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._s = settings
        self._keys = keys
        self._token = token
        self._lock = lock
        self._events = events
        self._link = link
        self._local_addr = local_addr
        self._became = became
        self._last_round = last_round
        self._timings: RendezvousTimings | None = None
        self.joining: Joining | None = None
        self.parked: int | None = None
        self.park_deadline = float("-inf")
        #: Replaces lost members only (``--standby``, or a straggler that stepped aside).
        self.standby = settings.standby
        #: The round this node stepped aside from (a straggler): it takes no place in the
        #: round that replaces it, which is its standby's.
        self.aside_from: int | None = None
        self._parked_said = float("-inf")  # when the standby last said that it waits
        # Since when (and when it last said so) this node waits for the controller to admit it.
        self._awaiting_since: float | None = None
        self._awaiting_said = float("-inf")
        self._worker_store: ServedStore | None = None
        # Names of rounds this node closed (it read them then), for ``Member.names``.
        self._closed_names: dict[int, tuple[str, ...]] = {}
        # The watcher epoch in which the store said the job is not closed: while the
        # watcher stays connected, its closed-job event tells the rest.
        self._closed_checked: int | None = None

    def close_worker_store(self) -> None:
        """Stop hosting the worker store (this node is no longer rank 0 of a round)."""
        with self._lock:
            if self._worker_store is not None:
                self._worker_store.close()
                self._worker_store = None

    def join(
        self, store: dist.TCPStore, deadline: float, timings: RendezvousTimings | None
    ) -> RendezvousInfo:
        """Join the open round (or later ones) until one closes with this node as a member.

        ``timings``: filled in as the phases are reached (None: not recorded).
        """
        self._timings = timings
        with Wait(f"rendezvous {self._s.run_id} at {self._s.endpoint}", log) as wait:
            return self._join(store, deadline, wait)

    def _join(self, store: dist.TCPStore, deadline: float, wait: Wait) -> RendezvousInfo:
        """:meth:`join`'s loop; ``wait`` says what it waits for."""
        k, s, name = self._keys, self._s, self._s.node_name
        next_round = 0
        while True:
            self._raise_if_shut_down()
            generation = self._events.generation
            # Read before the open round: from here on every event reaches this node
            # (unless the epoch changes), the job's and the round's close included.
            epoch = self._events.epoch()
            if epoch is None or epoch != self._closed_checked:
                if job_closed(store, k):
                    self._raise_closed()
                self._closed_checked = epoch
            if self._events.job_closed.is_set():
                self._raise_closed()
            bounds = read_bounds(store, k)
            limits = s.bounds(bounds)
            if limits is None or (bounds is not None and not listed(store, k, name)):
                # The controller has not admitted this node (yet), or has published nothing
                # in this store yet and the node is controlled: wait for a publication.
                wait.update(self._await_controller(store, bounds, deadline))
                # Woken by the next notice at the latest: the wait says what it waits for.
                until = min(deadline, self._awaiting_said + AWAITING_LOG_EVERY)
                self._events.wait_event(generation, until - time.monotonic())
                continue
            self._awaiting_since = None
            r = max(self._round_to_join(store), next_round)
            claimed = self._place(store, r, limits[1])
            if claimed is None:  # parked: no place for this node in round r yet
                wait.update(f"a place in round {r} of rendezvous {s.run_id} (a standby, without a rank)")
                self.park_deadline = time.monotonic() + s.join_timeout
                deadline = max(deadline, self.park_deadline)
                self._events.wait_event(generation, PARKED_RECHECK)
                continue
            slot = int(store.add(k.joined(r), 1)) - 1
            addr = self._local_addr()
            peer_link = self._link()
            link = peer_link.port if peer_link is not None else None
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
            signed = k.sign(k.node(r, slot), json.dumps(record))
            store.multi_set([k.node(r, slot), k.slot(r, name)], [signed, slot_value(k, r, name, slot)])  # type: ignore[attr-defined]
            beat(store, k, name)
            self._unpark(store, r if claimed else None)
            with self._lock:
                self.joining = Joining(r, slot)
            if self._timings is not None:
                self._timings.joined = time.time()
            if r > 1 and first_signed_joiner(store, k, r, slot):
                push_event(store, k, f"join {r}")  # running members learn that nodes wait
            account_previous_round(store, k, name, r)
            try:
                close = self._wait_closed(store, r, slot, deadline, epoch, bounds, wait)
            finally:
                with self._lock:
                    self.joining = None
            if slot < close.size:
                return self._become_member(store, r, slot, close, addr, json.dumps(record), deadline)
            if slot == 0:
                self.close_worker_store()
            log.info("kelastic rendezvous: %s is late for round %d; waits for round %d", name, r, r + 1)
            next_round = r + 1

    def _round_to_join(self, store: dist.TCPStore) -> int:
        """The store's open round, or the one after this node's own when the store lost the
        close of that (``standby.round_to_join``; one read more only then)."""
        opened, last = open_round(store, self._keys), self._last_round()
        lost_close = last is not None and opened <= last and read_close(store, self._keys, last) is None
        r = standby.round_to_join(opened, last, not lost_close)
        if r != opened:
            log.warning(
                "kelastic rendezvous: the store holds no close of round %d that the job signed (deleted or "
                "overwritten) and says it is open; %s, a member of it, joins round %d",
                last,
                self._s.node_name,
                r,
            )
        return r

    def _raise_if_shut_down(self) -> None:
        """End a join whose handler was shut down meanwhile (from another thread): its waits
        return at once from then on, and it would poll the store until its deadline."""
        if self._events.stopped:
            raise RendezvousClosedError(
                f"this node's handler for rendezvous {self._s.run_id} was shut down while it joined"
            )

    def _raise_closed(self) -> NoReturn:
        """The job is finished: a parked standby exits gracefully (it had no rank), a joiner fails."""
        s = self._s
        if self.parked is not None:
            self.parked = None
            raise RendezvousGracefulExitError(
                f"the job of rendezvous {s.run_id} finished while {s.node_name} waited as a standby"
            )
        raise RendezvousClosedError(f"the rendezvous {s.run_id} at {s.endpoint} is closed")

    def _await_controller(
        self, store: dist.TCPStore, bounds: ControllerBounds | None, deadline: float
    ) -> str:
        """The controller has not admitted this node: say so now and then; past ``deadline``, raise.
        Returns what the node waits for."""
        s, name, now = self._s, self._s.node_name, time.monotonic()
        if bounds is None:
            what = (
                f"the controller's membership of rendezvous {s.run_id} (rdzv-conf controlled=1: this node "
                f"joins no round before the controller published its bounds at {s.endpoint})"
            )
        else:
            what = f"the controller of rendezvous {s.run_id} to list {name}"
        if now >= deadline:
            if bounds is None:
                raise RendezvousTimeoutError(
                    f"node {name} waited join_timeout={s.join_timeout:g}s for {what}; is the controller "
                    "(kelastic's operator) running, and can it reach the store?"
                )
            listed = read_membership(store, self._keys)
            raise RendezvousTimeoutError(
                f"node {name} was not listed by the controller of rendezvous {s.run_id} at "
                f"{s.endpoint} within join_timeout={s.join_timeout:g}s (listed: "
                f"{list(listed.nodes) if listed is not None else []})"
            )
        if self._awaiting_since is None:
            self._awaiting_since = self._awaiting_said = now
            log.info("kelastic rendezvous: %s waits for %s", name, what)
        elif now - self._awaiting_said >= AWAITING_LOG_EVERY:
            self._awaiting_said = now
            log.info(
                "kelastic rendezvous: %s still waits for %s (%.0fs so far)",
                name,
                what,
                now - self._awaiting_since,
            )
        return what

    def _place(self, store: dist.TCPStore, r: int, max_nodes: int) -> bool | None:
        """Whether this node takes a slot in round r: False (a member, or the first round),
        True (it claimed one of the round's places), None (no place: it parked).
        ``max_nodes``: the bounds' maximum in force (``RendezvousSettings.bounds``)."""
        k, s = self._keys, self._s
        current = r - 1
        member = current >= 1 and self._last_round() == current
        if member or (current < 1 and not self.standby):
            return False  # the common case reads nothing more
        size = read_size(store, k, current)
        view = standby.GroupView(
            current=current,
            size=size,
            gone=read_counter(store, k.gone(current)) if size else 0,
            max_nodes=max_nodes,
            claimed=read_counter(store, k.claimed(r)) if current >= 1 else 0,
            member=member,
            standby=self.standby,
        )
        move = standby.Move.PARK if self.aside_from == current else standby.decide(view)
        if move is standby.Move.JOIN:
            return False
        if move is standby.Move.CLAIM:
            if standby.claim_won(view, int(store.add(k.claimed(r), 1))):
                log.info("kelastic rendezvous: %s takes a place in round %d", s.node_name, r)
                log.debug(
                    "kelastic rendezvous: %s takes one of the %d places of round %d (round %d: %d members, "
                    "%d lost, max %d)",
                    s.node_name,
                    standby.places(view),
                    r,
                    current,
                    view.size,
                    view.gone,
                    view.max_nodes,
                )
                return True
            store.add(k.claimed(r), -1)  # another node took the last place first
        if self.parked != r:
            store.add(k.parked(r), 1)
            store.set(k.standby(s.node_name), standby_value(k, s.node_name, r))
            if self.parked is None or time.monotonic() - self._parked_said >= PARKED_LOG_EVERY:
                self._parked_said = time.monotonic()
                log.info("kelastic rendezvous: %s is a standby, waiting for round %d", s.node_name, r)
                log.debug(
                    "kelastic rendezvous: %s waits without a rank for a place in round %d "
                    "(round %d: %d members, %d lost, max %d%s)",
                    s.node_name,
                    r,
                    current,
                    view.size,
                    view.gone,
                    view.max_nodes,
                    "; it only replaces lost members" if self.standby else "",
                )
            self.parked = r
        return None

    def step_aside(self, store: dist.TCPStore, r: int) -> None:
        """This member of round r leaves it to make room (a straggler): fate ``left`` now, and
        from its next join on it replaces lost members only, never in the round that replaces
        it (that place is its standby's). Raises ``DistError`` when the store cannot be told."""
        name = self._s.node_name
        claim_fate(store, self._keys, r, name, Fate.LEFT, name)
        self.standby, self.aside_from = True, r
        log.info("kelastic rendezvous: %s steps aside from round %d and waits as a standby", name, r)

    def _unpark(self, store: dist.TCPStore, claimed_round: int | None) -> None:
        """This node took a slot: it is no standby any more (a claimer tells the deciders it arrived)."""
        k = self._keys
        if claimed_round is not None:
            store.add(k.arrived(claimed_round), 1)
            push_event(store, k, f"standby {claimed_round} {self._s.node_name}")
        if self.parked is not None:
            store.delete_key(k.standby(self._s.node_name))
            self.parked = None

    def unpark_quietly(self, store: dist.TCPStore) -> None:
        """Best effort on shutdown: a parked node removes its standby record."""
        if self.parked is None:
            return
        try:
            store.delete_key(self._keys.standby(self._s.node_name))
        except dist.DistError:
            pass
        self.parked = None

    def _serve_worker_store(self, addr: str) -> int:
        with self._lock:
            self.close_worker_store()
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
        wait: Wait,
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
        read then, for the first evaluation. ``wait`` says how many peers joined, now and then.
        """
        k, s = self._keys, self._s
        state = closewait.start(r, slot, deadline, epoch, {kind: s.timer(kind) for kind in TimerKind})
        # The answer to the action just applied (at most one is set).
        stored: RoundClose | None = None
        opened: int | None = None
        observed: RoundView | None = None
        while True:
            self._raise_if_shut_down()
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
                opened = open_round(store, k) - 1
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
                self._wait_telling(store, r, action, bounds, wait)
            elif isinstance(action, closewait.Return):
                return action.close
            elif action.reason is closewait.FailReason.JOB_CLOSED:
                raise RendezvousClosedError(f"the rendezvous {s.run_id} at {s.endpoint} is closed")
            else:
                joined = read_counter(store, k.joined(r))
                raise RendezvousTimeoutError(
                    f"rendezvous {s.run_id} at {s.endpoint}: round {r} did not close within "
                    f"join_timeout={s.join_timeout:g}s ({joined} joined, min {s.min_nodes}, max "
                    f"{s.max_nodes} unless the controller set other bounds){unsigned_note(k)}"
                )

    def _wait_telling(
        self,
        store: dist.TCPStore,
        r: int,
        action: closewait.Wait,
        bounds: ControllerBounds | None,
        wait: Wait,
    ) -> None:
        """Apply a ``Wait`` action, saying meanwhile how many peers joined round r (one read per notice)."""
        while True:
            now = time.monotonic()
            if now >= action.until:
                return
            if self._events.wait_event(action.generation, min(action.until, wait.next_at()) - now):
                return
            wait.tell(lambda: self._peers_joined(store, r, bounds))

    def _peers_joined(self, store: dist.TCPStore, r: int, bounds: ControllerBounds | None) -> str:
        """ "peers: 1 of at least 2 joined …", for the wait's notice."""
        s = self._s
        lo, hi = s.bounds(bounds) or (s.min_nodes, s.max_nodes)
        return (
            # The run and the store are in the agent's first line; this one fits a terminal.
            f"peers: {read_counter(store, self._keys.joined(r))} of at least {lo} joined (max {hi}, round {r})"
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
        # Only rank 0's record, for a worker store the close does not name, is required; the
        # successor's, a stranger may have deleted or overwritten since the close: that costs
        # the peer link to it, not the round.
        required = frozenset({0}) if rank != 0 and not close.master_port else frozenset()
        records = read_records(store, k, self._s.run_id, r, sorted(wanted), deadline, required)
        successor: str | None = None
        link_target: LinkTarget | None = None
        record = records.get(successor_rank)
        if size > 1 and record is None:
            successor = successor_from_members(store, k, r, successor_rank)
        elif size > 1 and record is not None:
            successor = str(record["name"])
            if record.get("link") and self._link() is not None:
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
        self._became(Member(r, rank, size, successor, close, own_record, names), link_target)
        # The agent's keys share this node's store connection (opening one per round
        # would add a connect to every recovery); TCPStore clients serialize their ops.
        agent_store = dist.PrefixStore(k.agent_prefix(r), store)
        # The worker store is in the agent's own line (``master``).
        log.info("kelastic rendezvous: %s is rank %d of %d in round %d", self._s.node_name, rank, size, r)
        if timings is not None:
            timings.returned = time.time()
        return RendezvousInfo(agent_store, rank, size, RendezvousStoreInfo(master_addr, master_port))

"""A joiner's reads and writes of its round in the store: the I/O behind the close-wait's actions.

``closewait`` decides what a joiner does while its round is open; the functions
here do the store side of it: observe the close rule's inputs
(:func:`observe_round`), close the round (:func:`try_close`), read rank 0's worker
store and the records a new member needs (:func:`read_worker_store`,
:func:`read_records`), and claim this node's ``rejoin`` fate in the round before
(:func:`account_previous_round`). :class:`Member` and :class:`Joining` are what a
handler remembers of its rounds. Every function reads O(1) keys of O(1) size,
except where its docstring says O(N).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

from .memberrecords import members_value, read_members, read_slot
from .protocol import (
    ControllerBounds,
    Fate,
    RoundClose,
    RoundView,
    RunKeys,
    claim_fate,
    close_event,
    listed_all_joined,
    mark_closed,
    node_record,
    push_event,
    read_bounds,
    read_close,
    read_counter,
    read_membership,
    read_optional,
    round_close,
)
from .settings import RendezvousSettings

__all__ = [
    "PEER_KEY_WAIT",
    "UNREAD",
    "Joining",
    "Member",
    "Unread",
    "account_previous_round",
    "first_signed_joiner",
    "nodes_waiting",
    "observe_round",
    "read_records",
    "read_worker_store",
    "successor_from_members",
    "try_close",
    "unsigned_note",
]

log = logging.getLogger(__name__)

#: Bound on waiting for a key a peer writes right after taking its slot.
PEER_KEY_WAIT = 10.0


class Unread:
    """Marks an argument as not read yet (None being a meaningful value)."""


UNREAD = Unread()


@dataclass(frozen=True)
class Member:
    """This node's place in a closed round: its rank, the round's size, whom it watches."""

    round: int
    rank: int
    size: int
    successor: str | None
    # What re-establishes the round on a restarted store (``protocol.restore_round``):
    # how it closed, this node's join record, and the member names if this node closed it.
    close: RoundClose | None = None
    record: str = ""
    names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Joining:
    """This node holds ``slot`` of the open round ``round`` and waits for it to close."""

    round: int
    slot: int


def previous_round(store: dist.TCPStore, keys: RunKeys, r: int) -> tuple[int, int]:
    """The round before r that formed a group, and its size: r-1, or before it when r-1 closed
    empty (:func:`try_close`); (r-1, 0) while r-1 is open, (0, 0) when none formed."""
    p = r - 1
    while p >= 1:
        close = read_close(store, keys, p)
        if close is None or close.size > 0:
            return p, 0 if close is None else close.size
        p -= 1
    return 0, 0


def account_previous_round(store: dist.TCPStore, keys: RunKeys, name: str, r: int) -> None:
    """If node ``name`` was a member of the round before r (:func:`previous_round`), claim its
    fate there: it re-joined."""
    previous, size = previous_round(store, keys, r)
    if previous < 1:
        return
    slot = read_slot(store, keys, previous, name)
    if slot is not None and slot < size:
        claim_fate(store, keys, previous, name, Fate.REJOIN, name)


def observe_round(
    store: dist.TCPStore,
    keys: RunKeys,
    settings: RendezvousSettings,
    r: int,
    bounds: ControllerBounds | Unread | None = UNREAD,
    own_count: int | None = None,
    deep: bool = True,
) -> RoundView:
    """The close rule's inputs: O(1) reads, plus O(N) only when every listed node may be here.

    ``bounds``: the controller's bounds if just read (None: none published). A
    controlled node that finds none (the store restarted under it) gets a view that
    closes nothing (``awaiting_controller``). The O(N) check that every listed node
    joined is made by a joiner only when its own join (``own_count`` = its slot + 1)
    completed the count, waiting for records still on the way, and by the deciders
    (``deep``). Nodes that merely
    read a complete count do not: thousands of simultaneous joiners would
    otherwise each read every record (O(N) each, O(N^2) for the store).
    """
    k, s = keys, settings
    joined = read_counter(store, k.joined(r))
    if isinstance(bounds, Unread):
        bounds = read_bounds(store, k)
    prev, prev_size = previous_round(store, k, r)
    prev_accounted = read_counter(store, k.accounted(prev)) if prev_size else 0
    limits = s.bounds(bounds)
    if limits is None:
        return RoundView(
            joined=joined,
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
            prev_size=prev_size,
            prev_accounted=prev_accounted,
            controlled=True,
            listed_all_joined=False,
            awaiting_controller=True,
        )
    min_nodes, max_nodes = limits
    listed = False
    if bounds is not None and joined >= min_nodes and (deep or own_count is not None):
        gone = read_counter(store, k.gone(prev)) if prev_size else 0
        if (joined if own_count is None else own_count) + gone >= bounds.count:
            membership = read_membership(store, k)
            wait = PEER_KEY_WAIT if own_count is not None else 0.0
            listed = membership is not None and listed_all_joined(
                store, k, r, joined, membership.nodes, wait=wait
            )
    # Without a controller, a round that replaces lost members waits for the standbys
    # parked for it (``RoundView.standbys_on_their_way``): O(1) reads, only then.
    prev_gone = parked = claimed = arrived = 0
    if bounds is None and prev_size and prev_accounted and min_nodes <= joined < max_nodes:
        prev_gone = read_counter(store, k.gone(prev))
        if prev_gone:
            parked = read_counter(store, k.parked(r))
            claimed = read_counter(store, k.claimed(r))
            arrived = read_counter(store, k.arrived(r))
    if prev_size:
        # Every joiner adds its slot to ``joined`` before it counts anywhere else (a member's
        # rejoin in ``accounted``, a claimer in ``arrived``): read again after those, the count
        # holds each node they include. The first read may predate one of them, and a round
        # closed at that count would leave it out: late, and a second re-form right after.
        joined = read_counter(store, k.joined(r))
    return RoundView(
        joined=joined,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        prev_size=prev_size,
        prev_accounted=prev_accounted,
        controlled=bounds is not None,
        listed_all_joined=listed,
        prev_gone=prev_gone,
        parked=parked,
        claimed=claimed,
        arrived=arrived,
    )


def try_close(
    store: dist.TCPStore, keys: RunKeys, r: int, size: int, name: str, token: str
) -> tuple[str, ...] | None:
    """Close round r with ``size`` members if nobody did yet; the winner does the bookkeeping.

    The close names rank 0's worker store (slot 0 publishes it with its join
    record), so that members learn everything from the close event alone. The
    winner reads the members' names (O(N)), lists them for the controller and
    claims ``dropped`` for those the controller no longer lists. Returns those
    names (none when it closed the round empty); None if another node closed it.

    A slot below ``size`` whose record is still missing, or not signed by the job, after
    :data:`PEER_KEY_WAIT` (the count of joiners is ``add``-ed: a stranger's add leaves a slot
    nobody holds, where it may write a record of its own) closes the round with no member
    (size 0): its joiners come too late and go to the next round. So a record the job did
    not sign never becomes a member (nor rank 0, with its worker store), and costs one round.
    """
    k = keys
    records = _member_records(store, k, r, size)
    if records is None:
        # A slot below the size holds no record, or one the job did not sign: the count of
        # joiners is not theirs alone (anyone may add to it, and write in the slot it
        # leaves), a joiner vanished between its slot and its record, or a joiner holds
        # another secret. The round closes with no member, so that its joiners go on to
        # the next round (one round more) rather than form a group with a member that is
        # not one of the job's.
        log.warning(
            "kelastic rendezvous: round %d counts %d joiners but not every slot below holds a record "
            "signed by the job (a count not theirs alone, a joiner gone, or one with another job "
            "secret): closing it empty, its joiners go to round %d",
            r,
            size,
            r + 1,
        )
        size, records = 0, []
    master_addr, master_port = read_worker_store(store, k, r) if size else ("", 0)
    mine = RoundClose(size, name, token, master_addr, master_port)
    value = k.sign(k.size(r), mine.to_value())
    got = store.compare_set(k.size(r), "", value)
    raw = got if isinstance(got, bytes) else got.encode()
    if raw != value.encode() and (
        # A close the job did not sign (a stranger's) counts as absent: take its place.
        round_close(k, r, raw) is not None or store.compare_set(k.size(r), raw, value) != value.encode()  # type: ignore[arg-type]
    ):
        return None
    mark_closed(store, k, r)
    push_event(store, k, close_event(r, mine))
    names = tuple(str(rec["name"]) for rec in records)
    store.set(k.members(r), members_value(k, r, names))
    ctl = read_membership(store, k)
    if ctl is not None:
        listed = set(ctl.nodes)
        for member in names:
            if member not in listed:
                claim_fate(store, k, r, member, Fate.DROPPED, name)
    log.info("kelastic rendezvous: closed round %d with %d nodes", r, size)
    return names


def _member_records(store: dist.TCPStore, keys: RunKeys, r: int, size: int) -> list[dict[str, object]] | None:
    """The join records of slots 0..size-1 of round r, each signed by the job, waiting (up to
    :data:`PEER_KEY_WAIT`) for ones on the way; None when one is still missing or not signed
    by the job (a stranger's, or a joiner's with another secret) then."""
    node_keys = [keys.node(r, i) for i in range(size)]
    until = time.monotonic() + PEER_KEY_WAIT
    while True:
        if not store.check(node_keys):
            try:
                store.wait(node_keys, datetime.timedelta(seconds=max(0.1, until - time.monotonic())))
            except dist.DistStoreError:
                return None
        records = [node_record(keys, r, i, raw) for i, raw in enumerate(store.multi_get(node_keys))]
        if all(rec is not None for rec in records):
            return [rec for rec in records if rec is not None]
        # A record the job did not sign: its member's own may still be on the way (a
        # stranger wrote first); the wait also paces the rounds that close empty for it.
        if time.monotonic() >= until:
            return None
        time.sleep(0.5)


def nodes_waiting(store: dist.TCPStore, keys: RunKeys, r: int, limit: int) -> bool:
    """Whether a node of the job waits in round r: one of its first ``limit`` slots (the most a
    round takes) holds a join record the job signed.

    The count of joiners is only a hint: anyone may add to it, which leaves slots that nobody
    holds, so a count alone would have a running group re-form for joiners that never come.
    One read while nobody joined, one or two more while the first slot holds its joiner's
    record (the common case), up to ``limit`` where a stranger's adds left slots empty.
    """
    joined = read_counter(store, keys.joined(r))
    for slot in range(min(joined, limit)):
        if node_record(keys, r, slot, read_optional(store, keys.node(r, slot))) is not None:
            return True
    return False


def first_signed_joiner(store: dist.TCPStore, keys: RunKeys, r: int, slot: int) -> bool:
    """Whether the joiner of ``slot`` in round r tells the running members that nodes wait (the
    ``join`` event): the joiner of slot 0, or a later one where slot 0 holds no join record the
    job signed (a stranger's add took it), whose own record the members would otherwise find
    only at the next event. One read for a joiner past slot 0."""
    if slot == 0:
        return True
    return node_record(keys, r, 0, read_optional(store, keys.node(r, 0))) is None


def successor_from_members(store: dist.TCPStore, keys: RunKeys, r: int, rank: int) -> str | None:
    """The name of rank ``rank`` of round r from the round's member list (signed by its closer),
    for a member whose successor's join record is gone or not the job's; None when that list is
    not there either (the member then watches nobody this round: a lost peer still fails the
    group's collectives)."""
    names = read_members(store, keys, r)
    name = names[rank] if names is not None and 0 <= rank < len(names) else None
    log.warning(
        "kelastic rendezvous: the join record of rank %d of round %d is gone or not signed by the job "
        "(a stranger deleted or overwrote it): %s",
        rank,
        r,
        f"watching {name} by its heartbeat only" if name else "watching no peer this round",
    )
    return name


def unsigned_note(keys: RunKeys) -> str:
    """What a failed join adds when this node ignored records the job did not sign ("" when none):
    rounds whose members' records it cannot check close empty, so a joiner with another secret
    (or a stranger who writes in every round) is what keeps its rounds from forming."""
    n = keys.signer.refused
    if not n:
        return ""
    return (
        f"; {n} store records it read are not signed with this node's job secret: its --job-secret-file "
        "is not the one the other agents of the job hold (give every agent of the job the same file), "
        "or a stranger wrote them"
    )


def read_worker_store(store: dist.TCPStore, keys: RunKeys, r: int) -> tuple[str, int]:
    """Rank 0's worker store in round r from its record; ("", 0) if it did not write it in time."""
    key = keys.node(r, 0)
    # Not ``get_or_none``: on the libuv store a compare-and-set of a missing key
    # wakes every client waiting for that key, and members may wait for this one.
    if not store.check([key]):  # slot 0 is taken (a node joined); its record is on the way
        try:
            store.wait([key], datetime.timedelta(seconds=PEER_KEY_WAIT))
        except dist.DistStoreError:
            return "", 0
    record = node_record(keys, r, 0, store.get(key))
    if record is None:  # a stranger's: the members read rank 0's own record later
        return "", 0
    return str(record["addr"]), int(str(record.get("wstore") or 0))


def read_records(
    store: dist.TCPStore,
    keys: RunKeys,
    run_id: str,
    r: int,
    slots: list[int],
    deadline: float,
    required: frozenset[int] = frozenset(),
) -> dict[int, dict[str, object]]:
    """The join records of ``slots`` in round r, waiting (bounded) for ones still on the way.

    A record still missing, or not signed by the job, then (a stranger deleted or overwrote
    it after the round closed) is left out; RendezvousTimeoutError when it is one of
    ``required``."""
    if not slots:
        return {}
    node_keys = [keys.node(r, i) for i in slots]
    until = min(deadline, time.monotonic() + PEER_KEY_WAIT)
    while True:
        # Not ``get_or_none`` (one round trip less): on the libuv store a compare-and-set
        # of a missing key wakes every client waiting for it, whose read then finds nothing.
        if not store.check(node_keys):
            wait_for = datetime.timedelta(seconds=max(0.1, until - time.monotonic()))
            try:
                store.wait(node_keys, wait_for)
            except dist.DistStoreError as exc:
                if required & set(slots):
                    raise RendezvousTimeoutError(
                        f"rendezvous {run_id}: ranks {slots} of round {r} did not write their "
                        f"records within {wait_for.total_seconds():.0f}s"
                    ) from exc
                present = [i for i, key in zip(slots, node_keys, strict=True) if store.check([key])]
                return read_records(store, keys, run_id, r, present, deadline, required)
        raws = store.multi_get(node_keys)
        records = {i: node_record(keys, r, i, raw) for i, raw in zip(slots, raws, strict=True)}
        if all(rec is not None for rec in records.values()):
            return {i: rec for i, rec in records.items() if rec is not None}
        # A record a stranger wrote over (or before) the member's own: wait for the member's.
        if time.monotonic() >= until and not required & {i for i, rec in records.items() if rec is None}:
            return {i: rec for i, rec in records.items() if rec is not None}
        if time.monotonic() >= until:
            raise RendezvousTimeoutError(
                f"rendezvous {run_id}: the records of ranks {slots} of round {r} are not signed with this "
                "node's job secret: its --job-secret-file is not the one the other agents of the job hold "
                "(give every agent of the job the same file), or a stranger wrote them"
            )
        time.sleep(0.1)

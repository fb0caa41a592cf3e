"""Standbys in the rendezvous: nodes that wait without a slot and take a lost member's place.

The pure decision (``standby.decide``) in a table, then handlers against a real
``kelastic-rendezvous`` store. The close rule's wait for standbys is tabled in
test_rdzv_protocol.py; a member process SIGKILLed while a standby waits is in
test_rdzv_failures.py, real agents in test_agent_e2e.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError, RendezvousInfo

from kelastic.agent.rendezvous import KelasticRendezvousHandler, ServerProcess, control, standby
from kelastic.agent.rendezvous.memberrecords import read_standby
from kelastic.agent.rendezvous.protocol import RunKeys, read_counter
from kelastic.agent.rendezvous.standby import GroupView, Move
from kelastic.agent.rendezvous.testing import in_thread, job_key, kelastic_handler, rendezvous_concurrently

# -- the decision (pure) -----------------------------------------------------------------


def group(**kw: Any) -> GroupView:
    base: dict[str, Any] = dict(
        current=3, size=3, gone=0, max_nodes=3, claimed=0, member=False, standby=False
    )
    base.update(kw)
    return GroupView(**base)


@pytest.mark.parametrize(
    ("kw", "places", "move"),
    [
        # A member of the current round re-joins at once, whatever the counts say.
        (dict(member=True), 0, Move.JOIN),
        # No group yet: the first round takes everyone (extras come too late, then park) ...
        (dict(current=0, size=0), 3, Move.JOIN),
        # ... but a node started as a standby waits for the group to form without it.
        (dict(current=0, size=0, standby=True), 0, Move.PARK),
        # A full, intact group: no place, the node parks (a standby).
        (dict(), 0, Move.PARK),
        # One member lost: one place, claimed by the first parked node ...
        (dict(gone=1), 1, Move.CLAIM),
        # ... and not by a second one.
        (dict(gone=1, claimed=1), 1, Move.PARK),
        # A group below max has room: a node that arrives grows it (claims the room) ...
        (dict(max_nodes=4), 1, Move.CLAIM),
        # ... but a standby only replaces lost members.
        (dict(max_nodes=4, standby=True), 0, Move.PARK),
        (dict(max_nodes=4, gone=1, standby=True), 1, Move.CLAIM),
        # Max lowered to the survivors (a scale-down dropped a member): no place.
        (dict(max_nodes=2, gone=1), 0, Move.PARK),
        # Two lost, one place claimed: the second is still free.
        (dict(gone=2, claimed=1), 2, Move.CLAIM),
        # A restarted store that lost the round's size: as if below max.
        (dict(size=0), 3, Move.CLAIM),
    ],
)
def test_where_a_node_that_is_no_member_goes(kw: dict[str, Any], places: int, move: Move) -> None:
    view = group(**kw)
    assert standby.places(view) == places
    assert standby.decide(view) is move


@pytest.mark.parametrize(
    ("opened", "last", "last_closed", "joins"),
    [
        (5, 4, True, 5),  # the common re-join: the store opens the round after one's own
        (5, None, False, 5),  # no round of its own: where the store says
        (9, 4, False, 9),  # later rounds closed without it: where the store says
        (4, 4, False, 5),  # one's own round's close and the latest mark deleted: the round after it
        (2, 4, False, 5),  # ... with rounds before it passed over as well
        (4, 4, True, 4),  # the close is there (its count not in yet): where the store says
    ],
)
def test_a_member_joins_the_round_after_its_own_only_when_the_store_lost_its_close(
    opened: int, last: int | None, last_closed: bool, joins: int
) -> None:
    assert standby.round_to_join(opened, last, last_closed) == joins


def test_a_claim_past_the_places_is_lost() -> None:
    view = group(gone=1)
    assert standby.claim_won(view, 1)
    assert not standby.claim_won(view, 2)
    assert not standby.claim_won(view, 0)


# -- handlers against a real store --------------------------------------------------------


def make(endpoint: str, run_id: str, name: str, lo: int, hi: int, **conf: Any) -> KelasticRendezvousHandler:
    conf.setdefault("last_call_timeout", 0.3)
    conf.setdefault("join_timeout", 20)
    return kelastic_handler(endpoint, run_id, name, lo, hi, **conf)


def counter(server: ServerProcess, run_id: str, key: Callable[[RunKeys], str]) -> int:
    store = control.connect(server.endpoint)
    return read_counter(store, key(RunKeys(run_id)))


def standby_record(server: ServerProcess, run_id: str, name: str) -> dict[str, Any] | None:
    store = control.connect(server.endpoint)
    return read_standby(store, RunKeys(run_id), name)  # its text (the test holds no key)


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def test_a_node_that_finds_the_group_full_parks_without_a_slot_and_replaces_a_leaver(
    server: ServerProcess, run_id: str
) -> None:
    members = [make(server.endpoint, run_id, f"n{i}", 2, 2) for i in range(2)]
    rendezvous_concurrently(members)
    spare = make(server.endpoint, run_id, "spare", 2, 2)
    thread, out = in_thread(spare.next_rendezvous)
    wait_until("the spare's standby record", lambda: standby_record(server, run_id, "spare") is not None)
    assert standby_record(server, run_id, "spare") == {
        "round": 2,
        "since": pytest.approx(time.time(), abs=30),
    }
    # It holds no slot of the open round, so the full group has nothing to re-form for.
    assert counter(server, run_id, lambda k: k.joined(2)) == 0
    assert counter(server, run_id, lambda k: k.parked(2)) == 1
    assert not members[0].wait_membership_change(1.0)
    assert not out
    members[1].shutdown()
    assert members[0].wait_membership_change(5)
    (info,) = rendezvous_concurrently(members[:1])
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo), out
    assert info.world_size == 2 and out[0].world_size == 2
    # One re-form: round 2 took the spare in; nothing was claimed past the one place.
    assert counter(server, run_id, lambda k: k.open) == 2
    assert counter(server, run_id, lambda k: k.claimed(2)) == 1
    assert standby_record(server, run_id, "spare") is None


@pytest.mark.slow
def test_a_standby_outlives_its_join_timeout_while_it_waits(server: ServerProcess, run_id: str) -> None:
    members = [make(server.endpoint, run_id, f"n{i}", 2, 2) for i in range(2)]
    rendezvous_concurrently(members)
    spare = make(server.endpoint, run_id, "spare", 2, 2, join_timeout=1.0)
    thread, out = in_thread(spare.next_rendezvous)
    time.sleep(2.5)  # over twice its join_timeout, parked
    assert not out, out
    # The survivor is already waiting in the next round when the place opens: the spare's own
    # join_timeout (1 s) rightly applies again once it claimed the place, and must not also
    # have to cover how long the survivor takes to notice the loss on a loaded machine.
    survivor, survived = in_thread(members[1].next_rendezvous)
    wait_until("the survivor to wait in round 2", lambda: counter(server, run_id, lambda k: k.joined(2)) == 1)
    assert not out and not survived, (out, survived)
    members[0].shutdown()
    survivor.join(10)
    (info,) = survived
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo), out
    assert info.world_size == out[0].world_size == 2


def test_two_standbys_and_one_loss_one_takes_the_place_the_other_keeps_waiting(
    server: ServerProcess, run_id: str
) -> None:
    members = [make(server.endpoint, run_id, f"n{i}", 1, 3) for i in range(3)]
    rendezvous_concurrently(members)
    spares = [make(server.endpoint, run_id, f"s{i}", 1, 3) for i in range(2)]
    runs = [in_thread(s.next_rendezvous) for s in spares]
    wait_until("two parked", lambda: counter(server, run_id, lambda k: k.parked(2)) == 2)
    members[2].shutdown()
    infos = rendezvous_concurrently(members[:2])
    assert {i.world_size for i in infos} == {3}
    wait_until("one standby in", lambda: sum(bool(out) for _, out in runs) == 1)
    joined = [out[0] for _, out in runs if out]
    assert isinstance(joined[0], RendezvousInfo) and joined[0].world_size == 3
    # The other one parks again, behind round 2, holding no slot of round 3.
    time.sleep(0.5)
    assert sum(bool(out) for _, out in runs) == 1
    assert counter(server, run_id, lambda k: k.joined(3)) == 0
    assert counter(server, run_id, lambda k: k.open) == 2


def test_a_node_started_as_a_standby_does_not_grow_the_group(server: ServerProcess, run_id: str) -> None:
    """``standby=1``: below max, the group is not re-formed for it; it replaces a leaver."""
    members = [make(server.endpoint, run_id, f"n{i}", 2, 3) for i in range(2)]
    reserve = make(server.endpoint, run_id, "reserve", 2, 3, standby="1")
    thread, out = in_thread(reserve.next_rendezvous)
    infos = rendezvous_concurrently(members)
    assert {i.world_size for i in infos} == {2}, "the standby took no part in the first round"
    wait_until("the standby parked", lambda: standby_record(server, run_id, "reserve") is not None)
    assert not members[0].wait_membership_change(1.0)
    members[1].shutdown()
    (info,) = rendezvous_concurrently(members[:1])
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo), out
    assert info.world_size == out[0].world_size == 2


def test_raised_bounds_take_the_parked_node_in_first(server: ServerProcess, run_id: str) -> None:
    """A scale-up by the controller: the parked node claims the room, the members re-form."""
    store = control.connect(server.endpoint)
    names = ["n0", "n1", "spare"]
    control.publish_membership(store, run_id, nodes=names, min_nodes=1, max_nodes=2)
    members = [make(server.endpoint, run_id, n, 1, 4) for n in names[:2]]
    rendezvous_concurrently(members)
    spare = make(server.endpoint, run_id, "spare", 1, 4)
    thread, out = in_thread(spare.next_rendezvous)
    wait_until("the spare parked", lambda: standby_record(server, run_id, "spare") is not None)
    assert not members[0].wait_membership_change(0.5)
    # The controller sees it as a standby: listed, no member, parked.
    assert control.read_status(store, run_id).standbys == ("spare",)
    control.publish_membership(store, run_id, nodes=names, min_nodes=1, max_nodes=3)
    assert members[0].wait_membership_change(5)
    infos = rendezvous_concurrently(members)
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo), out
    assert {i.world_size for i in [*infos, out[0]]} == {3}
    assert control.read_status(store, run_id).standbys == ()


def test_lowered_bounds_shrink_the_group_and_the_node_past_them_parks(
    server: ServerProcess, run_id: str
) -> None:
    store = control.connect(server.endpoint)
    names = ["n0", "n1", "n2"]
    control.publish_membership(store, run_id, nodes=names, min_nodes=1, max_nodes=3)
    members = [make(server.endpoint, run_id, n, 1, 3) for n in names]
    rendezvous_concurrently(members)
    control.publish_membership(store, run_id, nodes=names, min_nodes=1, max_nodes=2)
    assert all(m.wait_membership_change(5) for m in members)
    runs = [in_thread(m.next_rendezvous) for m in members]
    wait_until("two members", lambda: sum(bool(out) for _, out in runs) == 2)
    time.sleep(0.3)
    assert sum(bool(out) for _, out in runs) == 2
    assert {out[0].world_size for _, out in runs if out} == {2}
    parked = [m.node_name for m, (_, out) in zip(members, runs, strict=True) if not out]
    wait_until("the third parked", lambda: standby_record(server, run_id, parked[0]) is not None)


def test_a_standby_exits_gracefully_when_the_job_finishes(server: ServerProcess, run_id: str) -> None:
    """It had no rank: the end of the job is a graceful exit for it, not a failure."""
    members = [make(server.endpoint, run_id, f"n{i}", 2, 2) for i in range(2)]
    rendezvous_concurrently(members)
    spare = make(server.endpoint, run_id, "spare", 2, 2)
    thread, out = in_thread(spare.next_rendezvous)
    wait_until("the spare parked", lambda: standby_record(server, run_id, "spare") is not None)
    members[0].set_closed()
    thread.join(10)
    assert isinstance(out[0], RendezvousGracefulExitError), out
    assert "waited as a standby" in str(out[0])


# -- nodes that reach the store before the controller's bounds -----------------------------------


def waited_for_controller(caplog: pytest.LogCaptureFixture, run_id: str, name: str) -> int:
    """How often node ``name`` said it waits for the controller's membership of ``run_id``."""
    said = f"kelastic rendezvous: {name} waits for the controller's membership of rendezvous {run_id} "
    return sum(r.getMessage().startswith(said) for r in caplog.records)


def test_controlled_nodes_that_arrive_before_the_bounds_form_no_group_above_them(
    server: ServerProcess, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The order an operator's pods may meet: three agents (``--nnodes 2:3``, maxReplicas) reach
    the store before the operator published ``max_nodes`` = replicas = 2. They take no slot
    until it did; then the first round closes at 2 and the third parks: one group, of 2,
    never a group of 3 that re-forms at 2."""
    caplog.set_level(logging.INFO, logger="kelastic.agent.rendezvous.join")
    names = ["w0", "w1", "w2"]
    nodes = [make(server.endpoint, run_id, n, 2, 3, controlled="1") for n in names]
    runs = [in_thread(h.next_rendezvous) for h in nodes]
    wait_until(
        "every node to wait for the controller (or to return)",
        lambda: all(waited_for_controller(caplog, run_id, n) for n in names) or any(out for _, out in runs),
    )
    assert not any(out for _, out in runs), [out for _, out in runs]
    assert counter(server, run_id, lambda k: k.joined(1)) == 0
    assert counter(server, run_id, lambda k: k.open) == 0
    store = control.connect(server.endpoint)
    # Signed with the job's secret, as the operator publishes: controlled nodes take no other.
    control.publish_membership(store, run_id, nodes=names, min_nodes=2, max_nodes=2, job_key=job_key())
    wait_until("two members", lambda: sum(bool(out) for _, out in runs) >= 2)
    spare = [n for n, (_, out) in zip(names, runs, strict=True) if not out]
    assert len(spare) == 1, [out for _, out in runs]
    wait_until("the third parked", lambda: standby_record(server, run_id, spare[0]) is not None)
    infos = [out[0] for _, out in runs if out]
    assert all(isinstance(i, RendezvousInfo) for i in infos), infos
    assert [i.world_size for i in infos] == [2, 2]
    # One round closed, and it stays current: the members have nothing to re-form for.
    member = next(h for h, (_, out) in zip(nodes, runs, strict=True) if out)
    assert not member.wait_membership_change(0.5)
    assert counter(server, run_id, lambda k: k.open) == 1
    assert control.read_status(store, run_id).standbys == (spare[0],)


def test_a_node_without_a_controller_acts_on_its_own_bounds(server: ServerProcess, run_id: str) -> None:
    """Without ``controlled`` (plain ``kelastic-agent``, no operator) no bounds are waited for:
    --nnodes is the truth, and three nodes of ``2:3`` form a group of 3 at once."""
    nodes = [make(server.endpoint, run_id, f"n{i}", 2, 3) for i in range(3)]
    assert {i.world_size for i in rendezvous_concurrently(nodes)} == {3}

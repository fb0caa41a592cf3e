"""The member records the agents act on are signed (kelastic.agent.rendezvous.memberrecords), and
the counters anyone may add to cannot steer them: each attack as a stranger with store access
makes it (heartbeats, slots, member lists, standbys, the ``open`` counter)."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
import torch.distributed as dist

from kelastic.agent.rendezvous import ServerProcess
from kelastic.agent.rendezvous import memberrecords as mr
from kelastic.agent.rendezvous.protocol import (
    Fate,
    RoundClose,
    RunKeys,
    claim_fate,
    connect_store,
    count_fates,
    mark_closed,
    open_round,
    push_event,
    read_close,
    restore_round,
)
from kelastic.agent.rendezvous.records import RecordSigner
from kelastic.agent.rendezvous.rounds import account_previous_round

KEY = secrets.token_hex(32).encode()


def job_keys(run: str = "run") -> RunKeys:
    return RunKeys(run, RecordSigner.for_job(KEY))


def job_keys_of(run_id: str) -> RunKeys:
    """The keys of ``run_id`` as the job's agents sign them (the secret of the test's agents)."""
    from kelastic.agent.rendezvous.testing import job_keys as agents_keys

    return agents_keys(run_id)


def read_close_of(store: dist.Store, keys: RunKeys, r: int) -> RoundClose:
    close = read_close(store, keys, r)
    assert close is not None, f"round {r} did not close"
    return close


def close_round(store: dist.Store, keys: RunKeys, r: int) -> None:
    """Round r closes as the job's closer writes it (its signed close, then the counts)."""
    store.set(keys.size(r), keys.sign(keys.size(r), RoundClose(2, "a", "t", "h", 1).to_value()))
    mark_closed(store, keys, r)


def test_a_heartbeat_only_counts_when_the_node_signed_a_higher_number() -> None:
    """Attack: a stranger keeps a dead node alive by adding to its heartbeat, writing numbers,
    writing another member's beat or the node's own old one back. None of that is a beat."""
    store, keys, beats = dist.HashStore(), job_keys(), mr.Beats()
    mr.beat(store, keys, "b")
    first = beats.reading(keys, "b", store.get(keys.heartbeat("b")))
    assert first > 0
    old = store.get(keys.heartbeat("b"))
    mr.beat(store, keys, "b")
    second = beats.reading(keys, "b", store.get(keys.heartbeat("b")))
    assert second > first
    mr.beat(store, keys, "a")
    forged: list[bytes | str | None] = [
        str(second + 1000),  # a number, unsigned
        old,  # the node's own earlier beat, written back
        store.get(keys.heartbeat("a")),  # another member's beat
        RecordSigner.for_job(secrets.token_hex(32).encode()).sign("run:hb/b", str(second + 5)),
        "not a number",
        None,  # deleted
    ]
    for value in forged:
        raw = value.encode() if isinstance(value, str) else value
        assert beats.reading(keys, "b", raw) == second, value
    assert keys.signer.refused >= 4
    # a beat of another job's run is no beat either
    assert beats.reading(keys, "b", job_keys("other").sign("other:hb/b", str(second + 9)).encode()) == second


def test_without_a_secret_heartbeats_are_plain_numbers() -> None:
    store, keys, beats = dist.HashStore(), RunKeys("run"), mr.Beats()
    mr.beat(store, keys, "b")
    assert beats.reading(keys, "b", store.get(keys.heartbeat("b"))) == int(store.get(keys.heartbeat("b")))


def test_slot_members_and_standby_records_a_stranger_wrote_are_ignored() -> None:
    """Attack: a stranger writes a round's member list (whom the deciders watch, whom the
    operator drops), a node's slot (so it claims a re-join of a round it never was in) and a
    standby's record. Each is read as absent; the job's own are read; a record copied to
    another round or member fails."""
    store, keys = dist.HashStore(), job_keys()
    store.set(keys.members(3), '["x", "y"]')
    store.set(keys.slot(3, "a"), "0")
    store.set(keys.standby("s"), '{"round": 4, "since": 0}')
    assert mr.read_members(store, keys, 3) is None
    assert mr.read_slot(store, keys, 3, "a") is None
    assert mr.read_standby(store, keys, "s") is None
    store.set(keys.members(3), mr.members_value(keys, 3, ["a", "b"]))
    store.set(keys.slot(3, "a"), mr.slot_value(keys, 3, "a", 1))
    store.set(keys.standby("s"), mr.standby_value(keys, "s", 4))
    assert mr.read_members(store, keys, 3) == ["a", "b"]
    assert mr.read_slot(store, keys, 3, "a") == 1
    assert (mr.read_standby(store, keys, "s") or {}).get("round") == 4
    store.set(keys.members(4), store.get(keys.members(3)))  # replayed in another round
    store.set(keys.slot(3, "b"), store.get(keys.slot(3, "a")))  # another member's
    store.set(keys.standby("t"), store.get(keys.standby("s")))
    assert mr.read_members(store, keys, 4) is None
    assert mr.read_slot(store, keys, 3, "b") is None
    assert mr.read_standby(store, keys, "t") is None
    # the operator's status, without the key, reads the text before the MAC
    assert mr.read_members(store, RunKeys("run"), 3) == ["a", "b"]


def test_a_forged_slot_makes_no_node_claim_a_re_join() -> None:
    store, keys = dist.HashStore(), job_keys()
    close_round(store, keys, 1)
    store.set(keys.slot(1, "c"), "0")  # c was never a member of round 1
    account_previous_round(store, keys, "c", 2)
    assert not store.check([keys.fate(1, "c")]), "a stranger's slot made c claim a fate in round 1"
    store.set(keys.slot(1, "c"), mr.slot_value(keys, 1, "c", 0))
    account_previous_round(store, keys, "c", 2)
    assert store.check([keys.fate(1, "c")])


@pytest.mark.parametrize("moved", [1, 5, 1 << 40, -1, -3])
def test_a_moved_open_counter_never_names_a_wrong_round(moved: int) -> None:
    """Attack: a stranger adds to (or takes from) ``open``: joiners would join a round after
    one that never closed (whose previous round's members are then never waited for), or a
    round long closed, and joiners waiting in a round would take it for superseded. The open
    round is the one after the latest signed close, whatever the counter says."""
    store, keys = dist.HashStore(), job_keys()
    assert open_round(store, keys) == 1
    for r in (1, 2, 3):
        close_round(store, keys, r)
    assert open_round(store, keys) == 4
    store.add(keys.open, moved)
    assert open_round(store, keys) == 4
    store.set(keys.size(5), RoundClose(2, "x", "t", "h", 1).to_value())  # a stranger's close
    assert open_round(store, keys) == 4
    store.delete_key(keys.latest)  # and the mark: found from the closes themselves
    assert open_round(store, keys) == 4
    close_round(store, keys, 4)
    assert open_round(store, keys) == 5


def test_a_close_whose_count_is_not_in_yet_is_found() -> None:
    store, keys = dist.HashStore(), job_keys()
    close_round(store, keys, 1)
    store.set(keys.size(2), keys.sign(keys.size(2), RoundClose(2, "a", "t", "h", 1).to_value()))
    assert open_round(store, keys) == 3  # the closer of round 2 has not counted it yet


def test_without_a_secret_the_open_round_is_the_counters() -> None:
    store, keys = dist.HashStore(), RunKeys("run")
    store.add(keys.open, 7)
    assert open_round(store, keys) == 8


def test_a_round_re_established_on_a_restarted_store_is_the_open_one_despite_a_moved_counter() -> None:
    store, keys = dist.HashStore(), job_keys()
    close = RoundClose(1, "a", "t", "h", 1)
    store.add(keys.open, 40)  # a stranger's count before any member came back
    assert restore_round(store, keys, 9, close, 0, '{"name": "a"}', ("a",))
    assert open_round(store, keys) == 10
    assert mr.read_members(store, keys, 9) == ["a"] and mr.read_slot(store, keys, 9, "a") == 0


def test_a_loss_in_a_round_re_established_without_the_lost_members_record_is_counted() -> None:
    """A store restarted while c died: a and b re-establish round 1, c's join record never
    comes back, and a claims c dead there. b's question "was a member lost?" is answered
    from the claim's signed name, not from join records that are not all there; a stranger's
    name in the index (unsigned) adds nothing and takes no claim's place."""
    store, keys = dist.HashStore(), job_keys()
    close = RoundClose(3, "c", "t", "h", 1)
    assert restore_round(store, keys, 1, close, 0, '{"name": "a"}')
    assert restore_round(store, keys, 1, close, 1, '{"name": "b"}')
    assert count_fates(store, keys, 1, 3) == (0, False)
    for i in range(3):  # a stranger's names (unsigned) where the claims' go
        store.set(keys.fated(1, i), "c")
    store.add(keys.accounted(1), 1)
    assert count_fates(store, keys, 1, 3) == (0, False)
    assert claim_fate(store, keys, 1, "c", Fate.DEAD, "a")
    assert count_fates(store, keys, 1, 3) == (1, True)


@pytest.mark.slow
def test_a_dead_successor_is_found_while_a_stranger_keeps_its_heartbeat_moving() -> None:
    """Attack: b's process is gone (it beat once); a stranger adds to b's heartbeat, writes
    ever higher numbers and b's own beat back, every 50 ms. a's keep-alive still marks b
    dead once its timeout passes (before, the moving value kept b alive: a lost machine,
    whose peer link never closes, would have held the job for ever)."""
    from kelastic.agent.rendezvous.keepalive import KeepAlive
    from kelastic.agent.rendezvous.rounds import Member
    from kelastic.agent.rendezvous.server import start_server_process
    from kelastic.agent.rendezvous.settings import RendezvousSettings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys = job_keys("hb")
    settings = RendezvousSettings(
        "hb", "127.0.0.1", port, "a", None, 2, 2, keep_alive_interval=0.1, keep_alive_max_attempt=20
    )  # a heartbeat timeout of 2 s
    member = Member(round=1, rank=0, size=2, successor="b")
    stop = threading.Event()
    keep = KeepAlive(settings, keys, threading.RLock(), lambda: (member, None, member), stop)
    server = start_server_process("127.0.0.1", port)
    try:
        client = connect_store("127.0.0.1", port, 5)
        mr.beat(client, keys, "b")
        own = client.get(keys.heartbeat("b"))
        thread = threading.Thread(target=keep.run, args=(client, lambda: True), daemon=True)
        thread.start()
        stranger = connect_store("127.0.0.1", port, 5)
        deadline, n = time.monotonic() + 30, 0
        while not stranger.check([keys.fate(1, "b")]):
            assert time.monotonic() < deadline, "a stranger's heartbeats kept a dead node alive"
            n += 1
            if n % 3 == 0:
                stranger.set(keys.heartbeat("b"), str(n))
            elif n % 3 == 1:
                stranger.set(keys.heartbeat("b"), own)
            else:
                stranger.add(keys.heartbeat("b"), 1)
            time.sleep(0.05)
        fate = keys.verify(keys.fate(1, "b"), stranger.get(keys.fate(1, "b")))
        assert fate is not None and fate.startswith(b"dead"), fate
    finally:
        stop.set()
        keep.poke.set()
        server.stop()


@pytest.mark.slow  # waits out the wait for a missing join record (10 s)
def test_a_count_of_joiners_a_stranger_added_to_costs_one_round_not_the_rendezvous(
    server: ServerProcess, run_id: str
) -> None:
    """Attack: a stranger adds 1 to the open round's count of joiners before the nodes join.
    The nodes take slots 1 and 2; slot 0 is nobody's. The round closes empty once its record
    is found missing, and the two form the next round (before, the round closed with slot 0
    as a member that never came: the rendezvous hung)."""
    from kelastic.agent.rendezvous.testing import kelastic_handler, rendezvous_concurrently

    keys = job_keys_of(run_id)
    stranger = connect_store(server.host, server.port, 5)
    stranger.add(keys.joined(1), 1)
    handlers = [
        kelastic_handler(server.endpoint, run_id, f"n{i}", 2, 2, last_call_timeout=0.3, join_timeout=60)
        for i in range(2)
    ]
    infos = rendezvous_concurrently(handlers, timeout=90)
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert read_close_of(stranger, keys, 1).size == 0  # the round the stranger's count spoiled
    assert read_close_of(stranger, keys, 2).size == 2


@pytest.mark.slow  # waits out the wait for a record the job signed (10 s)
def test_a_record_a_stranger_writes_in_the_slot_it_added_is_no_member(
    server: ServerProcess, run_id: str
) -> None:
    """Attack: a stranger adds 1 to the open round's count of joiners and writes a join record
    of its own in slot 0 it so takes (as rank 0, naming its own worker store). The round
    closes empty once that record is found unsigned, and the two nodes form the next round
    without it (before, the round closed with the stranger as rank 0 and its members exited,
    taking its record for an agent's with another secret)."""
    from kelastic.agent.rendezvous.testing import kelastic_handler, rendezvous_concurrently

    keys = job_keys_of(run_id)
    stranger = connect_store(server.host, server.port, 5)
    assert stranger.add(keys.joined(1), 1) == 1
    stranger.set(keys.node(1, 0), '{"name": "stranger", "addr": "127.0.0.1", "link": 9, "wstore": 9}')
    assert stranger.check([keys.node(1, 0)])  # stored before the nodes join
    handlers = [
        kelastic_handler(server.endpoint, run_id, f"n{i}", 2, 2, last_call_timeout=0.3, join_timeout=60)
        for i in range(2)
    ]
    infos = rendezvous_concurrently(handlers, timeout=90)
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert read_close_of(stranger, keys, 1).size == 0  # the round the stranger's record spoiled
    assert read_close_of(stranger, keys, 2).size == 2
    assert {i.bootstrap_store_info.master_port for i in infos} != {9}
    assert sum(h._keys.signer.refused for h in handlers) >= 1


def test_a_successors_record_a_stranger_overwrites_after_the_close_costs_the_peer_link_only(
    server: ServerProcess, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: right after a round closed, a stranger overwrites (or deletes) the join records
    its members read next. A member reads its successor's name from the round's signed member
    list instead and watches it by its heartbeat, rather than failing its rendezvous (before,
    the agent exited); rank 0's record, where the close does not name its worker store, is
    still required: without it the member cannot start its workers."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    from kelastic.agent.rendezvous import rounds
    from kelastic.agent.rendezvous.memberrecords import members_value

    monkeypatch.setattr(rounds, "PEER_KEY_WAIT", 0.5)
    keys = job_keys(run_id)
    store = connect_store(server.host, server.port, 5)
    close_round(store, keys, 1)
    store.set(keys.members(1), members_value(keys, 1, ["a", "b", "c"]))
    for slot, name in enumerate("abc"):
        store.set(keys.node(1, slot), keys.sign(keys.node(1, slot), f'{{"name": "{name}", "addr": "h"}}'))
    # A set has no reply: a request that has one makes sure the store took the job's records
    # before the stranger's writes, which come on another connection.
    assert store.check([keys.node(1, 2)])
    stranger = connect_store(server.host, server.port, 5)
    stranger.set(keys.node(1, 1), '{"name": "stranger", "addr": "127.0.0.1", "link": 9}')
    stranger.delete_key(keys.node(1, 2))
    deadline = time.monotonic() + 30
    got = rounds.read_records(store, keys, run_id, 1, [0, 1, 2], deadline)
    assert list(got) == [0] and got[0]["name"] == "a", got
    assert rounds.successor_from_members(store, keys, 1, 1) == "b"
    with pytest.raises(RendezvousTimeoutError, match="not signed"):
        rounds.read_records(store, keys, run_id, 1, [1], deadline, required=frozenset({1}))
    stranger.set(keys.members(1), '["stranger", "x", "y"]')
    assert stranger.check([keys.members(1)])  # the store took the stranger's list (as above)
    assert rounds.successor_from_members(store, keys, 1, 1) is None


def test_a_count_of_joiners_a_stranger_added_to_makes_no_running_group_re_form(
    server: ServerProcess, run_id: str
) -> None:
    """Attack: a group of two below its maximum (3) runs; a stranger adds 1 to the coming
    round's count of joiners and pushes an event to wake its members. Nobody's join record is
    there: the group does not re-form (before, a count above 0 alone made it). The control: a
    node of the job then joins, in the slot after the stranger's, and the group learns at
    once that it waits (the join event comes from the first joiner whose slot 0 is empty)."""
    from kelastic.agent.rendezvous.testing import in_thread, kelastic_handler, rendezvous_concurrently

    handlers = [
        kelastic_handler(server.endpoint, run_id, f"n{i}", 2, 3, last_call_timeout=0.3, join_timeout=30)
        for i in range(2)
    ]
    infos = rendezvous_concurrently(handlers)
    assert {i.world_size for i in infos} == {2}
    stranger, keys = connect_store(server.host, server.port, 5), RunKeys(run_id)
    assert stranger.add(keys.joined(2), 1) == 1
    push_event(stranger, keys, "join 2")  # unsigned: it only wakes the watchers
    assert not handlers[0].wait_membership_change(1.0), "a stranger's count made the group re-form"
    assert not handlers[1].membership_changed()
    assert handlers[0].num_nodes_waiting() == 0
    joiner = kelastic_handler(server.endpoint, run_id, "n2", 2, 3, last_call_timeout=0.3, join_timeout=30)
    in_thread(joiner.next_rendezvous)
    assert handlers[0].wait_membership_change(10), "a node of the job joined, unseen by the group"
    assert handlers[1].wait_membership_change(10)
    assert handlers[0].num_nodes_waiting() >= 1

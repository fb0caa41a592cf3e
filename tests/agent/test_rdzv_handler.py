"""The kelastic rendezvous handler against a real ``kelastic-rendezvous`` store process."""

from __future__ import annotations

import datetime
import json
import re
import socket
import threading
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
)

from kelastic.agent.rendezvous import (
    KelasticRendezvousHandler,
    ServerProcess,
    get_rendezvous_handler,
)
from kelastic.agent.rendezvous.protocol import RoundClose, RunKeys, close_event, parse_close_event, push_event
from kelastic.agent.rendezvous.records import MARK
from kelastic.agent.rendezvous.testing import in_thread, job_keys, kelastic_handler, rendezvous_concurrently
from kelastic.localcluster.testing import wait_for


def make_handler(
    endpoint: str, name: str, min_nodes: int, max_nodes: int, run_id: str = "job", **conf: Any
) -> KelasticRendezvousHandler:
    conf.setdefault("last_call_timeout", 0.3)
    conf.setdefault("join_timeout", 20)
    return kelastic_handler(endpoint, run_id, name, min_nodes, max_nodes, **conf)


@pytest.fixture
def handlers() -> list[KelasticRendezvousHandler]:
    return []


def test_nodes_form_a_round_with_distinct_ranks(server: ServerProcess, handlers: list, run_id: str) -> None:
    handlers += [make_handler(server.endpoint, f"n{i}", 3, 3, run_id=run_id) for i in range(3)]
    infos = rendezvous_concurrently(handlers)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boot) == 1
    assert handlers[0].use_agent_store and handlers[0].get_backend() == "kelastic"
    assert handlers[0].get_run_id() == run_id
    assert not any(h.membership_changed() for h in handlers)
    assert all(h.num_nodes_waiting() == 0 for h in handlers)
    # The store each agent gets is shared by the round's members.
    infos[0].store.set("x", "1")
    assert infos[1].store.get("x") == b"1"


def test_late_joiner_waits_then_everyone_forms_a_larger_round(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    handlers += [make_handler(server.endpoint, f"n{i}", 2, 4, run_id=run_id) for i in range(2)]
    first = rendezvous_concurrently(handlers)
    assert {i.world_size for i in first} == {2}
    late = make_handler(server.endpoint, "late", 2, 4, run_id=run_id)
    handlers.append(late)
    thread, out = in_thread(late.next_rendezvous)
    assert handlers[0].wait_membership_change(10), "running members never saw the waiting node"
    assert handlers[1].num_nodes_waiting() >= 1
    started = time.monotonic()
    again = rendezvous_concurrently(handlers[:2])
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo)
    infos = [*again, out[0]]
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    # Every old member came back, so the round closed without any timer.
    assert time.monotonic() - started < 2.0


def test_graceful_leave_makes_survivors_reform_at_once(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    handlers += [make_handler(server.endpoint, f"n{i}", 1, 3, run_id=run_id) for i in range(3)]
    rendezvous_concurrently(handlers)
    leaver = handlers.pop()
    assert leaver.shutdown()
    with pytest.raises(RendezvousClosedError, match="shut down"):
        leaver.next_rendezvous()
    assert handlers[0].wait_membership_change(5)
    started = time.monotonic()
    infos = rendezvous_concurrently(handlers)
    assert {i.world_size for i in infos} == {2}
    assert time.monotonic() - started < 2.0


def test_after_a_rejoin_the_round_left_tells_whether_it_lost_a_member(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    """What settles a restart an agent spent before knowing its cause (a crash: every
    member re-joins; a leave: one member is gone)."""
    # The rounds close at max_nodes or, after the leave, once every remaining member re-joined:
    # the last call only has to outlast a busy machine's delay between the joins (at 0.3 s,
    # and at times at 5 s, two nodes closed the first round, and the third waited in the next).
    conf = {"last_call_timeout": 30.0, "join_timeout": 60}
    handlers += [make_handler(server.endpoint, f"n{i}", 1, 3, run_id=run_id, **conf) for i in range(3)]
    assert handlers[0].wait_previous_round_lost(0.1) is False, "no round before the first"
    rendezvous_concurrently(handlers)
    rendezvous_concurrently(handlers)  # all three re-joined: no loss
    assert all(h.wait_previous_round_lost(2) is False for h in handlers)
    leaver = handlers.pop()
    assert leaver.shutdown()
    infos = rendezvous_concurrently(handlers)
    assert {i.world_size for i in infos} == {2}
    started = time.monotonic()
    assert all(h.wait_previous_round_lost(5) is True for h in handlers)
    assert time.monotonic() - started < 1.0, "known from the store, not a time-out"


def test_spare_node_waits_while_round_is_full(server: ServerProcess, handlers: list, run_id: str) -> None:
    # Every round here closes at max_nodes, at once; the last call only has to outlast a
    # busy machine's delay between the first two joins (at 0.3 s one node at times closed
    # the first round alone, and the other waited alone in the next).
    conf = {"last_call_timeout": 30.0, "join_timeout": 60}
    handlers += [make_handler(server.endpoint, f"n{i}", 1, 2, run_id=run_id, **conf) for i in range(2)]
    assert {i.world_size for i in rendezvous_concurrently(handlers)} == {2}
    spare = make_handler(server.endpoint, "spare", 1, 2, run_id=run_id, **conf)
    handlers.append(spare)
    thread, out = in_thread(spare.next_rendezvous)
    # A full round is not disturbed by a spare node, which parks behind it (waited for: a
    # spare still on its way when the member leaves comes too late for the round that
    # replaces the member, which the survivor then closes alone).
    wait_for(lambda: spare._joiner.parked is not None, timeout=20, what="the spare parked")
    assert not handlers[0].wait_membership_change(1.0)
    assert handlers[0].num_nodes_waiting() == 0
    assert not out
    # When a member leaves, the spare takes its place.
    handlers[1].shutdown()
    assert handlers[0].wait_membership_change(5)
    (info,) = rendezvous_concurrently(handlers[:1])
    thread.join(10)
    assert isinstance(out[0], RendezvousInfo)
    assert info.world_size == 2 and out[0].world_size == 2


def test_a_join_ends_when_its_handler_is_shut_down_from_another_thread(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    """A node waiting for peers that never come stops joining once its handler is shut down:
    it neither polls the store until its join_timeout nor becomes a member afterwards."""
    handlers.append(make_handler(server.endpoint, "alone", 2, 2, run_id=run_id, join_timeout=600))
    waiting, out = in_thread(handlers[0].next_rendezvous)

    def joined() -> bool:
        timings = handlers[0].last_timings
        return timings is not None and timings.joined is not None

    wait_for(joined, 30, "the node joined its round")
    assert handlers[0].shutdown()
    waiting.join(30)
    assert not waiting.is_alive(), "next_rendezvous went on after the handler was shut down"
    assert isinstance(out[0], RendezvousClosedError) and "was shut down" in str(out[0]), out


def test_closed_rendezvous_rejects_joins_and_wakes_waiters(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    handlers += [make_handler(server.endpoint, f"n{i}", 2, 2, run_id=run_id) for i in range(2)]
    waiting, out = in_thread(handlers[0].next_rendezvous)
    time.sleep(0.3)
    assert not handlers[1].is_closed()
    handlers[1].set_closed()
    waiting.join(5)
    assert not waiting.is_alive() and isinstance(out[0], RendezvousClosedError)
    assert handlers[0].is_closed()
    with pytest.raises(RendezvousClosedError):
        make_handler(server.endpoint, "n9", 1, 2, run_id=run_id).next_rendezvous()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_unreachable_store_names_the_endpoint(handlers: list) -> None:
    port = free_port()
    handler = make_handler(f"127.0.0.1:{port}", "lonely", 1, 1, join_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=re.escape(f"127.0.0.1:{port}")):
        handler.next_rendezvous()
    assert time.monotonic() - started < 6


def test_bad_conf_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="keep_alive_interval"):
        make_handler("127.0.0.1:1", "x", 1, 1, keep_alive_interval="soon")
    with pytest.raises(ValueError, match="port"):
        make_handler("127.0.0.1:http", "x", 1, 1)
    with pytest.raises(ValueError, match="rdzv-id"):
        make_handler("127.0.0.1:1", "x", 1, 1, run_id="")


def test_torch_backends_still_resolve(server: ServerProcess) -> None:
    ours = get_rendezvous_handler(RendezvousParameters("kelastic", server.endpoint, "cmp", 1, 1))
    assert isinstance(ours, KelasticRendezvousHandler)
    c10d = get_rendezvous_handler(
        RendezvousParameters("c10d", server.endpoint, "cmp", 1, 1, is_host=False, join_timeout=10)
    )
    assert c10d.get_backend() == "c10d"
    info = c10d.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    c10d.shutdown()
    port = free_port()
    static = get_rendezvous_handler(
        RendezvousParameters("static", f"127.0.0.1:{port}", "cmp", 1, 1, rank=0, timeout=10)
    )
    assert static.get_backend() == "static"
    info = static.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)


def _raw_store(endpoint: str) -> Any:
    from kelastic.agent.rendezvous import control

    return control.connect(endpoint)


def test_close_event_carries_the_size_and_the_worker_store(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    handlers += [make_handler(server.endpoint, f"n{i}", 3, 3, run_id=run_id) for i in range(3)]
    infos = rendezvous_concurrently(handlers)
    store, keys = _raw_store(server.endpoint), RunKeys(run_id)
    events = [store.get(keys.event(n)) for n in range(1, int(store.add(keys.events, 0)) + 1)]
    # Each event is signed: its text, then the MAC (kelastic.agent.rendezvous.records).
    closes = [c for c in (parse_close_event(e.split(MARK)[0]) for e in events) if c is not None]
    assert len(closes) == 1, events
    r, close = closes[0]
    boot = infos[0].bootstrap_store_info
    assert (r, close.size, close.master_addr, close.master_port) == (1, 3, boot.master_addr, boot.master_port)
    assert RoundClose.from_value(store.get(keys.size(1)).split(MARK)[0]) == close  # signed too


def test_a_waiter_learns_the_round_from_the_close_event_alone(
    server: ServerProcess, handlers: list, run_id: str
) -> None:
    """A woken non-decider takes size and worker store from the event: no read of r/R/size.

    The event is pushed by hand without setting the size key, so a waiter that
    re-read the store when woken would never see the round closed (it would time out).
    """
    store, keys = _raw_store(server.endpoint), job_keys(run_id)
    # Three nodes hold slots 0-2 (the deciders) and wrote their records.
    store.add(keys.joined(1), 3)
    for slot in range(3):
        record = json.dumps({"name": f"d{slot}", "addr": "127.0.0.1", "link": None})
        store.set(keys.node(1, slot), keys.sign(keys.node(1, slot), record))
    waiter = make_handler(server.endpoint, "w", 5, 5, run_id=run_id, join_timeout=30)
    handlers.append(waiter)
    thread, out = in_thread(waiter.next_rendezvous)
    wait_for(lambda: store.check([keys.node(1, 3)]), timeout=20, what="the waiter's join record")
    push_event(store, keys, close_event(1, RoundClose(4, "d0", "t", "127.0.0.9", 4321)))
    thread.join(20.0)
    assert not thread.is_alive(), "the close event did not end the waiter's wait"
    info = out[0]
    assert isinstance(info, RendezvousInfo), info
    assert (info.rank, info.world_size) == (3, 4)
    boot = info.bootstrap_store_info
    assert (boot.master_addr, boot.master_port) == ("127.0.0.9", 4321)
    assert not store.check([keys.size(1)])


def test_store_fact_a_compare_and_set_that_writes_nothing_wakes_no_waiter(
    server: ServerProcess, run_id: str
) -> None:
    """``get_or_none`` (a compare-and-set that writes nothing) leaves a key's waiters waiting.

    torch's own libuv store wakes them on every compare-and-set, even one that wrote nothing
    (the woken client's read then finds no value), so kelastic never uses ``get_or_none`` on a
    key somebody may wait for; ``kelastic-rendezvous`` wakes a waiter only when its keys exist.
    """
    from kelastic.agent.rendezvous.protocol import get_or_none

    store, other = _raw_store(server.endpoint), _raw_store(server.endpoint)
    key = RunKeys(run_id).node(1, 0)
    thread, out = in_thread(lambda: other.wait([key], datetime.timedelta(seconds=60)))
    for _ in range(20):
        assert get_or_none(store, key) is None
    assert thread.is_alive() and not store.check([key])
    store.set(key, "x")
    thread.join(30)
    assert not thread.is_alive() and out == [None], out


def test_the_completing_joiner_waits_for_records_still_on_the_way(server: ServerProcess, run_id: str) -> None:
    """The one O(N) check of a controlled round (by the joiner that completed the count) waits.

    Without the wait it would see a record missing, answer False, and the round
    would close only at the controller timer.
    """
    from kelastic.agent.rendezvous.protocol import listed_all_joined

    store, keys = _raw_store(server.endpoint), RunKeys(run_id)
    store.set(keys.node(1, 0), json.dumps({"name": "a"}))
    assert not listed_all_joined(store, keys, 1, 2, ["a", "b"])
    timer = threading.Timer(
        0.5, lambda: _raw_store(server.endpoint).set(keys.node(1, 1), json.dumps({"name": "b"}))
    )
    timer.start()
    try:
        assert listed_all_joined(store, keys, 1, 2, ["a", "b"], wait=20.0)
    finally:
        timer.cancel()
    assert not listed_all_joined(store, keys, 1, 3, ["a", "b", "c"], wait=0.2)

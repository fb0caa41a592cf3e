"""Failures the rendezvous must survive, with real processes: a killed node, a restarted
store, and workers that form a gloo group through the round's worker store."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from kelastic.agent.rendezvous import (
    READY_PREFIX,
    KelasticRendezvousHandler,
    ServerProcess,
    control,
    protocol,
    start_server_process,
)
from kelastic.agent.rendezvous.protocol import RunKeys, read_counter
from kelastic.agent.rendezvous.testing import (
    in_thread,
    job_keys,
    kelastic_handler,
    rendezvous_concurrently,
    shutdown_handlers,
)

_procs: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    while _procs:
        proc = _procs.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node(
    endpoint: str, run_id: str, name: str, min_nodes: int, max_nodes: int, **conf: Any
) -> KelasticRendezvousHandler:
    conf.setdefault("join_timeout", 30)
    return kelastic_handler(endpoint, run_id, name, min_nodes, max_nodes, **conf)


def spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})},
        start_new_session=True,
    )
    _procs.append(proc)
    return proc


NODE = """
    import sys, time
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from kelastic.agent.rendezvous import get_rendezvous_handler
    endpoint, run_id, name, lo, hi = sys.argv[1:6]
    handler = get_rendezvous_handler(RendezvousParameters(
        "kelastic", endpoint, run_id, int(lo), int(hi), local_addr="127.0.0.1", node_name=name,
        last_call_timeout=30, join_timeout=60))
    info = handler.next_rendezvous()
    print(f"rank {info.rank} world {info.world_size}", flush=True)
    time.sleep(120)
"""


def with_a_victim(
    endpoint: str, run: str, lo: int, hi: int
) -> tuple[subprocess.Popen[str], list[KelasticRendezvousHandler], list[Any]]:
    """A round of nodes a and b (handlers here) and "victim" (a process of its own, to kill)."""
    victim = spawn(NODE, endpoint, run, "victim", str(lo), str(hi))
    hs = [node(endpoint, run, n, lo, hi, last_call_timeout=30) for n in ("a", "b")]
    infos = rendezvous_concurrently(hs, timeout=60)
    assert victim.stdout is not None and victim.stdout.readline().startswith("rank ")
    return victim, hs, infos


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [
        # The process is gone: its peer link closes and the watcher knows at once.
        signal.SIGKILL,
        # Frozen (like a hung machine): sockets stay open, only the heartbeat stops.
        signal.SIGSTOP,
    ],
    ids=["killed", "frozen"],
)
def test_lost_node_is_detected_and_survivors_reform(how: signal.Signals) -> None:
    server = start_server_process("127.0.0.1", 0)
    try:
        run = f"lost-{how.name}"
        victim = spawn(NODE, server.endpoint, run, "victim", "2", "3")
        survivors = [node(server.endpoint, run, n, 2, 3, last_call_timeout=30) for n in ("a", "b")]
        infos = rendezvous_concurrently(survivors, timeout=60)
        assert {i.world_size for i in infos} == {3}
        assert victim.stdout is not None
        assert victim.stdout.readline().startswith("rank ")
        assert not any(h.membership_changed() for h in survivors)
        os.killpg(victim.pid, how)
        lost = time.monotonic()
        # Noticed by the sweep after 5 s without heartbeats (at once when killed); the bound
        # leaves a loaded machine its scheduling delays and stays well under last_call_timeout,
        # the wait a node that goes unnoticed would end on. The time itself is printed.
        assert all(h.wait_membership_change(15.0) for h in survivors), "the lost node went unnoticed"
        print(f"{how.name}: lost node noticed after {time.monotonic() - lost:.2f}s")
        infos = rendezvous_concurrently(survivors, timeout=20)
        assert {i.world_size for i in infos} == {2}
        assert sorted(i.rank for i in infos) == [0, 1]
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_two_nodes_dying_together_are_both_found() -> None:
    """If a node dies together with the one that watches it, the sweep of the
    previous round's heartbeats finds it; the survivors do not wait for a timer."""
    server = start_server_process("127.0.0.1", 0)
    try:
        victims = [spawn(NODE, server.endpoint, "pair", f"victim{i}", "2", "4") for i in range(2)]
        # The victims take slots 0 and 1: slot 0 watches slot 1, so when both die
        # nobody's peer link reports slot 1.
        store, joined = control.connect(server.endpoint), RunKeys("pair").joined(1)
        deadline = time.monotonic() + 60
        while read_counter(store, joined) < 2:
            assert time.monotonic() < deadline, "the victims never joined"
            time.sleep(0.1)
        conf = dict(last_call_timeout=30, rejoin_timeout=30)
        survivors = [node(server.endpoint, "pair", n, 2, 4, **conf) for n in ("a", "b")]
        infos = rendezvous_concurrently(survivors, timeout=60)
        assert {i.world_size for i in infos} == {4}
        for victim in victims:
            assert victim.stdout is not None and victim.stdout.readline().startswith("rank ")
        for victim in victims:
            os.killpg(victim.pid, signal.SIGKILL)
        lost = time.monotonic()
        assert all(h.wait_membership_change(6.0) for h in survivors)
        infos = rendezvous_concurrently(survivors, timeout=25)
        took = time.monotonic() - lost
        assert {i.world_size for i in infos} == {2}
        print(f"two lost nodes: survivors re-formed after {took:.2f}s")
        assert took < 20, f"re-forming took {took:.1f}s: the survivors waited for rejoin_timeout"
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("controlled", [False, True], ids=["plain", "controller"])
def test_a_standby_takes_a_killed_members_place_in_one_reform(controlled: bool) -> None:
    """A node that found the group full waits without a slot; the SIGKILLed member's
    place is its in the round the survivors re-form: one re-form, at the old size."""
    server = start_server_process("127.0.0.1", 0)
    run = f"standby-{'controller' if controlled else 'plain'}"
    keys = RunKeys(run)
    try:
        store = control.connect(server.endpoint)
        if controlled:
            names = ["a", "b", "victim", "spare"]
            control.publish_membership(store, run, nodes=names, min_nodes=2, max_nodes=3)
        victim, members, infos = with_a_victim(server.endpoint, run, 2, 3)
        assert {i.world_size for i in infos} == {3}
        spare = node(server.endpoint, run, "spare", 2, 3)
        thread, out = in_thread(spare.next_rendezvous)
        deadline = time.monotonic() + 30
        while not store.check([keys.standby("spare")]):
            assert time.monotonic() < deadline, "the spare never parked"
            time.sleep(0.05)
        assert read_counter(store, keys.open) == 1 and read_counter(store, keys.joined(2)) == 0
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert all(m.wait_membership_change(10) for m in members)
        again = rendezvous_concurrently(members, timeout=30)
        thread.join(30)
        took = time.monotonic() - killed
        assert not isinstance(out[0], BaseException), out
        assert {i.world_size for i in [*again, out[0]]} == {3}
        assert sorted(i.rank for i in [*again, out[0]]) == [0, 1, 2]
        # One re-form: round 2 is the last closed round; its members, the survivors and the spare.
        time.sleep(0.5)
        assert read_counter(store, keys.open) == 2
        status = control.read_status(store, run)
        assert status.round == 2 and sorted(status.members) == ["a", "b", "spare"]
        print(f"standby: round 2 closed with the spare {took:.2f}s after SIGKILL")
    finally:
        shutdown_handlers()
        server.stop()


LOOPING_NODE = """
    import sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from kelastic.agent.rendezvous import get_rendezvous_handler
    endpoint, run_id, name, lo, hi = sys.argv[1:6]
    handler = get_rendezvous_handler(RendezvousParameters(
        "kelastic", endpoint, run_id, int(lo), int(hi), local_addr="127.0.0.1", node_name=name,
        last_call_timeout=30, join_timeout=60))
    while True:
        info = handler.next_rendezvous()
        print(f"rank {info.rank} world {info.world_size}", flush=True)
        while not handler.wait_membership_change(1.0):
            pass
"""


@pytest.mark.slow
def test_a_restarted_member_parked_behind_the_group_the_standby_completed_takes_the_next_place() -> None:
    """Two faults in a row, as a job lives them: a member leaves and the standby takes its
    place; the member comes back and parks (the group is full); then another member is
    SIGKILLed. The parked node takes that place in the survivors' very re-form: one round
    per fault, never a round without it followed by a second re-form."""
    server = start_server_process("127.0.0.1", 0)
    run, keys = "two-faults", RunKeys("two-faults")
    try:
        store = control.connect(server.endpoint)
        victim = spawn(LOOPING_NODE, server.endpoint, run, "victim", "2", "3")
        a, b = (node(server.endpoint, run, n, 2, 3, last_call_timeout=30) for n in ("a", "b"))
        rendezvous_concurrently([a, b], timeout=60)
        assert victim.stdout is not None and victim.stdout.readline().startswith("rank ")
        spare = node(server.endpoint, run, "spare", 2, 3, standby=True)
        spare_thread, spare_out = in_thread(spare.next_rendezvous)
        wait_for(lambda: store.check([keys.standby("spare")]), "the standby to park")
        b.shutdown()  # the first fault: a member leaves (its pod deleted)
        assert a.wait_membership_change(10)
        rendezvous_concurrently([a], timeout=30)
        spare_thread.join(30)
        assert [i.world_size for i in spare_out] == [3], spare_out
        assert victim.stdout.readline().startswith("rank ")
        first = control.read_status(store, run)
        assert (first.round, sorted(first.members)) == (2, ["a", "spare", "victim"])
        back = node(server.endpoint, run, "b", 2, 3)  # its pod again, with the group full
        back_thread, back_out = in_thread(back.next_rendezvous)
        wait_for(lambda: read_counter(store, keys.parked(3)) == 1, "the restarted member to park")
        os.killpg(victim.pid, signal.SIGKILL)  # the second fault
        killed = time.monotonic()
        # The survivors re-join at once, as agents whose workers failed with the victim's do:
        # before anyone found the victim dead.
        again = rendezvous_concurrently([a, spare], timeout=30)
        back_thread.join(30)
        took = time.monotonic() - killed
        assert not isinstance(back_out[0], BaseException), back_out
        assert {i.world_size for i in [*again, back_out[0]]} == {3}
        time.sleep(0.5)
        status = control.read_status(store, run)
        assert (read_counter(store, keys.open), status.round) == (3, 3), "a second re-form followed"
        assert sorted(status.members) == ["a", "b", "spare"]
        print(f"two faults: round 3 closed with the parked member {took:.2f}s after SIGKILL")
    finally:
        shutdown_handlers()
        server.stop()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_node_found_dead_while_it_ran_reconnects_before_it_rejoins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node the others marked dead while its process lived was cut off: its connections
    to the store may be stuck in TCP's retransmission back-off, so it opens fresh ones
    (and fresh watcher and keep-alive threads) before it joins again, and the round it
    joins closes as usual."""
    server = start_server_process("127.0.0.1", free_port())
    try:
        hs = [node(server.endpoint, "cut", n, 2, 2) for n in ("a", "b")]
        rendezvous_concurrently(hs)
        # What a's heartbeat watch claims for a partitioned b.
        assert protocol.claim_fate(
            control.connect(server.endpoint), job_keys("cut"), 1, "b", protocol.Fate.DEAD, "a"
        )
        assert all(h.wait_membership_change(5.0) for h in hs)
        with caplog.at_level(logging.WARNING, logger="kelastic.agent.rendezvous.handler"):
            infos = rendezvous_concurrently(hs, timeout=30)
        assert {i.world_size for i in infos} == {2}
        renewed = [
            r.getMessage() for r in caplog.records if "reconnecting before it joins again" in r.getMessage()
        ]
        assert len(renewed) == 1 and renewed[0].startswith("kelastic rendezvous: b was found dead in round 1")
        # The fresh watcher sees the next change: a leaves, b learns it at once.
        hs[0].shutdown()
        assert hs[1].wait_membership_change(5.0)
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_store_restart_keeps_the_round_and_its_members() -> None:
    """A restarted store is no membership change: the members keep their round (same
    number, members and ranks) and re-establish it there, and a node joining later
    finds it (the members then re-form with it, as in any scale-up)."""
    port = free_port()
    server = start_server_process("127.0.0.1", port)
    try:
        hs = [node(server.endpoint, "restart", n, 3, 4, last_call_timeout=0.5) for n in ("a", "b", "c")]
        infos = rendezvous_concurrently(hs)
        ranks = {h.node_name: i.rank for h, i in zip(hs, infos, strict=True)}
        before = control.read_status(control.connect(server.endpoint), "restart")
        server.stop()
        assert not any(h.wait_membership_change(2.0) for h in hs), "a lost store was taken for a change"
        server = start_server_process("127.0.0.1", port)
        client = control.connect(server.endpoint)
        deadline = time.monotonic() + 30
        while (status := control.read_status(client, "restart")).members != before.members:
            assert time.monotonic() < deadline, f"round not re-established: {status}"
            assert not any(h.membership_changed() for h in hs)
            time.sleep(0.2)
        assert status.round == before.round == 1 and status.world_size == 3
        assert [ranks[m] for m in status.members] == [0, 1, 2]
        assert not any(h.membership_changed() for h in hs)
        # The worker store rank 0 hosts is named in the re-established close.
        close = protocol.read_close(client, job_keys("restart"), 1)  # as the agents sign it
        assert close is not None and close.master_port == infos[0].bootstrap_store_info.master_port
        newcomer = node(server.endpoint, "restart", "d", 3, 4)
        got: list[Any] = []
        joined = threading.Thread(target=lambda: got.append(newcomer.next_rendezvous()), daemon=True)
        joined.start()
        assert all(h.wait_membership_change(15.0) for h in hs), "the newcomer went unnoticed"
        infos = rendezvous_concurrently(hs, timeout=30)
        joined.join(30)
        assert {i.world_size for i in [*infos, *got]} == {4} and len(got) == 1
        assert control.read_status(client, "restart").round == 2
    finally:
        shutdown_handlers()
        server.stop()


def barrier_in_threads(
    hs: list[KelasticRendezvousHandler], timeout: float
) -> tuple[dict[str, bool], list[threading.Thread]]:
    """Each handler enters the exit barrier in a thread of its own; what each got, by node name."""
    passed: dict[str, bool] = {}
    threads = [
        threading.Thread(
            target=lambda h=h: passed.update({h.node_name: h.wait_all_finished(timeout)}), daemon=True
        )
        for h in hs
    ]
    for t in threads:
        t.start()
    return passed, threads


@pytest.mark.slow
def test_the_exit_barrier_rides_out_a_store_restart() -> None:
    """Members that finished before the store restarted are still counted after it: each
    marks itself on every connection it has, and nobody passes the barrier (and leaves,
    which would stop a peer's last steps) before the last member finished."""
    port = free_port()
    server = start_server_process("127.0.0.1", port)
    try:
        hs = [node(server.endpoint, "finish", n, 3, 3) for n in ("a", "b", "c")]
        rendezvous_concurrently(hs)
        passed, early = barrier_in_threads(hs[:2], 60)
        time.sleep(0.5)
        assert not passed, "the barrier let members through before the last one finished"
        server.stop()
        time.sleep(1.0)
        server = start_server_process("127.0.0.1", port)
        time.sleep(1.0)
        assert not passed, "the barrier let members through before the last one finished"
        started = time.monotonic()
        assert hs[2].wait_all_finished(30), "the last member did not pass the barrier"
        for t in early:
            t.join(10)
        assert passed == {"a": True, "b": True}
        assert time.monotonic() - started < 10
        # All three marks are on the new store.
        client = control.connect(server.endpoint)
        assert client.check([RunKeys("finish").finished(1, r) for r in range(3)])
        assert hs[0].wait_all_finished(0.5), "asked again once all are marked, it passes at once"
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_the_exit_barrier_ends_when_a_member_that_had_not_finished_is_lost() -> None:
    """A member killed before it finished will never mark itself: the others leave the
    barrier as soon as its loss is known, not at the barrier's timeout."""
    port = free_port()
    server = start_server_process("127.0.0.1", port)
    try:
        victim, hs, _ = with_a_victim(server.endpoint, "finish-lost", 3, 3)
        passed, waiting = barrier_in_threads(hs, 120)
        time.sleep(0.5)
        assert not passed
        started = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        for t in waiting:
            t.join(30)
        assert passed == {"a": False, "b": False}
        assert time.monotonic() - started < 15, "the barrier waited for its timeout"
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_the_exit_barrier_times_out_when_a_member_never_finishes() -> None:
    port = free_port()
    server = start_server_process("127.0.0.1", port)
    try:
        hs = [node(server.endpoint, "unfinished", n, 2, 2) for n in ("a", "b")]
        rendezvous_concurrently(hs)
        started = time.monotonic()
        assert not hs[0].wait_all_finished(1.5)
        assert 1.4 < time.monotonic() - started < 5
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_a_heartbeat_read_before_a_store_restart_does_not_count_against_its_node_after_it() -> None:
    """A restarted store counts heartbeats from 1 again: a successor's value read there may
    equal one read before the restart. The watcher's timer starts again on the new store,
    so the successor gets a whole heartbeat timeout there (it once was marked dead at the
    first reading after the restart)."""
    from kelastic.agent.rendezvous.keepalive import KeepAlive
    from kelastic.agent.rendezvous.protocol import connect_store
    from kelastic.agent.rendezvous.rounds import Member
    from kelastic.agent.rendezvous.settings import RendezvousSettings

    port = free_port()
    keys = RunKeys("hb")
    settings = RendezvousSettings(
        "hb", "127.0.0.1", port, "a", None, 2, 2, keep_alive_interval=0.1, keep_alive_max_attempt=20
    )  # a heartbeat timeout of 2 s
    member = Member(round=1, rank=0, size=2, successor="b")
    stop = threading.Event()
    keep = KeepAlive(settings, keys, threading.RLock(), lambda: (member, None, member), stop)
    server = start_server_process("127.0.0.1", port)
    try:
        first = connect_store("127.0.0.1", port, 5)
        first.add(keys.heartbeat("b"), 1)  # b beat once, then the store goes
        thread = threading.Thread(target=keep.run, args=(first, lambda: True), daemon=True)
        thread.start()
        time.sleep(1.0)  # several readings of b's 1, under the timeout
        server.stop()
        time.sleep(1.5)  # the timeout since the first reading of 1 passes while the store is away
        server = start_server_process("127.0.0.1", port)
        client = connect_store("127.0.0.1", port, 5)
        client.add(keys.heartbeat("b"), 1)  # b re-established its round there: 1 again
        deadline = time.monotonic() + 20
        while not client.check([keys.heartbeat("a")]):  # a came back to the new store
            assert time.monotonic() < deadline, "the keep-alive did not come back to the new store"
            time.sleep(0.05)
        back = int(client.get(keys.heartbeat("a")))  # a's heartbeats are numbers of its own
        while int(client.get(keys.heartbeat("a"))) < back + 4:  # a read b's heartbeat 4 times since
            assert time.monotonic() < deadline, "the keep-alive did not come back to the new store"
            time.sleep(0.05)
        assert not client.check([keys.fate(1, "b")]), "b was marked dead on a reading from before the restart"
        # b's heartbeat does stand still on the new store: found after the timeout there
        while not client.check([keys.fate(1, "b")]):
            assert time.monotonic() < deadline, "a successor whose heartbeat stands still was never found"
            time.sleep(0.05)
    finally:
        stop.set()
        keep.poke.set()
        server.stop()


@pytest.mark.slow
def test_a_node_lost_while_the_store_is_down_still_changes_the_membership() -> None:
    """The peer link tells the loss while the store is away; once it is back the
    survivors re-form once, at the smaller size.

    Every member connects its link to its successor as the round closes, all at once and
    round the ring; the link's listening side answers while its own connect waits, so
    each link is made (see liveness.PeerLink) and the victim's predecessor watches it."""
    port = free_port()
    server = start_server_process("127.0.0.1", port)
    try:
        run = "lost-and-restarted"
        victim, survivors, infos = with_a_victim(server.endpoint, run, 2, 3)
        assert {i.world_size for i in infos} == {3}
        server.stop()
        os.killpg(victim.pid, signal.SIGKILL)
        # Its ring predecessor knows at once, though the store is down (whichever survivor
        # that is: both are watched, neither waited out before the other is asked).
        deadline = time.monotonic() + 30
        while not any(h.membership_changed() for h in survivors):
            assert time.monotonic() < deadline, "the loss went unnoticed: no survivor's peer link saw it"
            survivors[0].wait_membership_change(0.2)
        server = start_server_process("127.0.0.1", port)
        assert all(h.wait_membership_change(15.0) for h in survivors)
        infos = rendezvous_concurrently(survivors, timeout=30)
        assert {i.world_size for i in infos} == {2}
        status = control.read_status(control.connect(server.endpoint), run)
        assert status.round == 2 and sorted(status.members) == ["a", "b"]
    finally:
        shutdown_handlers()
        server.stop()


@pytest.mark.slow
def test_a_store_that_never_comes_back_fails_naming_the_endpoint() -> None:
    server = start_server_process("127.0.0.1", free_port())
    try:
        hs = [node(server.endpoint, "gone", n, 2, 2, join_timeout=3) for n in ("a", "b")]
        rendezvous_concurrently(hs)
        server.stop()
        assert not hs[0].membership_changed()
        with pytest.raises(RendezvousConnectionError, match=re.escape(server.endpoint)):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                hs[0].wait_membership_change(0.5)
    finally:
        shutdown_handlers()
        server.stop()


WORKER = """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"sum {value.item():.0f} of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_workers_form_a_gloo_group_through_the_worker_store() -> None:
    server = start_server_process("127.0.0.1", 0)
    try:
        hs = [node(server.endpoint, "gloo", n, 2, 2) for n in ("a", "b")]
        infos = rendezvous_concurrently(hs)
        workers = []
        for info in infos:
            boot = info.bootstrap_store_info
            assert boot is not None
            env = {
                "RANK": str(info.rank),
                "WORLD_SIZE": str(info.world_size),
                "MASTER_ADDR": boot.master_addr,
                "MASTER_PORT": str(boot.master_port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
            workers.append(spawn(WORKER, env=env))
        for worker in workers:
            out, _ = worker.communicate(timeout=90)
            assert worker.returncode == 0, out
            assert "sum 3 of 2" in out
    finally:
        shutdown_handlers()
        server.stop()


def start_both(a: tuple[str, int], b: tuple[str, int]) -> list[ServerProcess]:
    servers: list[Any] = [None, None]

    def run(i: int, host: str, port: int) -> None:
        try:
            servers[i] = start_server_process(host, port)
        except BaseException as exc:
            servers[i] = exc

    threads = [threading.Thread(target=run, args=(i, *hp)) for i, hp in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for s in servers:
        if isinstance(s, BaseException):
            for other in servers:
                if isinstance(other, ServerProcess):
                    other.stop()
            raise s
    return servers


@pytest.mark.slow
def test_server_binds_exactly_its_address_and_stops_on_sigterm() -> None:
    port = free_port("127.0.0.7")
    first, second = start_both(("127.0.0.7", port), ("127.0.0.8", port))
    try:
        assert first.endpoint == f"127.0.0.7:{port}" and second.endpoint == f"127.0.0.8:{port}"
        assert any(line.startswith(READY_PREFIX) for line in first.output)
        one, two = control.connect(first.endpoint), control.connect(second.endpoint)
        one.set("who", "first")
        two.set("who", "second")
        assert one.get("who") == b"first" and two.get("who") == b"second"
        clash = subprocess.run(
            [sys.executable, "-m", "kelastic.agent.rendezvous", "--host", "127.0.0.7", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert clash.returncode == 1
        assert re.search(rf"cannot listen on 127\.0\.0\.7:{port}", clash.stderr)
    finally:
        assert first.stop() == 0
        assert second.stop() == 0

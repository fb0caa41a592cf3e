"""Strangers against the agent's other ports, in process with real sockets: the rendezvous
peer link, the health/metrics server, and a checkpoint service with short timeouts (the
agent-level attacks are in test_checkpoint_hostile.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.agent import auth, health
from kelastic.agent.checkpoint.admission import State
from kelastic.agent.checkpoint.client import ServiceClient, open_channel
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings, ServiceLimits
from kelastic.agent.health import HealthServer
from kelastic.agent.rendezvous import liveness
from kelastic.agent.rendezvous.liveness import PeerLink
from kelastic.agent.secret import JobSecret, SecretSource

KEY = secrets.token_hex(32).encode()


def closed_within(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def wait_until(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


# --- the peer link ------------------------------------------------------------------------------
@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerLink]:
    monkeypatch.setattr(liveness, "PROOF_TIMEOUT", 0.5)
    pl = PeerLink("127.0.0.1", lambda r, n: None, KEY)
    yield pl
    pl.close()


def test_a_peer_link_answers_strangers_with_nothing_and_keeps_none(link: PeerLink) -> None:
    before = auth.REFUSALS.snapshot()
    silent = socket.create_connection(("127.0.0.1", link.port), timeout=5)
    assert auth.recv_hello(silent)[:8] == auth.MAGIC
    assert closed_within(silent, 5), "a silent stranger was kept past the proof timeout"
    wrong = socket.create_connection(("127.0.0.1", link.port), timeout=5)
    proof, _, _ = auth.prove(b"w" * 64, auth.Service.PEER_LINK, auth.recv_hello(wrong), None)
    wrong.sendall(proof)
    assert wrong.recv(auth.ANSWER_SIZE) == auth.REFUSED and closed_within(wrong, 5)
    after = auth.REFUSALS.snapshot()
    for reason in ("timeout", "unauthenticated"):
        assert after.get(("peer_link", reason), 0) > before.get(("peer_link", reason), 0), reason
    assert wait_until(lambda: link.connections() == (0, 0), 5), link.connections()


def test_a_flood_of_connections_is_bounded(link: PeerLink) -> None:
    flood = [socket.create_connection(("127.0.0.1", link.port), timeout=5) for _ in range(100)]
    assert wait_until(lambda: link.connections()[0] <= liveness.MAX_PROVING, 5)
    assert link.connections()[0] <= liveness.MAX_PROVING
    cut = sum(closed_within(s, 0.05) for s in flood)
    assert cut >= 100 - liveness.MAX_PROVING
    for s in flood:
        s.close()
    # authenticated ones beyond MAX_PEERS are closed too
    peers, kept = [], 0
    for _ in range(liveness.MAX_PEERS + 5):
        s = socket.create_connection(("127.0.0.1", link.port), timeout=5)
        s.settimeout(5)
        peers.append(s)
        try:
            auth.client_handshake(s, KEY, auth.Service.PEER_LINK, link.identity)
            kept += 1
        except auth.AuthError:
            pass
    assert kept == liveness.MAX_PEERS and link.connections()[1] == liveness.MAX_PEERS, link.connections()
    for s in peers:
        s.close()


def test_peers_that_share_the_key_watch_each_other_and_others_give_no_verdict() -> None:
    lost: list[tuple[int, str]] = []
    watcher = PeerLink("127.0.0.1", lambda r, n: lost.append((r, n)), KEY)
    watched = PeerLink("127.0.0.1", lambda r, n: None, KEY)
    stranger = PeerLink("127.0.0.1", lambda r, n: None, b"s" * 64)
    try:
        watcher.watch((1, "other-job", "127.0.0.1", stranger.port))
        time.sleep(0.5)
        assert lost == [] and stranger.connections() == (0, 0), "no verdict from a peer of another job"
        watcher.watch((2, "peer", "127.0.0.1", watched.port))
        assert wait_until(lambda: watched.connections() == (0, 1), 5), watched.connections()
        watched.close()  # the peer's process is gone: its sockets close
        assert wait_until(lambda: lost == [(2, "peer")], 5), lost
    finally:
        for pl in (watcher, watched, stranger):
            pl.close()


def test_a_peer_that_dies_during_the_handshake_is_found_lost() -> None:
    """The peer's process goes while the watcher proves the key: its listener is gone too,
    so the second connect is refused and the loss is known at once."""
    lost: list[tuple[int, str]] = []
    dying = socket.create_server(("127.0.0.1", 0))
    port = dying.getsockname()[1]

    def die() -> None:
        conn, _ = dying.accept()
        conn.sendall(
            auth.hello(auth.Service.PEER_LINK, secrets.token_bytes(auth.NONCE_SIZE), f"127.0.0.1:{port}")
        )
        dying.close()  # the process is gone: its listener, then its connections
        conn.close()

    t = threading.Thread(target=die)
    t.start()
    watcher = PeerLink("127.0.0.1", lambda r, n: lost.append((r, n)), KEY)
    try:
        watcher.watch((3, "dying", "127.0.0.1", port))
        assert wait_until(lambda: lost == [(3, "dying")], 5), lost
    finally:
        watcher.close()
        t.join(5)


def test_a_link_answers_its_own_watcher_while_it_waits_on_a_silent_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connecting side never keeps the listening side from answering: a node whose own
    connect waits on a peer that does not answer (frozen, or itself busy connecting) still
    proves the key to the node that watches it, so that node gets its link now, not when
    the other handshake gives up."""
    monkeypatch.setattr(liveness, "PROOF_TIMEOUT", 120.0)  # the silent peer would hold it that long
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never says hello
    busy = PeerLink("127.0.0.1", lambda r, n: None, KEY)
    lost: list[tuple[int, str]] = []
    watcher = PeerLink("127.0.0.1", lambda r, n: lost.append((r, n)), KEY)
    try:
        busy.watch((1, "silent", "127.0.0.1", silent.getsockname()[1]))
        time.sleep(0.2)  # let busy's connect begin its wait on the silent peer
        watcher.watch((1, "busy", "127.0.0.1", busy.port))
        assert wait_until(lambda: busy.connections() == (0, 1), 30), busy.connections()
        silent.close()  # ends busy's wait: its process goes without waiting for it
        busy.close()
        assert wait_until(lambda: lost == [(1, "busy")], 30), lost
    finally:
        for pl in (watcher, busy):
            pl.close()
        silent.close()


def test_a_ring_whose_members_connect_at_once_is_linked_all_round() -> None:
    """Every member of a new round connects to its successor at the same moment, and the
    ring closes on itself: each link is made, and a member that dies is found at once."""
    lost: list[tuple[int, str]] = []
    ring = [PeerLink("127.0.0.1", lambda r, n: lost.append((r, n)), KEY) for _ in range(3)]
    try:
        for i, pl in enumerate(ring):
            pl.watch((1, f"n{(i + 1) % 3}", "127.0.0.1", ring[(i + 1) % 3].port))
        assert wait_until(lambda: all(pl.connections() == (0, 1) for pl in ring), 30), [
            pl.connections() for pl in ring
        ]
        ring[1].close()
        assert wait_until(lambda: lost == [(1, "n1")], 30), lost
    finally:
        for pl in ring:
            pl.close()


# --- the health server --------------------------------------------------------------------------
@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Iterator[HealthServer]:
    monkeypatch.setattr(health, "READ_TIMEOUT", 0.5)
    monkeypatch.setattr(health, "CONNECTION_DEADLINE", 1.0)
    server = HealthServer(0, lambda: True, host="127.0.0.1", metrics=lambda: "m 1\n").start()
    yield server
    server.stop()


def get(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return int(r.status)


def test_the_probes_answer_through_a_flood_of_silent_connections(probes: HealthServer) -> None:
    silent = [socket.create_connection(("127.0.0.1", probes.port), timeout=5) for _ in range(100)]
    assert get(probes.port, "/healthz") == 200 and get(probes.port, "/metrics") == 200
    cut = sum(closed_within(s, 0.05) for s in silent)
    assert cut >= 100 - health.MAX_CONNECTIONS
    for s in silent:
        s.close()


def test_a_trickling_client_is_cut_off_at_the_deadline(probes: HealthServer) -> None:
    s = socket.create_connection(("127.0.0.1", probes.port), timeout=5)
    began = time.monotonic()
    try:
        for ch in b"GET /healthz HTTP/1.0\r\nX-Slow: " + b"a" * 100:
            s.sendall(bytes([ch]))
            time.sleep(0.2)
            if time.monotonic() - began > 5:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert closed_within(s, 5)
    assert time.monotonic() - began < 4, "the connection outlived its deadline"
    s.close()


def test_the_metrics_say_nothing_secret() -> None:
    from kelastic.agent.telemetry import AgentTelemetry

    text = AgentTelemetry().render()
    assert 'kelastic_agent_refused_total{service="checkpoint",reason="unauthenticated"}' in text
    assert KEY.decode() not in text


# --- a checkpoint service with short timeouts ---------------------------------------------------
@pytest.fixture
def quick() -> Iterator[CheckpointService]:
    root = Path("/dev/shm") / f"kelastic-quick-{uuid.uuid4().hex[:8]}"
    limits = ServiceLimits(
        connections=4, handshakes=2, handshake_timeout=0.5, io_timeout=0.5, idle_timeout=1.0
    )
    s = CheckpointService(
        CheckpointSettings(root=root, node="q", limit=2**20),
        JobSecret(KEY, SecretSource.FILE),
        host="127.0.0.1",
        limits=limits,
    ).start()
    yield s
    s.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_half_a_frame_then_silence_is_cut_off_and_an_idle_client_reconnects(quick: CheckpointService) -> None:
    s = open_channel(quick.endpoint, KEY, timeout=5).sock
    s.sendall(b"\0" * 7)
    assert closed_within(s, 3)
    s.close()
    client = ServiceClient(quick.endpoint, KEY, timeout=5)
    assert client.call({"op": "inventory"})[0]["ok"]
    time.sleep(0.9)  # past the idle timeout: the service closed it
    assert client.call({"op": "inventory"})[0]["ok"], "the client did not reconnect"
    client.close()


def test_newly_authenticated_connections_replace_idle_ones_never_busy_ones(quick: CheckpointService) -> None:
    clients = [ServiceClient(quick.endpoint, KEY, timeout=5) for _ in range(6)]
    for c in clients:
        assert c.call({"op": "inventory"})[0]["ok"]
    states = quick.admission.states()
    assert sum(states.values()) <= quick.limits.connections, states
    # a request in progress (a begin waiting for a save's previous replica) is never cut off
    quick.keeper.outgoing(+1)
    waiting: list[object] = []
    busy = ServiceClient(quick.endpoint, KEY, timeout=10)
    t = threading.Thread(
        target=lambda: waiting.append(
            busy.call({"op": "begin", "rank": 0, "bytes": 1, "timeout": 1.5, "pid": os.getpid()})[0]
        )
    )
    t.start()
    time.sleep(0.3)
    for c in clients:  # every one of them takes a place again
        assert c.call({"op": "inventory"})[0]["ok"]
    t.join(10)
    quick.keeper.outgoing(-1)
    assert waiting and isinstance(waiting[0], dict) and "refused" in waiting[0], waiting
    for c in [*clients, busy]:
        c.close()


# --- a flood of handshakes ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_stranger_flooding_handshakes_does_not_stop_a_rank_that_saves_every_step() -> None:
    """A stranger opens connections as fast as it can from eight addresses (each half a TLS
    hello, then silence) while a rank saves every step, each save on a new connection: the
    stranger holds at most a quarter of the handshakes per address, the rank's cut-off
    handshakes are tried again, and every save is taken."""
    root = Path("/dev/shm") / f"kelastic-flood-{uuid.uuid4().hex[:8]}"
    s = CheckpointService(
        CheckpointSettings(root=root, node="f", limit=64 * 2**20),
        JobSecret(KEY, SecretSource.FILE),
        host="127.0.0.1",
        limits=ServiceLimits(handshakes=16, handshake_timeout=2.0, io_timeout=2.0),
    ).start()
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        held: list[socket.socket] = []
        host, port = s.endpoint.rsplit(":", 1)
        while not stop.is_set():
            try:
                c = socket.socket()
                c.bind((f"127.0.0.{2 + opened[0] % 8}", 0))
                c.connect((host, int(port)))
                c.sendall(b"\x16\x03\x01\x02\x00\x01")
                held.append(c)
                opened[0] += 1
            except OSError:
                pass
            if len(held) > 400:
                for old in held[:200]:
                    old.close()
                del held[:200]
        for c in held:
            c.close()

    stranger = threading.Thread(target=flood, daemon=True)
    stranger.start()
    try:
        time.sleep(0.3)
        for step in range(1, 16):
            client = ServiceClient(s.endpoint, KEY, timeout=10)
            reply, _ = client.call(
                {"op": "begin", "rank": 0, "bytes": 4096, "timeout": 5, "pid": os.getpid()}
            )
            assert "refused" not in reply, reply
            path = client.call({"op": "open", "id": step, "name": "__0.mem", "size": 4096, "rank": 0})[0][
                "path"
            ]
            Path(path).write_bytes(b"s" * 4096)
            client.call({"op": "done", "rank": 0})
            client.close()
            assert s.keeper.commit(step, b"m", {"__0.mem": 4096}, [s.endpoint], step)
            assert s.admission.states()[State.PROVING] <= s.limits.handshakes
        assert opened[0] > 100, f"the stranger opened only {opened[0]} connections"
    finally:
        stop.set()
        stranger.join(10)
        s.stop()
        shutil.rmtree(root, ignore_errors=True)

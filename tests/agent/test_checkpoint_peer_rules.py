"""A peer that holds the job's secret against a real checkpoint service: the rules hold.

One real :class:`CheckpointService` (real sockets on loopback, its tmpfs folder) whose agent
names its workers (this test process and a child it starts, as the agent names the ranks it
started); the attacker is the test, speaking the protocol with the right key, from another
loopback address (127.0.0.2: not the node's own, not on the ring) where it matters.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent import auth, tls
from kelastic.agent.checkpoint import codec, wire
from kelastic.agent.checkpoint.admission import State
from kelastic.agent.checkpoint.client import ServiceClient, open_channel, parse_endpoint
from kelastic.agent.checkpoint.keeper import MAX_ID_JUMP
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings, ServiceLimits
from kelastic.agent.secret import JobSecret, SecretSource

KEY = os.urandom(32).hex().encode()
#: A node of the ring on the test's own address (its port never listens).
PREDECESSOR = "127.0.0.1:1"
MiB = 2**20
LIMIT = 16 * MiB


@pytest.fixture
def node() -> Iterator[CheckpointService]:
    limits = ServiceLimits(connections=8, handshakes=8, handshake_timeout=2, io_timeout=1.0, idle_timeout=30)
    yield from _service(limits)


def _service(limits: ServiceLimits) -> Iterator[CheckpointService]:
    root = Path("/dev/shm") / f"kelastic-peers-{uuid.uuid4().hex[:8]}"
    s = CheckpointService(
        CheckpointSettings(root=root, node="n", limit=LIMIT),
        JobSecret(KEY, SecretSource.FILE),
        host="127.0.0.1",
        limits=limits,
    ).start()
    s.keeper.local.set(lambda: [os.getpid()])
    s.set_ring([s.endpoint])
    yield s
    s.stop()
    shutil.rmtree(root, ignore_errors=True)


def ask(s: CheckpointService, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
    ch = open_channel(s.endpoint, KEY, timeout=10)
    try:
        ch.send(header, payload)
        reply = ch.recv_header()
        assert reply is not None
        ch.recv_payload(reply)
        return reply.header
    finally:
        ch.sock.close()


def from_stranger_address(s: CheckpointService) -> wire.Channel:
    """An authenticated connection from 127.0.0.2: a peer with the key, not on the ring."""
    raw = socket.socket()
    raw.bind(("127.0.0.2", 0))
    raw.settimeout(10)
    raw.connect(parse_endpoint(s.endpoint))
    sock = tls.client_context(KEY).wrap_socket(raw)
    session = auth.client_handshake(sock, KEY, auth.Service.CHECKPOINT, s.endpoint)
    return wire.Channel(sock, session, io_timeout=10, max_header=ServiceLimits().max_header)


def still_open(sock: socket.socket, wait: float) -> bool:
    """Whether the service still holds ``sock`` (silent within ``wait`` s, or it sent a byte)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


def save(s: CheckpointService, cid: int, size: int = MiB) -> None:
    """One rank's save as MemoryWriter makes it (this process is the node's rank 0)."""
    client = ServiceClient(s.endpoint, KEY, timeout=10)
    reply, _ = client.call({"op": "begin", "rank": 0, "bytes": size, "timeout": 5, "pid": os.getpid()})
    assert "refused" not in reply, reply
    path = client.call({"op": "open", "id": cid, "name": "__0.mem", "size": size, "rank": 0})[0]["path"]
    Path(path).write_bytes(b"w" * size)
    client.call({"op": "done", "rank": 0})
    client.close()
    s.keeper.commit(cid, _metadata(size), {"__0.mem": size}, [s.endpoint], cid)


def _metadata(size: int) -> bytes:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from kelastic.agent.checkpoint.storage import MemoryItem

    item = MemoryItem("__0.mem", 0, size, "torch.uint8", torch.Size([size]))
    return codec.dumps(Metadata({}, storage_data={MetadataIndex("w"): item}))


def latest(s: CheckpointService) -> int | None:
    value = s.keeper.status()["latest"]
    return value if isinstance(value, int) else None


def test_a_restore_report_of_an_older_checkpoint_drops_nothing(node: CheckpointService) -> None:
    """Attack 6: ``restored`` of an older id, then a ``begin`` for the whole limit."""
    save(node, 1)
    save(node, 2)
    reply = ask(node, {"op": "restored", "id": 1, "source": "memory", "seconds": 1, "step": None, "pid": 1})
    assert not reply["ok"] and "no process its agent started" in reply["error"], reply
    reply = ask(node, {"op": "begin", "rank": 1, "bytes": LIMIT, "timeout": 1, "pid": 1})
    assert not reply["ok"] and "no process its agent started" in reply["error"], reply
    reply = ask(node, {"op": "begin", "rank": 0, "bytes": LIMIT, "timeout": 1, "pid": os.getpid()})
    assert reply["ok"] and "refused" in reply, reply  # too big, and nothing dropped for it
    ask(node, {"op": "done", "rank": 0})
    assert latest(node) == 2
    assert [h.id for h in node.keeper.inventory().held] == [1, 2] or latest(node) == 2


def test_a_reservation_of_a_process_that_is_no_rank_or_is_gone_holds_nothing(node: CheckpointService) -> None:
    """Attack 7: ``begin`` for rank 999 with pid 1; and a rank that dies after its begin."""
    reply = ask(node, {"op": "begin", "rank": 999, "bytes": LIMIT // 2, "timeout": 1, "pid": 1})
    assert not reply["ok"] and "no process its agent started" in reply["error"], reply
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        node.keeper.local.set(lambda: [os.getpid(), rank.pid])
        reply = ask(node, {"op": "begin", "rank": 5, "bytes": LIMIT // 3, "timeout": 1, "pid": rank.pid})
        assert reply["ok"] and "refused" not in reply, reply
    finally:
        rank.kill()
        rank.wait()
    save(node, 1, size=LIMIT // 3)  # the dead rank's reservation went with it


def test_ids_may_not_run_ahead_and_a_peer_cannot_supersede_a_save(node: CheckpointService) -> None:
    """Attack 8: an ``open`` of newest + 2**32 during a save; a replica far ahead."""
    save(node, 1)
    client = ServiceClient(node.endpoint, KEY, timeout=10)
    client.call({"op": "begin", "rank": 0, "bytes": MiB, "timeout": 5, "pid": os.getpid()})
    path = client.call({"op": "open", "id": 2, "name": "__0.mem", "size": MiB, "rank": 0})[0]["path"]
    peer = from_stranger_address(node)
    peer.send({"op": "open", "id": 1 + 2**32, "name": "__9.mem", "size": 64, "rank": 9})
    reply = peer.recv_header()
    assert reply is not None and not reply.header["ok"], reply
    assert "no save begun" in reply.header["error"] or "past the newest" in reply.header["error"]
    peer.sock.close()
    far = 1 + MAX_ID_JUMP  # as far as a replica may run: taken, and it supersedes nothing
    node.set_ring([node.endpoint, PREDECESSOR])  # a node at this address sends its replicas here
    put = {"op": "put", "name": "__9.mem", "from": PREDECESSOR}
    assert ask(node, {**put, "id": far}, b"x" * 64)["ok"]
    reply = ask(node, {**put, "id": far + MAX_ID_JUMP + 1}, b"x" * 64)
    assert not reply["ok"] and "past the newest" in reply["error"], reply
    Path(path).write_bytes(b"w" * MiB)
    client.call({"op": "done", "rank": 0})
    client.close()
    assert node.keeper.commit(2, _metadata(MiB), {"__0.mem": MiB}, [node.endpoint], 2)
    assert latest(node) == 2


def test_headers_and_metadata_count_against_the_memory_limit_before_they_are_read(
    node: CheckpointService,
) -> None:
    """Attack 9: peers announcing 4 MiB headers and sending nothing; a commit announcing
    more metadata than the limit leaves."""
    save(node, 1, size=LIMIT // 4)
    held: list[socket.socket] = []
    refused = 0
    for _ in range(6):  # 6 x 4 MiB of headers would pass the 16 MiB limit with the part held
        ch = open_channel(node.endpoint, KEY, timeout=10)
        ch.sock.sendall(wire.PREFIX.pack(0, 4 * MiB, 0))
        held.append(ch.sock)
        time.sleep(0.05)
        assert node.keeper.held_bytes() + node.keeper._buffered <= LIMIT
    for s in held:
        s.settimeout(5)
        try:
            if not s.recv(1):
                refused += 1
        except (TimeoutError, OSError):
            refused += 1
        s.close()
    assert refused >= 3, "headers past the limit were read"
    ch = open_channel(node.endpoint, KEY, timeout=10)
    head = {"op": "commit", "id": 2, "required": {"__0.mem": 1}, "step": 1}
    ch.sock.sendall(ch.head(head, 15 * MiB, wire.SEALED) + b"\0" * 1024)
    reply = ch.recv_header()
    assert reply is not None and "cannot read" in reply.header["error"], reply
    ch.sock.close()
    save(node, 2, size=LIMIT // 4)


def test_slow_peers_cannot_hold_the_slots_of_the_node_s_own_ranks(node: CheckpointService) -> None:
    """Attack 10: peers that trickle a request are cut off once behind pace, at most an
    eighth of the connections is a stranger address's, and the node's own ranks get in."""
    held: list[socket.socket] = []
    node.set_ring([])  # no ring told: replicas are taken from anyone, so the trickles are read
    for i in range(node.limits.connections):
        try:
            ch = from_stranger_address(node)
            ch.send_header({"op": "put", "id": 1, "name": f"__{i}.mem"}, 8 * MiB)
            ch.sock.sendall(b"\0")  # one byte, then a trickle
        except OSError:
            continue  # refused: its address holds its share
        held.append(ch.sock)
    time.sleep(0.3)
    kept = sum(still_open(s, 0.05) for s in held)
    assert kept <= node.admission.per_peer, f"{kept} connections of one stranger address held"
    began = time.monotonic()
    save(node, 1)  # the node's own rank, at once
    assert time.monotonic() - began < 10
    deadline = time.monotonic() + 10
    for s in held:  # the trickles are cut off once behind pace (1 s grace here)
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            pytest.fail("a trickling peer was not cut off")
        except OSError:
            pass
        s.close()


def test_a_peer_puts_only_the_replicas_the_rounds_ring_assigns_it(node: CheckpointService) -> None:
    """Attack: a peer with the secret puts a part it was not assigned: with no name, in the name
    of a node that is not on the ring, in the name of a node whose parts go elsewhere, in
    another node's name from its own address, or as a node of a previous round's ring. Each is
    refused before a byte of it is read; the assigned sender's replica is taken."""
    other = "127.0.0.2:1"  # a ring node on another address
    node.set_ring([PREDECESSOR, node.endpoint, other])  # PREDECESSOR's parts come here

    def put(sender: str | None, name: str, peer: bool = False) -> dict[str, Any]:
        header: dict[str, Any] = {"op": "put", "id": 5, "name": name}
        if sender is not None:
            header["from"] = sender
        if not peer:
            return ask(node, header, b"x" * 64)
        ch = from_stranger_address(node)  # from 127.0.0.2
        try:
            ch.send(header, b"x" * 64)
            reply = ch.recv_header()
            assert reply is not None
            return reply.header
        finally:
            ch.sock.close()

    def refused(reply: dict[str, Any], needle: str) -> None:
        assert reply["ok"] is False and needle in reply["error"], reply

    refused(put(None, "__1.mem"), "must name the node that sends it")
    refused(put("127.0.0.9:1", "__1.mem"), "no node of this round's checkpoint ring")
    refused(put(other, "__1.mem", peer=True), "not to")  # other's parts go to PREDECESSOR
    refused(put(PREDECESSOR, "__1.mem", peer=True), "another address")  # from 127.0.0.2
    assert put(PREDECESSOR, "__1.mem")["ok"]
    node.set_ring([node.endpoint, other])  # the next round: PREDECESSOR is gone
    refused(put(PREDECESSOR, "__2.mem"), "no node of this round's checkpoint ring")
    assert put(other, "__2.mem", peer=True)["ok"]
    held = (
        {h["id"]: h for h in node.keeper.status().get("held", [])} if "held" in node.keeper.status() else {}
    )
    assert not node.keeper.path_of(5, "__9.mem").exists() and held is not None


def test_nodes_on_loopback_addresses_of_their_own_take_each_others_replicas(tmp_path: Path) -> None:
    """Several nodes on one host, each on a loopback address of its own (as the pods of
    ``kelastic local``): a node sends its replica from its own address, not from the
    kernel's default 127.0.0.1, so its successor takes it as from the node it names."""
    root = Path("/dev/shm") / f"kelastic-loopbacks-{uuid.uuid4().hex[:8]}"
    nodes = [
        CheckpointService(
            CheckpointSettings(root=root / host, node=host, limit=LIMIT),
            JobSecret(KEY, SecretSource.FILE),
            host=host,
            advertise=host,
        ).start()
        for host in ("127.3.0.1", "127.3.0.2")
    ]
    try:
        ring = [n.endpoint for n in nodes]
        for n in nodes:
            n.set_ring(ring)
        part = tmp_path / "part"
        part.write_bytes(b"y" * 4096)
        a, b = nodes
        client = a.client(b.endpoint)
        try:
            client.put_file(3, "__0.mem", part, 4096, sender=a.endpoint)
        finally:
            client.close()
        assert b.keeper.path_of(3, "__0.mem").read_bytes() == b"y" * 4096
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def patient() -> Iterator[CheckpointService]:
    """A service that waits a minute for a handshake: a connection cut sooner was replaced."""
    limits = ServiceLimits(connections=8, handshakes=8, handshake_timeout=60, io_timeout=1.0, idle_timeout=30)
    yield from _service(limits)


def test_silent_handshakes_from_many_addresses_give_way_to_the_node_s_own_rank(
    patient: CheckpointService,
) -> None:
    """Silence spread over addresses: 48 connections that never say a word, from 16 loopback
    addresses (within one address's share of the handshakes each), hold at most the
    service's handshake places; past them the oldest is cut off at once (the handshake
    timeout is a minute), and the node's own rank still saves."""
    silent: list[socket.socket] = []
    try:
        for i in range(48):
            raw = socket.socket()
            silent.append(raw)
            raw.bind((f"127.0.0.{2 + i % 16}", 0))
            raw.connect(parse_endpoint(patient.endpoint))
        held = len(silent)
        deadline = time.monotonic() + 20
        while held > patient.limits.handshakes and time.monotonic() < deadline:
            held = sum(still_open(s, 0.01) for s in silent)
        assert held <= patient.limits.handshakes, f"{held} silent connections held"
        assert patient.admission.states()[State.PROVING] <= patient.limits.handshakes
        save(patient, 1)
        assert latest(patient) == 1
    finally:
        for s in silent:
            s.close()

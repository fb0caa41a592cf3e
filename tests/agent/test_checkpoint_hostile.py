"""A stranger, and a peer holding the job's secret, against real agents' checkpoint services.

Two real ``kelastic-agent`` processes (a real store, gloo, scripts/ckpt_worker.py saving
every step with ``MemoryWriter``) share one job secret; the tests are the attacker, on the
same network (loopback), with real sockets. Each attack of docs/security.md is tried
without the secret, with a wrong one, and (for the rules that hold for any peer) with the
right one; each is refused, and afterwards the job's own ranks still save, and restore
bit-identical after a failure, while the agents' memory stays bounded.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import runpy
import secrets
import shutil
import signal
import socket
import ssl
import struct
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import auth, tls
from kelastic.agent.checkpoint import wire
from kelastic.agent.checkpoint.client import ServiceClient, open_channel
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.settings import ServiceLimits
from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_worker.py"
LIMITS = ServiceLimits()
MiB = 2**20

pytestmark = pytest.mark.slow


@dataclass
class Node:
    name: str
    pid: int
    endpoint: str
    health: int

    def addr(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        return host, int(port)


@dataclass
class Job:
    cluster: Any
    key: bytes
    nodes: list[Node]
    shm: Path
    marker: Path

    def events(self) -> list[dict[str, Any]]:
        path = self.cluster.out / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def saved(self) -> dict[int, str]:
        return {e["step"]: e["hash"] for e in self.events() if e["event"] == "saved"}

    def saves_go_on(self, more: int = 3, timeout: float = 90) -> None:
        """The job's own ranks save ``more`` checkpoints from now on."""
        start = max(self.saved(), default=0)
        self.cluster.wait_for(
            f"{more} more saves after step {start}",
            lambda: max(self.saved(), default=0) >= start + more,
            timeout,
        )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("hostile")
    shm = Path("/dev/shm") / f"kelastic-hostile-{uuid.uuid4().hex[:8]}"
    store: ServerProcess = start_server_process(harness.loopback_host(), 29400, timeout=60)
    c = harness.Cluster(tmp, store.endpoint, run_id=f"hostile-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b"):
            c.start(
                name,
                ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "3", "--health-port", "0",
                 "--checkpoint-dir", str(shm), "--checkpoint-memory", "256Mi"],
                ["--mib", "8", "--step-time", "0.2", "--steps", "100000"],
                script=SCRIPT,
            )  # fmt: skip
        job = Job(c, c.secret.read_bytes().strip(), [], shm, tmp / "pwned")
        c.wait_for("3 saves", lambda: len(job.saved()) >= 3, 180)
        for a in c.agents:
            out = a.output()
            endpoint = re.search(r"service at (\S+)$", out, re.MULTILINE)
            health = re.search(r"/metrics on port (\d+)", out)
            assert endpoint and health, out[-3000:]
            job.nodes.append(Node(a.name, a.proc.pid, endpoint.group(1), int(health.group(1))))
        yield job
    finally:
        c.close()
        store.stop()
        shutil.rmtree(shm, ignore_errors=True)


# --- the attacker's tools -------------------------------------------------------------------------
def connect(node: Node) -> socket.socket:
    sock = socket.create_connection(node.addr(), timeout=10)
    sock.settimeout(10)
    return sock


def authenticated(node: Node, key: bytes) -> wire.Channel:
    return open_channel(node.endpoint, key, timeout=10)


def sealed(node: Node, key: bytes) -> ssl.SSLSocket:
    """A TLS connection to ``node`` with the job's certificate, before kelastic's handshake."""
    return tls.client_context(key).wrap_socket(connect(node))


def ask(node: Node, key: bytes, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
    """One request on a fresh authenticated connection: the reply's header."""
    ch = authenticated(node, key)
    try:
        ch.send(header, payload)
        reply = ch.recv_header()
        assert reply is not None, f"{header['op']}: the service closed the connection"
        ch.recv_payload(reply)
        return reply.header
    finally:
        ch.sock.close()


def old_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A request as the unauthenticated protocol framed it (what an attacker would send)."""
    body = json.dumps(header).encode()
    return struct.pack(">QQ", len(body), len(payload)) + body + payload


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
        return True


def closed_among(socks: list[socket.socket], within: float) -> int:
    """How many of ``socks`` the server closed, waiting ``within`` seconds for all of them
    together: an open one takes what is left of the wait, not ``within`` of its own (hundreds
    of open sockets at 0.2 s each took a minute). A socket closed earlier answers at once."""
    deadline = time.monotonic() + within
    return sum(closed_by_server(s, max(0.001, deadline - time.monotonic())) for s in socks)


def metric(node: Node, service: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.health}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'kelastic_agent_refused_total\{{service="{service}",reason="{reason}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads")


class Pwn:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def inventory(node: Node, key: bytes) -> dict[str, Any]:
    inv: dict[str, Any] = ask(node, key, {"op": "inventory"})["inventory"]
    return inv


def newest_committed(node: Node, key: bytes) -> tuple[int, dict[str, int]]:
    held = [h for h in inventory(node, key)["held"] if h["required"] is not None]
    return held[-1]["id"], held[-1]["files"]


# --- without the secret ----------------------------------------------------------------------------
ATTACKS: list[tuple[str, dict[str, Any], bytes]] = [
    ("pickled-metadata commit", {"op": "commit", "id": 10**6, "ring": [], "required": {}, "step": 1}, b""),
    ("inventory", {"op": "inventory"}, b""),
    ("metadata", {"op": "metadata", "id": 1}, b""),
    ("get", {"op": "get", "id": 1, "name": "__0.mem", "offset": 0, "length": 4096}, b""),
    ("commit with a foreign ring", {"op": "commit", "id": 1, "ring": ["10.0.0.66:1"], "required": {}}, b"x"),
    ("put over a committed part", {"op": "put", "id": 1, "name": "__0.mem"}, b"\0" * 4096),
    ("restored id 0", {"op": "restored", "id": 0, "source": "memory", "seconds": 1, "step": None}, b""),
    ("begin pid 2**70", {"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 2**70}, b""),
    ("begin pid 0", {"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 0}, b""),
    ("open past the limit", {"op": "open", "id": 10**6, "name": "__0.mem", "size": 2**40, "rank": 0}, b""),
]


def test_without_the_secret_every_request_is_refused_before_it_is_parsed(job: Job) -> None:
    """The requests of the unauthenticated protocol: the service speaks TLS first and only
    with the job's certificate, so their bytes fail as a TLS handshake, are never parsed,
    and get nothing back but a TLS alert and a closed connection."""
    node = job.nodes[0]
    # ten at once from one address: past the handshakes one address may hold, the oldest are cut
    # off (over_capacity) before their bytes fail as TLS (unauthenticated)
    refused = metric(node, "checkpoint", "unauthenticated") + metric(node, "checkpoint", "over_capacity")
    sent: list[tuple[str, bytes, socket.socket]] = []
    for what, header, payload in ATTACKS:
        if what == "pickled-metadata commit":
            payload = pickle.dumps(Pwn(job.marker))
        sock = connect(node)
        frame = old_frame(header, payload)
        sock.sendall(frame)
        sent.append((what, frame, sock))
    for what, _, sock in sent:
        got = b""
        sock.settimeout(LIMITS.handshake_timeout + 10)
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass  # closed with the rest of the request unread: the kernel resets
        finally:
            sock.close()
        # nothing but a TLS alert record (content type 21) ever came back
        assert got == b"" or got[:1] == b"\x15", (what, got[:64])
        assert auth.MAGIC not in got, what
    now = metric(node, "checkpoint", "unauthenticated") + metric(node, "checkpoint", "over_capacity")
    assert now >= refused + len(sent), (now, refused)
    job.saves_go_on()
    assert not job.marker.exists()


def test_with_a_wrong_secret_every_request_is_refused(job: Job) -> None:
    wrong = secrets.token_hex(32).encode()
    node = job.nodes[1]
    for _, header, payload in ATTACKS:
        client = ServiceClient(node.endpoint, wrong, timeout=10)
        with pytest.raises(CheckpointError, match="do not hold the same job secret"):
            client.call(header, payload)
        client.close()
    # an impostor service: a worker of this job holding the right key does not talk to it
    impostor = socket.create_server(("127.0.0.1", 0))
    port = impostor.getsockname()[1]

    def serve_one() -> None:
        conn, _ = impostor.accept()
        try:
            tls.server_context(wrong).wrap_socket(conn, server_side=True)
        except ssl.SSLError:
            pass
        conn.close()

    import threading

    t = threading.Thread(target=serve_one)
    t.start()
    with pytest.raises(CheckpointError, match="not this job's"):
        ServiceClient(f"127.0.0.1:{port}", job.key, timeout=10).call({"op": "inventory"})
    t.join(10)
    impostor.close()


# --- with the secret: the rules that hold for every peer --------------------------------------------
def test_an_authenticated_peer_cannot_break_the_rules(job: Job) -> None:
    node = job.nodes[0]
    foreign = socket.create_server(("127.0.0.1", 0))  # where a foreign ring would send the parts
    foreign.settimeout(0.2)
    foreign_endpoint = f"127.0.0.1:{foreign.getsockname()[1]}"
    cid, files = newest_committed(node, job.key)
    name = next(iter(files))
    part = job.shm / next(p for p in job.shm.iterdir()).name / node.name / f"ckpt-{cid:010d}" / name
    before = part.read_bytes() if part.exists() else None

    def refused(header: dict[str, Any], payload: bytes, needle: str) -> None:
        reply = ask(node, job.key, header, payload)
        assert reply["ok"] is False and needle in reply["error"], (header["op"], reply)

    # code in a commit's metadata
    refused({"op": "commit", "id": cid + 5, "required": {}, "step": 1}, pickle.dumps(Pwn(job.marker)),
            "names posix.system")  # fmt: skip
    # a commit cannot name a ring; a committed checkpoint cannot be committed again otherwise
    refused({"op": "commit", "id": cid, "ring": [foreign_endpoint], "required": {}, "step": 1}, b"x",
            "commit takes no ring")  # fmt: skip
    meta = ask(node, job.key, {"op": "metadata", "id": cid})
    assert meta["ok"], meta
    ch = authenticated(node, job.key)
    ch.send({"op": "metadata", "id": cid})
    reply = ch.recv_header()
    assert reply is not None and reply.sealed
    blob = ch.recv_payload(reply)
    ch.sock.close()
    refused({"op": "commit", "id": cid, "required": {name: 1}, "step": 7}, blob, "outside the files")
    refused({"op": "commit", "id": cid, "required": files, "step": 7}, blob, "committed already")
    # a committed part is never replaced
    # (or, when the job committed a newer one meanwhile, is older than the newest: refused too)
    peer = job.nodes[1].endpoint  # the node whose parts the ring gives to this one
    reply = ask(node, job.key, {"op": "put", "id": cid, "name": name, "from": peer}, b"\xff" * 4096)
    assert not reply["ok"] and ("never replaced" in reply["error"] or "older than" in reply["error"]), reply
    # nothing is dropped by a request; numbers out of range are refused before the keeper sees them
    refused({"op": "restored", "id": 0, "source": "memory", "seconds": 1, "step": None}, b"", "out of range")
    # a restore report and a reservation come only from the node's own ranks (attacks 6, 7)
    refused({"op": "restored", "id": 1, "source": "memory", "seconds": 1, "step": None, "pid": 1}, b"",
            "no process its agent started")  # fmt: skip
    refused({"op": "begin", "rank": 999, "bytes": 200 * MiB, "timeout": 1, "pid": 1}, b"",
            "no process its agent started")  # fmt: skip
    assert newest_committed(node, job.key)[0] >= cid, "a restore report dropped the newest checkpoint"
    # nor can a peer open a part, or run the numbers ahead (attack 8)
    refused(
        {"op": "open", "id": cid + 2**32, "name": "__9.mem", "size": 64, "rank": 9}, b"", "past the newest"
    )
    refused({"op": "open", "id": cid + 3, "name": "__9.mem", "size": 64, "rank": 9}, b"", "no save begun")
    refused({"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 2**70}, b"", "out of range")
    refused({"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 0}, b"", "out of range")
    refused({"op": "begin", "rank": True, "bytes": 1, "timeout": 1, "pid": 1}, b"", "must be an integer")
    reply = ask(node, job.key, {"op": "open", "id": cid + 1, "name": "__0.mem", "size": 2**40, "rank": 0})
    assert not reply["ok"] and ("limit" in reply["error"] or "no save begun" in reply["error"]), reply
    refused(
        {"op": "open", "id": cid + 2**40, "name": "__0.mem", "size": 64, "rank": 0}, b"", "past the newest"
    )
    refused({"op": "put", "id": cid + 2**32, "name": "__9.mem", "from": peer}, b"x" * 64, "past the newest")
    # a replica the ring does not assign to its sender (attack: a peer puts what it likes)
    refused({"op": "put", "id": cid + 1, "name": "__9.mem"}, b"x" * 64, "must name the node that sends it")
    refused({"op": "put", "id": cid + 1, "name": "__9.mem", "from": node.endpoint}, b"x" * 64,
            "not to")  # fmt: skip
    refused({"op": "put", "id": cid + 1, "name": "__9.mem", "from": foreign_endpoint}, b"x" * 64,
            "no node of this round's checkpoint ring")  # fmt: skip
    refused(
        {"op": "open", "id": cid + 1, "name": "../../etc/passwd", "size": 64, "rank": 0}, b"", "file name"
    )
    # Past a part's end, of the newest checkpoint as read just before: the job saves on, and
    # under load the one read at the start may be dropped meanwhile ("holds no file").
    for _ in range(5):
        newest, now_files = newest_committed(node, job.key)
        name_now = next(iter(now_files))
        reply = ask(node, job.key, {"op": "get", "id": newest, "name": name_now, "offset": now_files[name_now],
                                    "length": 1})  # fmt: skip
        if "holds no file" not in str(reply.get("error")):
            break
    assert reply["ok"] is False and "past its end" in reply["error"], reply
    refused({"op": "get", "id": cid, "name": name, "offset": 2**60, "length": 1}, b"", "out of range")
    refused({"op": "launch-missiles"}, b"", "unknown operation")
    # a payload beyond an operation's cap is refused without reading it
    ch = authenticated(node, job.key)
    ch.send_header({"op": "inventory"}, 64 * MiB)
    reply = ch.recv_header()
    assert reply is not None and "takes no payload" in reply.header["error"]
    assert closed_by_server(ch.sock, 10)
    job.saves_go_on()
    # the foreign endpoint never heard from the job, the part is what its rank wrote
    with pytest.raises(TimeoutError):
        foreign.accept()
    foreign.close()
    if before is not None and part.exists():
        assert part.read_bytes() == before
    assert not job.marker.exists()


def test_a_captured_request_cannot_be_replayed(job: Job) -> None:
    """Replayed as a peer holding the secret would (inside TLS; a capture of the wire is
    ciphertext under keys of its own connection, worthless on any other)."""
    node = job.nodes[1]
    sock = sealed(node, job.key)
    hello = auth.recv_hello(sock)
    proof, ns, nc = auth.prove(job.key, auth.Service.CHECKPOINT, hello, node.endpoint)
    sock.sendall(proof)
    session = auth.check_answer(
        job.key, auth.Service.CHECKPOINT, ns, nc, sock.recv(auth.ANSWER_SIZE), node.endpoint
    )
    ch = wire.Channel(sock, session, io_timeout=10, max_header=LIMITS.max_header)
    # the bytes of an authenticated request, as a capture of the wire would hold them
    frame = ch.head({"op": "inventory"}, 0, 0)
    sock.sendall(frame)
    reply = ch.recv_header()
    assert reply is not None and reply.header["ok"]
    before = metric(node, "checkpoint", "bad_frame")
    # the same frame again on its own connection: its sequence number is spent
    sock.sendall(frame)
    assert closed_by_server(sock, 10)
    sock.close()
    # the whole captured conversation on a new connection: the service's fresh nonce refuses it
    again = sealed(node, job.key)
    auth.recv_hello(again)
    again.sendall(proof + frame)
    assert again.recv(auth.ANSWER_SIZE) == auth.REFUSED
    assert closed_by_server(again, 10)
    again.close()
    assert metric(node, "checkpoint", "bad_frame") >= before + 1


# --- resources ---------------------------------------------------------------------------------------
def test_stalled_and_oversized_requests_cost_no_memory_and_are_cut_off(job: Job) -> None:
    """Half a handshake, half a frame, 64 MiB announced and never sent (a commit's metadata,
    a replica): nothing is allocated ahead, the job saves on, and every such connection is
    closed by the service after its timeout, its thread freed and its file gone."""
    node = job.nodes[0]
    rss = rss_mib(node.pid)
    held: list[tuple[str, socket.socket]] = []
    for _ in range(4):  # silent strangers (the handshake times out)
        held.append(("silent", connect(node)))
    for _ in range(2):  # half a TLS ClientHello
        s = connect(node)
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 20)
        held.append(("half a TLS hello", s))
    for _ in range(2):  # TLS with the job's certificate, then half a proof
        s = sealed(node, job.key)
        auth.recv_hello(s)
        s.sendall(b"\0" * 20)
        held.append(("half a proof", s))
    for _ in range(2):  # half a frame's prefix, then silence
        ch = authenticated(node, job.key)
        ch.sock.sendall(b"\0" * 8)
        held.append(("half a frame", ch.sock))
    cid = newest_committed(node, job.key)[0]
    for i in range(4):  # a commit announcing 64 MiB of metadata, 1 KiB sent
        ch = authenticated(node, job.key)
        head = {"op": "commit", "id": cid + 100 + i, "required": {"__0.mem": 1}, "step": 1}
        ch.sock.sendall(ch.head(head, 64 * MiB, wire.SEALED) + b"\0" * 1024)
        held.append(("64 MiB commit", ch.sock))
    for i in range(2):  # a replica announcing 64 MiB, 1 MiB sent
        ch = authenticated(node, job.key)
        put = {"op": "put", "id": cid + 100, "name": f"__9{i}.mem", "from": job.nodes[1].endpoint}
        ch.send_header(put, 64 * MiB)
        ch.sock.sendall(b"\0" * MiB)
        held.append(("64 MiB replica", ch.sock))
    began = time.monotonic()
    job.saves_go_on(3)
    grown = rss_mib(node.pid) - rss
    assert grown < 48, f"the agent grew by {grown:.0f} MiB while 6 x 64 MiB were announced"
    for what, s in held:
        left = LIMITS.io_timeout + 20 - (time.monotonic() - began)
        assert closed_by_server(s, max(1.0, left)), (
            f"{what}: still open after {time.monotonic() - began:.0f} s"
        )
        s.close()
    # only the strangers' names: the job's own replicas may be in flight as it saves on
    assert not list(job.shm.rglob(".__9[01].mem.*.part")), "a broken-off replica's file was left"
    # cut off for silence, or sooner: past the handshakes one address may hold, or past the memory limit
    cut = metric(node, "checkpoint", "timeout") + metric(node, "checkpoint", "over_capacity")
    assert cut >= len(held), cut
    job.saves_go_on(2)


def test_connection_floods_are_bounded_and_the_job_saves_through_them(job: Job) -> None:
    node = job.nodes[1]
    base = threads(node.pid)
    strangers = []
    for _ in range(LIMITS.handshakes * 4):
        strangers.append(connect(node))
    peers = [authenticated(node, job.key) for _ in range(LIMITS.connections + 40)]
    time.sleep(1.0)
    assert threads(node.pid) <= base + LIMITS.connections + LIMITS.handshakes + 8, threads(node.pid)
    job.saves_go_on(3)
    # the strangers beyond the handshake cap were cut off at once, the oldest idle peers too
    cut = closed_among(strangers, 1.0)
    assert cut >= len(strangers) - LIMITS.handshakes, cut
    assert closed_among([p.sock for p in peers], 1.0) >= 40
    assert metric(node, "checkpoint", "over_capacity") >= len(strangers) - LIMITS.handshakes
    for s in strangers:
        s.close()
    for p in peers:
        p.sock.close()
    job.saves_go_on(2)


def test_the_health_port_stays_answering_through_a_flood(job: Job) -> None:
    node = job.nodes[0]
    base = threads(node.pid)
    silent = [socket.create_connection(("127.0.0.1", node.health), timeout=5) for _ in range(100)]
    time.sleep(0.5)
    # a thread and a deadline timer per connection held, at most 32 connections
    assert threads(node.pid) <= base + 2 * 32 + 4, threads(node.pid)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.health}/healthz", timeout=10) as r:
        assert r.status == 200
    assert metric(node, "health", "over_capacity") >= 1
    for s in silent:
        s.close()


# --- and the job restores normally ----------------------------------------------------------------
def test_after_the_attacks_a_failed_rank_restores_bit_identical(job: Job) -> None:
    victim = job.nodes[1]
    workers = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and _ppid(int(p.name)) == victim.pid
        and b"ckpt_worker.py" in _cmdline(int(p.name))
    ]
    assert workers, "no worker of node-b found"
    restores = sum(e["event"] == "restored" for e in job.events())
    os.kill(workers[0], signal.SIGKILL)
    job.cluster.wait_for(
        "a restore", lambda: sum(e["event"] == "restored" for e in job.events()) > restores, 180
    )
    restored = [e for e in job.events() if e["event"] == "restored"][-1]
    assert restored["source"] == "memory", restored
    saved = job.saved()
    if restored["step"] in saved:
        assert restored["hash"] == saved[restored["step"]], restored
    else:  # committed as the rank died, before rank 0 could log it
        assert restored["step"] == max(s for s in saved if s < restored["step"]) + 1, (restored, max(saved))
    job.saves_go_on(2)
    hashes: dict[int, set[str]] = {}
    for e in job.events():
        if e["event"] in ("saved", "restored"):
            hashes.setdefault(e["step"], set()).add(e["hash"])
    assert all(len(h) == 1 for h in hashes.values()), "a step saved or restored with two different states"
    assert not job.marker.exists(), "code ran from an attacker's bytes"


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""

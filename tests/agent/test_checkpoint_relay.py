"""A relay between two real checkpoint services: it learns nothing and changes nothing.

Two real :class:`CheckpointService`\\ s share a job secret (real sockets on loopback). The
relay is a TCP forwarder of the test's own that records every byte it passes and may flip
one. Three places it can take:

* **on the ring**, under an endpoint of its own, forwarding to another node's service
  (what a stranger who got its address into the ring would do): the client finds that the
  service it reached answers as another node and sends nothing;
* **on the path** to the service meant (a relay the connection was routed through): the
  replica goes through, and the relay saw none of its bytes in clear;
* on the path, **changing one byte**, either way: the request fails, nothing altered is
  kept or handed on;
* on the path, **cutting the connection off** in the middle of a replica (a reset to the
  sender): the upload fails with the connection's error, nothing is kept.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kelastic.agent import auth, tls
from kelastic.agent.checkpoint import wire
from kelastic.agent.checkpoint.client import ServiceClient, parse_endpoint
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings, ServiceLimits
from kelastic.agent.secret import JobSecret, SecretSource

KEY = os.urandom(32).hex().encode()
MiB = 2**20
#: The weights: recognisable in any 64-byte window of a recording.
PATTERN = (b"kelastic-weights-in-clear:" + bytes(range(38))) * 16384


class Relay:
    """Forwards every connection to ``target``, records both directions, and flips the
    byte at ``flip`` (client->server, or server->client with ``back``) of each stream; with
    ``cut``, stops reading the client after that many bytes and resets its connection."""

    def __init__(
        self, target: str, flip: int | None = None, back: bool = False, cut: int | None = None
    ) -> None:
        self.target = parse_endpoint(target)
        self.flip, self.back, self.cut = flip, back, cut
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            flip_fwd = self.flip if not self.back else None
            flip_back = self.flip if self.back else None
            threading.Thread(target=self._pump, args=(a, b, flip_fwd, self.cut), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, flip_back), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: int | None, cut: int | None = None) -> None:
        at = 0
        try:
            while data := src.recv(65536 if cut is None else min(65536, cut - at)):
                if flip is not None and at <= flip < at + len(data):
                    data = bytearray(data)
                    data[flip - at] ^= 0x01
                    data = bytes(data)
                at += len(data)
                with self._lock:
                    self.seen += data
                dst.sendall(data)
                if cut is not None and at >= cut:
                    # Unread bytes and no linger: closing resets the connection.
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    src.close()
                    break
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def service(root: Path, name: str) -> CheckpointService:
    limits = ServiceLimits(handshake_timeout=5, io_timeout=5)
    settings = CheckpointSettings(root=root / name, limit=64 * MiB, node=name)
    return CheckpointService(
        settings, JobSecret(KEY, SecretSource.FILE), host="127.0.0.1", limits=limits
    ).start()


Nodes = tuple[CheckpointService, CheckpointService, Path]


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    root = Path("/dev/shm") / f"kelastic-relay-{uuid.uuid4().hex[:8]}"
    a, b = service(root, "node-a"), service(root, "node-b")
    part = root / "part"
    part.write_bytes(PATTERN)
    yield a, b, part
    a.stop()
    b.stop()
    shutil.rmtree(root, ignore_errors=True)


def via(relay: Relay, meant: str) -> ServiceClient:
    """A client of the service ``meant`` whose connection is routed through ``relay`` (an
    on-path relay: what the client dials is the relay, what it expects is ``meant``)."""
    client = ServiceClient(meant, KEY, timeout=5)
    sock = tls.client_context(KEY).wrap_socket(
        socket.create_connection(parse_endpoint(relay.endpoint), timeout=5)
    )
    session = auth.client_handshake(sock, KEY, auth.Service.CHECKPOINT, meant)
    client._channel = wire.Channel(sock, session, io_timeout=5, max_header=ServiceLimits().max_header)
    return client


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def holds(s: CheckpointService, name: str) -> bool:
    return any(name in h.files for h in s.keeper.inventory().held)


def in_clear(seen: bytes) -> bool:
    return PATTERN[:64] in seen or PATTERN[4096:4160] in seen


def test_a_relay_on_the_ring_that_forwards_to_another_node_is_found_out(nodes: Nodes) -> None:
    a, b, part = nodes
    relay = Relay(b.endpoint)
    a.set_ring([a.endpoint, relay.endpoint])  # the relay got onto the ring
    client = a.client(relay.endpoint)  # what a's replication to its successor uses
    with pytest.raises(CheckpointError, match=r"answered as '127\.0\.0\.1:\d+', another node"):
        client.put_file(1, "__0.mem", part, len(PATTERN))
    client.close()
    relay.close()
    assert not holds(b, "__0.mem")
    assert len(relay.seen) > 0 and not in_clear(bytes(relay.seen))


def test_a_relay_on_the_path_sees_no_byte_of_the_weights_in_clear(nodes: Nodes) -> None:
    _, b, part = nodes
    relay = Relay(b.endpoint)
    client = via(relay, b.endpoint)
    client.put_file(1, "__0.mem", part, len(PATTERN))
    into = memoryview(bytearray(len(PATTERN)))
    client.call({"op": "get", "id": 1, "name": "__0.mem", "offset": 0, "length": len(PATTERN)}, into=into)
    client.close()
    relay.close()
    assert bytes(into) == PATTERN
    assert (b.keeper.path_of(1, "__0.mem")).read_bytes() == PATTERN
    assert len(relay.seen) > 2 * len(PATTERN), "the relay did not carry the replica and its read"
    assert not in_clear(bytes(relay.seen)), "the relay saw the weights in clear"


@pytest.mark.parametrize("at", [3000, 600 * 1024])
def test_a_relay_that_changes_one_byte_of_an_upload_fails_the_request(nodes: Nodes, at: int) -> None:
    """One bit flipped in the client's stream, in the handshakes or in the middle of the
    replica: the request fails and the service keeps nothing of it."""
    _, b, part = nodes
    relay = Relay(b.endpoint, flip=at)
    with pytest.raises((CheckpointError, OSError)):
        client = via(relay, b.endpoint)
        client.put_file(1, "__0.mem", part, len(PATTERN))
    relay.close()
    assert not holds(b, "__0.mem")
    assert wait_until(lambda: not list(b.keeper.root.rglob("*.part")), 10), "a broken-off replica was left"
    assert not holds(b, "__0.mem")


def test_a_relay_that_cuts_an_upload_off_fails_it_with_the_connections_error(nodes: Nodes) -> None:
    """The connection reset in the middle of a replica the client is still sending (a peer
    that stopped, a relay that cut it off): the upload fails with the connection's error,
    as the callers expect it, and the service keeps nothing of it."""
    _, b, part = nodes
    big = part.with_name("big")
    big.write_bytes(PATTERN * 16)  # more than the sockets on the way buffer: the client still sends
    relay = Relay(b.endpoint, cut=len(PATTERN))
    client = via(relay, b.endpoint)
    with pytest.raises(CheckpointError, match=r"sending __0\.mem of checkpoint 1"):
        client.put_file(1, "__0.mem", big, 16 * len(PATTERN))
    relay.close()
    assert wait_until(lambda: not list(b.keeper.root.rglob("*.part")), 10), "a broken-off replica was left"
    assert not holds(b, "__0.mem")


def test_a_relay_that_changes_one_byte_of_a_read_fails_it(nodes: Nodes) -> None:
    _, b, part = nodes
    ServiceClient(b.endpoint, KEY, timeout=5).put_file(1, "__0.mem", part, len(PATTERN))
    relay = Relay(b.endpoint, flip=600 * 1024, back=True)
    client = via(relay, b.endpoint)
    channel = client._channel
    assert channel is not None
    into = memoryview(bytearray(len(PATTERN)))
    channel.send({"op": "get", "id": 1, "name": "__0.mem", "offset": 0, "length": len(PATTERN)})
    reply = channel.recv_header()
    assert reply is not None and reply.header["ok"]
    with pytest.raises(ssl.SSLError, match=r"BAD_RECORD_MAC|DECRYPTION_FAILED|bad record mac"):
        channel.recv_payload_into(reply, into)  # a client's call fails this and reconnects
    client.close()
    relay.close()

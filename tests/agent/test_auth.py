"""kelastic.agent.auth: the handshake and the per-message MAC, over real socket pairs."""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kelastic.agent import auth

KEY = secrets.token_hex(32).encode()


NODE = "10.0.0.1:4000"


def both(
    server_key: bytes,
    client_key: bytes,
    service: auth.Service = auth.Service.CHECKPOINT,
    *,
    meant: str | None = NODE,
    server_is: str = NODE,
) -> tuple[Any, Any]:
    """Run the two handshakes over a socket pair: each side's session or exception."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    out: dict[str, Any] = {}

    def run(name: str, f: Callable[[], Any]) -> None:
        try:
            out[name] = f()
        except Exception as e:
            out[name] = e

    t = threading.Thread(
        target=run, args=("server", lambda: auth.server_handshake(a, server_key, service, server_is))
    )
    t.start()
    run("client", lambda: auth.client_handshake(b, client_key, service, meant))
    b.close()  # a client that gave up hangs up
    t.join(5)
    a.close()
    return out["server"], out["client"]


def test_both_ends_prove_the_key_and_share_a_session() -> None:
    server, client = both(KEY, KEY)
    assert isinstance(server, auth.Session) and isinstance(client, auth.Session)
    tag = client.seal(b"header")
    server.open(tag, b"header")
    server.open(client.seal(b"second"), b"second")
    client.open(server.seal(b"reply"), b"reply")


def test_a_wrong_key_is_refused_and_the_client_is_told_which_side_lacks_it() -> None:
    server, client = both(KEY, b"x" * 64)
    assert isinstance(server, auth.AuthError) and "did not prove" in str(server)
    assert isinstance(client, auth.AuthError) and "refused this process's proof" in str(client)


def test_a_client_that_reached_another_node_than_it_meant_refuses_before_proving() -> None:
    """A relay at one endpoint forwarding to the service of another node of the job: the
    hello names the other node, the client refuses and never sends a proof."""
    server, client = both(KEY, KEY, meant="10.0.0.66:4000", server_is=NODE)
    assert isinstance(client, auth.AuthError) and "answered as '10.0.0.1:4000'" in str(client)
    assert isinstance(server, auth.AuthError)  # closed without a proof


def test_a_hello_whose_identity_was_rewritten_fails_the_answer() -> None:
    """An on-path relay that rewrites the identity in the hello (to the one the client
    meant) is caught by the answer's MAC, which covers the server's own identity."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    out: list[Any] = []

    def serve() -> None:
        ns = secrets.token_bytes(auth.NONCE_SIZE)
        a.sendall(auth.hello(auth.Service.CHECKPOINT, ns, "10.0.0.66:4000"))  # the relay's rewrite
        proof = a.recv(auth.PROOF_SIZE)
        try:
            auth.verify_proof(KEY, auth.Service.CHECKPOINT, ns, proof, NODE)  # the real server
        except auth.AuthError as e:
            out.append(e)
        a.sendall(auth.REFUSED)

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(auth.AuthError):
        auth.client_handshake(b, KEY, auth.Service.CHECKPOINT, "10.0.0.66:4000")
    t.join(5)
    assert out and "for this node" in str(out[0])


def test_a_proof_for_one_service_is_worthless_for_another() -> None:
    a, b = socket.socketpair()
    a.sendall(auth.hello(auth.Service.PEER_LINK, secrets.token_bytes(auth.NONCE_SIZE), NODE))
    b.settimeout(5)
    with pytest.raises(auth.AuthError, match="peer_link, not its checkpoint"):
        auth.client_handshake(b, KEY, auth.Service.CHECKPOINT, NODE)
    a.close()
    b.close()


def test_a_stranger_that_speaks_something_else_is_not_a_kelastic_service() -> None:
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\0" * 20)
    b.settimeout(5)
    with pytest.raises(auth.AuthError, match="not a kelastic service"):
        auth.client_handshake(b, KEY, auth.Service.CHECKPOINT, NODE)


def test_a_captured_proof_does_not_open_another_connection() -> None:
    """Replay of a whole captured handshake: the server's fresh nonce makes it worthless."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    t = threading.Thread(target=lambda: auth.server_handshake(a, KEY, auth.Service.CHECKPOINT, NODE))
    t.start()
    hello_msg = auth.recv_hello(b)
    proof, _, _ = auth.prove(KEY, auth.Service.CHECKPOINT, hello_msg, NODE)
    b.sendall(proof)
    b.recv(auth.ANSWER_SIZE)
    t.join(5)
    # a second connection, answered with the captured proof
    c, d = socket.socketpair()
    c.settimeout(5)
    d.settimeout(5)
    got: list[Any] = []

    def serve() -> None:
        try:
            got.append(auth.server_handshake(c, KEY, auth.Service.CHECKPOINT, NODE))
        except auth.AuthError as e:
            got.append(e)

    t2 = threading.Thread(target=serve)
    t2.start()
    auth.recv_hello(d)
    d.sendall(proof)
    assert d.recv(auth.ANSWER_SIZE) == auth.REFUSED
    t2.join(5)
    assert isinstance(got[0], auth.AuthError)


def test_messages_cannot_be_replayed_reordered_reflected_or_changed() -> None:
    server, client = both(KEY, KEY)
    client.seal(b"one")
    with pytest.raises(auth.AuthError):
        server.open(client.seal(b"two"), b"two")  # out of order: "one" never arrived
    server, client = both(KEY, KEY)
    tag = client.seal(b"one")
    server.open(tag, b"one")
    with pytest.raises(auth.AuthError):
        server.open(tag, b"one")  # the same message again
    server, client = both(KEY, KEY)
    with pytest.raises(auth.AuthError):
        server.open(server.seal(b"ok"), b"ok")  # sent back to its sender
    server, client = both(KEY, KEY)
    with pytest.raises(auth.AuthError):
        server.open(client.seal(b"x"), b"y")  # changed on the way


def test_refusals_are_counted_by_service_and_reason() -> None:
    c = auth.RefusalCounter()
    c.count("checkpoint", auth.Reason.UNAUTHENTICATED)
    c.count("checkpoint", auth.Reason.UNAUTHENTICATED)
    c.count("peer_link", auth.Reason.TIMEOUT)
    assert c.snapshot() == {("checkpoint", "unauthenticated"): 2, ("peer_link", "timeout"): 1}
    assert c.total("checkpoint") == 2 and c.total(reason=auth.Reason.TIMEOUT) == 1

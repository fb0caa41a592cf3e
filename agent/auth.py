"""How kelastic's own protocols authenticate: a mutual challenge-response per connection
that also names the node the client meant, then a MAC on every message.

Both ends hold the job's key K (:mod:`kelastic.agent.secret`). A connection begins with
a handshake in which the server speaks first (on the checkpoint service inside TLS,
:mod:`kelastic.agent.tls`)::

    server -> client  HELLO   "KELASTIC" | version | service | Ns | n | I       (43 + n bytes)
    client -> server  PROOF   Nc | HMAC(K, "client" | service | Ns | Nc | I)    (64 bytes)
    server -> client  ANSWER  HMAC(K, "server" | service | Ns | Nc | I)         (32 bytes)

``Ns`` and ``Nc`` are 32 random bytes each (``secrets``), ``service`` names the protocol
(a proof for one service is worthless for another), ``I`` is the server's identity (its
endpoint ``HOST:PORT`` as the round's ring and join records name it; ``n`` its length, at
most 255 bytes), every HMAC is HMAC-SHA256 with its own label. The client checks that
``I`` is the node it meant before it proves anything (a relay that forwards the
connection to another node of the job is found out here), and its proof covers the
identity it meant. The server checks the client's proof (over its own identity) before it
reads anything else; a wrong one gets :data:`REFUSED` instead of an answer and the
connection is closed. The client checks the server's answer, which covers ``I``, before
it trusts a reply (an impostor service learns nothing: it never sees a proof it could
reuse, since every proof covers its own ``Ns``).

Both ends then derive one key per direction from both nonces (:class:`Session`); every
message carries ``HMAC(direction key, sequence number | message)``, the sequence number
counted per direction from 0. So a captured message cannot be replayed: not on another
connection (other nonces, other keys), not twice or out of order on its own (another
sequence number), not back to its sender (the other direction's key).

Costs are per connection (a round trip and four HMACs) and per message (one HMAC of its
header), never per byte of bulk data unless the caller seals it (:mod:`kelastic.agent.
checkpoint.wire` says which payloads are sealed).

:data:`REFUSALS` counts what kelastic's services turned away, by service and reason; the
agent exports it on ``/metrics`` (``kelastic_agent_refused_total``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
from dataclasses import dataclass
from enum import Enum, IntEnum

__all__ = [
    "ANSWER_SIZE",
    "HELLO_SIZE",
    "MAX_IDENTITY",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "REFUSALS",
    "REFUSED",
    "TAG_SIZE",
    "AuthError",
    "HandshakeClosed",
    "Hello",
    "Reason",
    "RefusalCounter",
    "SecretMismatch",
    "Service",
    "Session",
    "answer",
    "check_answer",
    "client_handshake",
    "hello",
    "prove",
    "read_hello",
    "recv_hello",
    "server_handshake",
    "verify_proof",
]

MAGIC = b"KELASTIC"
VERSION = 2
NONCE_SIZE = 32
TAG_SIZE = 32
#: The hello's fixed part; the server's identity (``n`` bytes, its last byte) follows it.
HELLO_SIZE = len(MAGIC) + 2 + NONCE_SIZE + 1
#: The longest identity a hello carries.
MAX_IDENTITY = 255
PROOF_SIZE = NONCE_SIZE + TAG_SIZE
ANSWER_SIZE = TAG_SIZE
#: Sent instead of an answer when the client's proof was wrong (then the server closes).
REFUSED = b"KELASTIC:REFUSED".ljust(ANSWER_SIZE, b"\x00")


class Service(IntEnum):
    """The protocols that authenticate this way (a proof is bound to one)."""

    CHECKPOINT = 1
    PEER_LINK = 2


class AuthError(ConnectionError):
    """The other end did not prove the job's key (or is not a kelastic service at all)."""


class SecretMismatch(AuthError):
    """Both ends speak kelastic's protocol, but they do not hold the same key: the other end
    refused this end's proof, or could not prove this end's key."""


class HandshakeClosed(AuthError):
    """The other end closed the connection before the handshake was over (it may be gone)."""


def _mac(key: bytes, label: bytes, service: Service, ns: bytes, nc: bytes, identity: bytes = b"") -> bytes:
    msg = b"kelastic-v2 " + label + bytes([service]) + ns + nc + bytes([len(identity)]) + identity
    return hmac.digest(key, msg, "sha256")


def _identity(identity: str) -> bytes:
    raw = identity.encode()
    if len(raw) > MAX_IDENTITY:
        raise ValueError(f"a service identity is at most {MAX_IDENTITY} bytes: {identity!r}")
    return raw


# --- the handshake's messages (pure; the socket helpers below and PeerLink's event loop use them)
def hello(service: Service, ns: bytes, identity: str) -> bytes:
    """The server's first message: it names the server as ``identity`` (its endpoint)."""
    raw = _identity(identity)
    return MAGIC + bytes([VERSION, service]) + ns + bytes([len(raw)]) + raw


@dataclass(frozen=True)
class Hello:
    """A server's hello as the client read it."""

    ns: bytes
    identity: str


def read_hello(service: Service, hello_msg: bytes) -> Hello:
    """The client's reading of a whole hello; AuthError when it is not one of ``service``'s."""
    if len(hello_msg) < HELLO_SIZE or not hello_msg.startswith(MAGIC):
        raise AuthError("the other end is not a kelastic service (no kelastic hello)")
    version, got = hello_msg[len(MAGIC)], hello_msg[len(MAGIC) + 1]
    if version != VERSION:
        raise AuthError(f"the other end speaks kelastic protocol version {version}, this one {VERSION}")
    if got != service:
        raise AuthError(f"the other end is kelastic's {_name(got)}, not its {service.name.lower()}")
    if len(hello_msg) != HELLO_SIZE + hello_msg[HELLO_SIZE - 1]:
        raise AuthError("a kelastic hello of the wrong length")
    ns = hello_msg[len(MAGIC) + 2 : len(MAGIC) + 2 + NONCE_SIZE]
    return Hello(ns, hello_msg[HELLO_SIZE:].decode(errors="replace"))


def prove(key: bytes, service: Service, hello_msg: bytes, expect: str | None) -> tuple[bytes, bytes, bytes]:
    """The client's answer to ``hello_msg``: (PROOF message, Ns, Nc). AuthError when the
    hello is not one of ``service``'s or names another node than ``expect`` (the endpoint
    the client meant; None: whichever answers)."""
    h = read_hello(service, hello_msg)
    if expect is not None and h.identity != expect:
        raise AuthError(
            f"the {service.name.lower()} reached at {expect} answered as {h.identity!r}, another node: "
            "something between them relays the connection; refused"
        )
    nc = secrets.token_bytes(NONCE_SIZE)
    return nc + _mac(key, b"client", service, h.ns, nc, _identity(h.identity)), h.ns, nc


def verify_proof(
    key: bytes, service: Service, ns: bytes, proof_msg: bytes, identity: str
) -> tuple[bytes, Session]:
    """The server's check of a PROOF (made for this server, ``identity``): (ANSWER message,
    the session). AuthError when wrong."""
    if len(proof_msg) != PROOF_SIZE:
        raise AuthError("short proof")
    nc, tag = proof_msg[:NONCE_SIZE], proof_msg[NONCE_SIZE:]
    if not hmac.compare_digest(tag, _mac(key, b"client", service, ns, nc, _identity(identity))):
        raise AuthError("the client did not prove the job's secret (for this node)")
    return answer(key, service, ns, nc, identity), Session.derive(key, service, ns, nc, server=True)


def answer(key: bytes, service: Service, ns: bytes, nc: bytes, identity: str) -> bytes:
    return _mac(key, b"server", service, ns, nc, _identity(identity))


def check_answer(
    key: bytes, service: Service, ns: bytes, nc: bytes, answer_msg: bytes, identity: str
) -> Session:
    """The client's check of the server's ANSWER (for the server named ``identity`` in its
    hello); AuthError (saying which side lacks the key) when wrong."""
    if answer_msg == REFUSED:
        raise SecretMismatch(
            "the service refused this process's proof: the two do not hold the same job secret "
            "(--job-secret-file)"
        )
    if not hmac.compare_digest(answer_msg, answer(key, service, ns, nc, identity)):
        raise SecretMismatch("the service did not prove the job's secret: it is not one of this job's agents")
    return Session.derive(key, service, ns, nc, server=False)


def _name(service: int) -> str:
    try:
        return Service(service).name.lower()
    except ValueError:
        return f"service {service}"


#: Messages up to this size are MAC'd in one call (a copy is cheaper than an incremental HMAC).
_ONE_SHOT = 64 * 2**10


class Session:
    """The per-connection keys and sequence numbers of one end (not thread-safe: one
    connection, one reader and one writer at a time, as the framing uses it)."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send_key = send_key
        self._recv_key = recv_key
        self._sent = 0
        self._received = 0

    @classmethod
    def derive(cls, key: bytes, service: Service, ns: bytes, nc: bytes, *, server: bool) -> Session:
        to_server = _mac(key, b"client->server", service, ns, nc)
        to_client = _mac(key, b"server->client", service, ns, nc)
        return cls(to_client, to_server) if server else cls(to_server, to_client)

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The tag of the next outgoing message, made of ``parts``."""
        seq = self._sent.to_bytes(8, "big")
        self._sent += 1
        if sum(len(p) for p in parts) <= _ONE_SHOT:
            return hmac.digest(self._send_key, b"".join((seq, *parts)), "sha256")
        h = hmac.new(self._send_key, seq, hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def incoming(self) -> hmac.HMAC:
        """A MAC to feed the next incoming message to, then :meth:`verify` its tag."""
        h = hmac.new(self._recv_key, self._received.to_bytes(8, "big"), hashlib.sha256)
        self._received += 1
        return h

    def open(self, tag: bytes, *parts: bytes | bytearray | memoryview) -> None:
        """Check the tag of the next incoming message made of ``parts``; AuthError if wrong."""
        if sum(len(p) for p in parts) <= _ONE_SHOT:
            seq = self._received.to_bytes(8, "big")
            self._received += 1
            if not hmac.compare_digest(hmac.digest(self._recv_key, b"".join((seq, *parts)), "sha256"), tag):
                raise AuthError("a message failed its MAC: altered, replayed or out of order")
            return
        h = self.incoming()
        for p in parts:
            h.update(p)
        self.verify(h, tag)

    @staticmethod
    def verify(h: hmac.HMAC, tag: bytes) -> None:
        if not hmac.compare_digest(h.digest(), tag):
            raise AuthError("a message failed its MAC: altered, replayed or out of order")


# --- blocking handshakes on sockets (with the socket's own timeout) -----------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise HandshakeClosed("the other end closed the connection during the handshake")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes, service: Service, identity: str) -> Session:
    """Authenticate the client on ``sock`` (the server's side, named ``identity``). AuthError
    when it fails; TimeoutError when the client is silent past the socket's timeout."""
    ns = secrets.token_bytes(NONCE_SIZE)
    sock.sendall(hello(service, ns, identity))
    proof = _recv_exact(sock, PROOF_SIZE)
    try:
        reply, session = verify_proof(key, service, ns, proof, identity)
    except AuthError:
        try:
            sock.sendall(REFUSED)
        except OSError:
            pass
        raise
    sock.sendall(reply)
    return session


def recv_hello(sock: socket.socket) -> bytes:
    """A whole hello from ``sock`` (its fixed part, then the identity it announces)."""
    head = _recv_exact(sock, HELLO_SIZE)
    if not head.startswith(MAGIC):
        return head  # prove() says what it is not
    return head + (_recv_exact(sock, head[-1]) if head[-1] else b"")


def client_handshake(sock: socket.socket, key: bytes, service: Service, expect: str | None) -> Session:
    """Authenticate to the server on ``sock``, check that it is ``expect`` (the endpoint
    meant; None: any) and that it holds the key too."""
    msg = recv_hello(sock)
    proof, ns, nc = prove(key, service, msg, expect)
    sock.sendall(proof)
    identity = read_hello(service, msg).identity
    return check_answer(key, service, ns, nc, _recv_exact(sock, ANSWER_SIZE), identity)


# --- what the services refused ------------------------------------------------------------------
class Reason(str, Enum):
    """Why a service turned a connection or a request away."""

    #: No (or a wrong) proof of the job's secret.
    UNAUTHENTICATED = "unauthenticated"
    #: A message that failed its MAC or the framing (after a good handshake).
    BAD_FRAME = "bad_frame"
    #: An authenticated request out of range, of an unknown kind or against a rule.
    BAD_REQUEST = "bad_request"
    #: Silent too long: in the handshake, in the middle of a message, or idle.
    TIMEOUT = "timeout"
    #: More connections than the service takes at once.
    OVER_CAPACITY = "over_capacity"


class RefusalCounter:
    """Refusals by (service, reason), thread-safe; one per process (:data:`REFUSALS`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def count(self, service: str, reason: Reason) -> None:
        with self._lock:
            k = (service, reason.value)
            self._counts[k] = self._counts.get(k, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def total(self, service: str | None = None, reason: Reason | None = None) -> int:
        return sum(
            n
            for (s, r), n in self.snapshot().items()
            if (service is None or s == service) and (reason is None or r == reason.value)
        )


#: Every refusal of this process's services (the checkpoint service, the peer link, /metrics).
REFUSALS = RefusalCounter()

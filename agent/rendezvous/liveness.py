"""Dead-node detection: heartbeat counters judged by the observer's own clock, and peer links
(authenticated with the job's secret, bounded).

Each node increments its ``hb/<name>`` counter every keep-alive interval. An
observer remembers the last value it read for a peer and when (its monotonic
clock) that value last moved; a value that has not moved for ``timeout`` seconds
means the peer is dead. Clocks of different machines are never compared.
"""

from __future__ import annotations

import logging
import random
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kelastic.agent import auth

__all__ = ["MAX_PEERS", "MAX_PROVING", "PROOF_TIMEOUT", "SERVICE", "HeartbeatTracker", "PeerLink"]

log = logging.getLogger(__name__)

#: The peer link's name in :data:`kelastic.agent.auth.REFUSALS` and ``/metrics``.
SERVICE = "peer_link"
#: Connections that may be proving the job's key at once (a new one replaces the oldest).
MAX_PROVING = 16
#: Seconds a connection may take to prove the key (either side).
PROOF_TIMEOUT = 5.0
#: Authenticated connections a node keeps (its predecessor's, and a few while rounds change).
MAX_PEERS = 32
#: Seconds (about; jittered) before a connect that gave no verdict is tried again.
RETRY_AFTER = 1.0


class HeartbeatTracker:
    """Remembers, per peer, the last heartbeat value seen, since when and how often.

    ``min_readings``: a peer is judged dead only after the observer read the same
    value that many times. An observer that was itself stalled (its reads came
    late, like the peer's beats) has few readings of the window and judges nobody
    on them; without this, a loaded machine turns its own stall into deaths.
    """

    def __init__(self, timeout: float, min_readings: int = 1) -> None:
        self.timeout = timeout
        self.min_readings = max(1, min_readings)
        self._seen: dict[str, tuple[int, float, int]] = {}

    def observe(self, name: str, value: int, now: float) -> bool:
        """Record a reading; True if ``name``'s heartbeat has not moved for ``timeout`` s."""
        previous = self._seen.get(name)
        if previous is None or previous[0] != value:
            self._seen[name] = (value, now, 1)
            return False
        readings = previous[2] + 1
        self._seen[name] = (value, previous[1], readings)
        return now - previous[1] >= self.timeout and readings >= self.min_readings

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)

    def retain(self, names: set[str]) -> None:
        """Drop peers no longer watched, so a later watch starts a fresh timer."""
        for name in list(self._seen):
            if name not in names:
                del self._seen[name]


class PeerLink:
    """Notices at once when the watched peer's process exits, through a TCP connection to it.

    Every node listens on ``host`` (port chosen by the OS, published in its join
    record) and keeps what it accepted while it lives. A node keeps one connection to
    the peer it watches; when that peer's process dies the kernel closes its sockets,
    the connection reads EOF (or the connect is refused) and ``on_lost(round, name)``
    runs on the link's watching thread. A peer that vanishes without closing its sockets (a lost
    machine) is left to the heartbeat timeout.

    Both ends prove the job's ``key`` when a connection opens (:mod:`kelastic.agent.auth`,
    service ``PEER_LINK``; the hello names this node by the address and port of its join
    record, and the watcher checks that it reached the node it meant, so a relay that
    forwards the link to another node gives no verdict), the listening side without ever
    blocking on a stranger: at
    most :data:`MAX_PROVING` connections may be proving it at once (a new one replaces the
    oldest), each for at most :data:`PROOF_TIMEOUT` seconds, and at most :data:`MAX_PEERS`
    authenticated ones are kept (the predecessor's, and a few of earlier rounds while it
    moves on); anything else is closed and counted in :data:`kelastic.agent.auth.REFUSALS`
    (service ``peer_link``). A peer that does not prove the key when this node connects
    gives no verdict on its life (the heartbeat still applies); one that holds another
    key (:class:`~kelastic.agent.auth.SecretMismatch`) is remembered in :attr:`mismatch`,
    for the handler to fail this node: a job whose agents do not share one secret must
    not train with its checkpoint replicas silently missing.
    """

    def __init__(self, host: str, on_lost: Callable[[int, str], None], key: bytes) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        #: what this node's hello names it: the address and port its join record publishes
        self.identity = f"{host}:{self.port}"
        self._key = key
        self._on_lost = on_lost
        # One wake-up pipe per thread: the listening side's and the watching side's.
        self._serve_wake = socket.socketpair()
        self._watch_wake = socket.socketpair()
        self._lock = threading.Lock()
        self._wanted: tuple[int, str, str, int] | None = None
        self._stopping = False
        #: Why a peer holds another job secret than this node (None: none seen so far).
        self.mismatch: str | None = None
        #: connections proving the key: socket -> (server nonce, proof so far, deadline)
        self._proving: dict[socket.socket, tuple[bytes, bytearray, float]] = {}
        self._peers: set[socket.socket] = set()
        # Two threads, so that the connecting side, which blocks in its handshake, never
        # keeps the listening side from answering: peers that connect to each other at the
        # same moment (every member of a new round connects to its successor at once, and
        # the ring closes) would otherwise each wait for a hello the other cannot send, until
        # the handshake's timeout left them without a link.
        self._threads = [
            threading.Thread(target=self._serve, name=f"kelastic-rdzv-link :{self.port}", daemon=True),
            threading.Thread(target=self._watch, name=f"kelastic-rdzv-link-watch :{self.port}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def watch(self, target: tuple[int, str, str, int] | None) -> None:
        """Watch ``(round, name, addr, port)`` from now on (None: watch nobody)."""
        with self._lock:
            self._wanted = target
        _wake(self._watch_wake[1])

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        _wake(self._serve_wake[1])
        _wake(self._watch_wake[1])
        deadline = time.monotonic() + 3.0
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def connections(self) -> tuple[int, int]:
        """(connections proving the key, authenticated ones) accepted now (for tests)."""
        with self._lock:
            return len(self._proving), len(self._peers)

    def _serve(self) -> None:
        """The listening side's thread: accept, check proofs, keep the authenticated peers."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._serve_wake[0], selectors.EVENT_READ, "wake")
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                for key, _ in sel.select(self._expire(sel)):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if key.data == "accept":
                        self._accept(sel, sock)
                    elif key.data == "wake":
                        sock.recv(4096)
                    elif key.data == "proving":
                        self._prove(sel, sock)
                    elif not _alive(sock):
                        self._forget(sel, sock)
        finally:
            _close_all(sel)
            self._serve_wake[1].close()

    def _watch(self) -> None:
        """The connecting side's thread: one connection to the watched peer; its end is the verdict."""
        sel = selectors.DefaultSelector()
        sel.register(self._watch_wake[0], selectors.EVENT_READ, "wake")
        out: socket.socket | None = None
        current: tuple[int, str, str, int] | None = None
        retry_at: float | None = None  # when to connect again after a try that gave no verdict
        try:
            while True:
                with self._lock:
                    wanted, stopping = self._wanted, self._stopping
                if stopping:
                    return
                due = retry_at is not None and time.monotonic() >= retry_at
                if wanted != current or due:
                    if out is not None:
                        sel.unregister(out)
                        out.close()
                        out = None
                    current, retry_at = wanted, None
                    if current is not None:
                        out, refused = self._connect(current)
                        if refused:
                            self._lost(current)
                            current = None
                        elif out is not None:
                            sel.register(out, selectors.EVENT_READ, "out")
                        elif self.mismatch is None:
                            # No verdict (slow or unreachable): try again, at a moment two
                            # such peers are unlikely to share.
                            retry_at = time.monotonic() + RETRY_AFTER * (0.5 + random.random())
                timeout = None if retry_at is None else max(0.0, retry_at - time.monotonic())
                for key, _ in sel.select(timeout):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if key.data == "wake":
                        sock.recv(4096)
                    elif not _alive(sock):
                        sel.unregister(sock)
                        sock.close()
                        if current is not None:
                            out = None
                            self._lost(current)
                            current = None
        finally:
            _close_all(sel)
            self._watch_wake[1].close()

    # --- the listening side: never blocks on a connection -------------------------------------
    def _accept(self, sel: selectors.BaseSelector, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        ns = secrets.token_bytes(auth.NONCE_SIZE)
        try:
            conn.send(
                auth.hello(auth.Service.PEER_LINK, ns, self.identity)
            )  # < 300 bytes into an empty buffer
        except OSError:
            conn.close()
            return
        while len(self._proving) >= MAX_PROVING:
            oldest = min(self._proving, key=lambda s: self._proving[s][2])
            self._refuse(sel, oldest, auth.Reason.OVER_CAPACITY)
        with self._lock:
            self._proving[conn] = (ns, bytearray(), time.monotonic() + PROOF_TIMEOUT)
        sel.register(conn, selectors.EVENT_READ, "proving")

    def _prove(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        ns, got, _ = self._proving[conn]
        try:
            data = conn.recv(auth.PROOF_SIZE - len(got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._refuse(sel, conn, auth.Reason.UNAUTHENTICATED)
            return
        got += data
        if len(got) < auth.PROOF_SIZE:
            return
        try:
            reply, _session = auth.verify_proof(
                self._key, auth.Service.PEER_LINK, ns, bytes(got), self.identity
            )
        except auth.AuthError:
            try:
                conn.send(auth.REFUSED)
            except OSError:
                pass
            self._refuse(sel, conn, auth.Reason.UNAUTHENTICATED)
            return
        with self._lock:
            del self._proving[conn]
            full = len(self._peers) >= MAX_PEERS
            if not full:
                self._peers.add(conn)
        if full:
            sel.unregister(conn)
            conn.close()
            auth.REFUSALS.count(SERVICE, auth.Reason.OVER_CAPACITY)
            return
        try:
            conn.send(reply)
        except OSError:
            self._forget(sel, conn)
            return
        sel.modify(conn, selectors.EVENT_READ, "in")

    def _expire(self, sel: selectors.BaseSelector) -> float | None:
        """Close the connections whose proof is overdue; seconds until the next is due."""
        now = time.monotonic()
        for conn, (_, _, deadline) in list(self._proving.items()):
            if deadline <= now:
                self._refuse(sel, conn, auth.Reason.TIMEOUT)
        if not self._proving:
            return None
        return max(0.0, min(d for _, _, d in self._proving.values()) - now)

    def _refuse(self, sel: selectors.BaseSelector, conn: socket.socket, reason: auth.Reason) -> None:
        auth.REFUSALS.count(SERVICE, reason)
        self._forget(sel, conn)

    def _forget(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        with self._lock:
            self._proving.pop(conn, None)
            self._peers.discard(conn)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    # --- the connecting side ---------------------------------------------------------------------
    def _connect(self, target: tuple[int, str, str, int]) -> tuple[socket.socket | None, bool]:
        """(connection, refused): refused means nobody listens there any more, the peer is gone.

        Unreachable or slow peers, and peers that do not prove the job's key, give
        (None, False): no verdict, the heartbeat timeout still applies. A connection closed
        in the middle of the handshake is no verdict either (the peer may have been busy):
        a second connect tells whether its process is gone.
        """
        _, name, addr, port = target
        for _attempt in (0, 1):
            try:
                sock = socket.create_connection((addr, port), timeout=1.0)
            except ConnectionRefusedError:
                return None, True
            except OSError:
                return None, False
            try:
                sock.settimeout(PROOF_TIMEOUT)
                auth.client_handshake(sock, self._key, auth.Service.PEER_LINK, f"{addr}:{port}")
            except (auth.HandshakeClosed, ConnectionResetError):
                sock.close()
                continue
            except auth.SecretMismatch as e:
                sock.close()
                self.mismatch = f"its peer link to {name} at {addr}:{port}: {e}"
                return None, False
            except auth.AuthError as e:
                sock.close()
                log.warning("peer link to %s at %s:%d: %s; watching its heartbeat only", name, addr, port, e)
                return None, False
            except OSError:
                sock.close()
                return None, False
            sock.setblocking(False)
            return sock, False
        return None, False

    def _lost(self, target: tuple[int, str, str, int]) -> None:
        with self._lock:
            if self._wanted == target:
                self._wanted = None
        self._on_lost(target[0], target[1])


def _wake(pipe: socket.socket) -> None:
    try:
        pipe.send(b"x")
    except OSError:
        pass


def _close_all(sel: selectors.BaseSelector) -> None:
    """Close every socket registered with ``sel`` (a thread's own wake-up pipe included), then ``sel``."""
    for key in list(sel.get_map().values()):
        if isinstance(key.fileobj, socket.socket):
            key.fileobj.close()
    sel.close()


def _alive(sock: socket.socket) -> bool:
    """Drain what a socket has; False once the other side closed it or it failed."""
    try:
        return bool(sock.recv(4096))
    except BlockingIOError:
        return True
    except OSError:
        return False

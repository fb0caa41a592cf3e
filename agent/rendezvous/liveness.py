"""Dead-node detection: heartbeat counters judged by the observer's own clock, and peer links.

Each node increments its ``hb/<name>`` counter every keep-alive interval. An
observer remembers the last value it read for a peer and when (its monotonic
clock) that value last moved; a value that has not moved for ``timeout`` seconds
means the peer is dead. Clocks of different machines are never compared.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable

__all__ = ["HeartbeatTracker", "PeerLink"]


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
    record) and never closes what it accepted while it lives. A node keeps one
    connection to the peer it watches; when that peer's process dies the kernel
    closes its sockets, the connection reads EOF (or the connect is refused) and
    ``on_lost(round, name)`` runs on the link thread. A peer that vanishes without
    closing its sockets (a lost machine) is left to the heartbeat timeout.
    """

    def __init__(self, host: str, on_lost: Callable[[int, str], None]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._on_lost = on_lost
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._wanted: tuple[int, str, str, int] | None = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"kelastic-rdzv-link :{self.port}", daemon=True
        )
        self._thread.start()

    def watch(self, target: tuple[int, str, str, int] | None) -> None:
        """Watch ``(round, name, addr, port)`` from now on (None: watch nobody)."""
        with self._lock:
            self._wanted = target
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join(timeout=3.0)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        out: socket.socket | None = None
        current: tuple[int, str, str, int] | None = None
        try:
            while True:
                with self._lock:
                    wanted, stopping = self._wanted, self._stopping
                if stopping:
                    return
                if wanted != current:
                    if out is not None:
                        sel.unregister(out)
                        out.close()
                        out = None
                    current = wanted
                    if current is not None:
                        out, refused = self._connect(current)
                        if refused:
                            self._lost(current)
                            current = None
                        elif out is not None:
                            sel.register(out, selectors.EVENT_READ, "out")
                for key, _ in sel.select():
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if key.data == "accept":
                        try:
                            conn, _ = sock.accept()
                        except OSError:
                            continue
                        conn.setblocking(False)
                        sel.register(conn, selectors.EVENT_READ, "in")
                    elif key.data == "wake":
                        sock.recv(4096)
                    elif not _alive(sock):
                        sel.unregister(sock)
                        sock.close()
                        if key.data == "out" and current is not None:
                            out = None
                            self._lost(current)
                            current = None
        finally:
            for key in list(sel.get_map().values()):
                # Every registered object but the wake-up pipe is a socket of ours.
                if key.data != "wake" and isinstance(key.fileobj, socket.socket):
                    key.fileobj.close()
            sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _connect(self, target: tuple[int, str, str, int]) -> tuple[socket.socket | None, bool]:
        """(connection, refused): refused means nobody listens there any more, the peer is gone.

        Unreachable or slow peers give (None, False): no verdict, the heartbeat
        timeout still applies.
        """
        _, _, addr, port = target
        try:
            sock = socket.create_connection((addr, port), timeout=1.0)
        except ConnectionRefusedError:
            return None, True
        except OSError:
            return None, False
        sock.setblocking(False)
        return sock, False

    def _lost(self, target: tuple[int, str, str, int]) -> None:
        with self._lock:
            if self._wanted == target:
                self._wanted = None
        self._on_lost(target[0], target[1])


def _alive(sock: socket.socket) -> bool:
    """Drain what a socket has; False once the other side closed it or it failed."""
    try:
        return bool(sock.recv(4096))
    except BlockingIOError:
        return True
    except OSError:
        return False

"""Which connections the checkpoint service holds, and which one gives way to a new one.

A connection is first *proving* the key (the handshake), then *idle* between requests or
*busy* with one. At most ``handshakes`` prove at once: a new one replaces the oldest (a
stranger cannot keep a real client out by opening connections and saying nothing; a real
client proves within a round trip). At most ``connections`` are authenticated: a newly
authenticated one replaces the one idle longest (its client reconnects on its next request)
or waits for a place; a busy one is never replaced, so no request is cut off half done.

Thread-safe. It never touches a socket itself: it returns the sockets to shut down.
"""

from __future__ import annotations

import socket
import threading
import time
from enum import Enum

__all__ = ["Admission", "State"]


class State(Enum):
    PROVING = "proving"
    IDLE = "idle"
    BUSY = "busy"


class Admission:
    """The connection table of one service; see the module docstring."""

    def __init__(self, connections: int, handshakes: int) -> None:
        self.connections = connections
        self.handshakes = handshakes
        self._cond = threading.Condition()
        #: socket -> (state, since when: time.monotonic())
        self._table: dict[socket.socket, tuple[State, float]] = {}

    def _oldest(self, state: State) -> socket.socket | None:
        found = [(since, s) for s, (st, since) in self._table.items() if st is state]
        return min(found, key=lambda e: e[0])[1] if found else None

    def _count(self, state: State) -> int:
        return sum(1 for st, _ in self._table.values() if st is state)

    def arrive(self, sock: socket.socket) -> list[socket.socket]:
        """Register a new connection (proving); the connections it replaces, to shut down."""
        with self._cond:
            evicted: list[socket.socket] = []
            while self._count(State.PROVING) >= self.handshakes:
                oldest = self._oldest(State.PROVING)
                assert oldest is not None
                del self._table[oldest]
                evicted.append(oldest)
            self._table[sock] = (State.PROVING, time.monotonic())
            return evicted

    def authenticated(self, sock: socket.socket, wait: float) -> tuple[bool, list[socket.socket]]:
        """``sock`` proved the key: (whether it may be served, the connections it replaces).

        False when it was replaced meanwhile or no place freed within ``wait`` seconds.
        """
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if sock not in self._table:
                    return False, []
                authenticated = len(self._table) - self._count(State.PROVING)
                evicted: list[socket.socket] = []
                if authenticated >= self.connections:
                    oldest = self._oldest(State.IDLE)
                    if oldest is not None:
                        del self._table[oldest]
                        evicted.append(oldest)
                        authenticated -= 1
                if authenticated < self.connections:
                    self._table[sock] = (State.IDLE, time.monotonic())
                    return True, evicted
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, []
                self._cond.wait(left)

    def busy(self, sock: socket.socket) -> bool:
        """A request arrived on ``sock``: False when the connection was replaced (drop it)."""
        with self._cond:
            if sock not in self._table:
                return False
            self._table[sock] = (State.BUSY, time.monotonic())
            return True

    def idle(self, sock: socket.socket) -> None:
        with self._cond:
            if sock in self._table:
                self._table[sock] = (State.IDLE, time.monotonic())
                self._cond.notify_all()

    def leave(self, sock: socket.socket) -> bool:
        """``sock`` is closed; False when it had been replaced already."""
        with self._cond:
            held = self._table.pop(sock, None) is not None
            self._cond.notify_all()
            return held

    def sockets(self) -> list[socket.socket]:
        with self._cond:
            return list(self._table)

    def states(self) -> dict[State, int]:
        """How many connections are in each state (for tests and logs)."""
        with self._cond:
            return {st: self._count(st) for st in State}

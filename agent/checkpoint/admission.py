"""Which connections the checkpoint service holds, and which one gives way to a new one.

A connection is first *proving* the key (the handshake), then *idle* between requests or
*busy* with one. At most ``handshakes`` prove at once, and at most a quarter of them from
one source address: a new one replaces the oldest of its address when that has its
quarter, else the oldest of all (a stranger cannot keep a real client out by opening
connections and saying nothing; a real client proves within a round trip). At most
``connections`` are authenticated, and at most an eighth of them from one address that is
not *preferred* (the node's own address and the ring's: its ranks and ring neighbours). A
newly authenticated one replaces the one idle longest, a stranger's before a preferred
one (its client reconnects on its next request); a preferred one, when none is idle,
replaces the longest busy one of an address that is not preferred; otherwise it waits for
a place. A busy connection of a preferred address is never replaced, so none of the job's
own requests is cut off half done.

Thread-safe. It never touches a socket itself: it returns the sockets to shut down.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = ["Admission", "State"]


class State(Enum):
    PROVING = "proving"
    IDLE = "idle"
    BUSY = "busy"


@dataclass
class _Entry:
    state: State
    #: time.monotonic() it entered its state
    since: float
    #: the source address
    source: str
    #: of the node's own address or the ring's
    preferred: bool = False


def _anyone(e: _Entry) -> bool:
    return True


class Admission:
    """The connection table of one service; see the module docstring."""

    def __init__(self, connections: int, handshakes: int) -> None:
        self.connections = connections
        self.handshakes = handshakes
        #: handshakes in progress from one address
        self.per_source_handshakes = max(1, handshakes // 4)
        #: authenticated connections from one address that is not preferred
        self.per_peer = max(1, connections // 8)
        self._cond = threading.Condition()
        self._table: dict[socket.socket, _Entry] = {}

    def _oldest(self, state: State, pick: Callable[[_Entry], bool] = _anyone) -> socket.socket | None:
        found = [(e.since, s) for s, e in self._table.items() if e.state is state and pick(e)]
        return min(found, key=lambda f: f[0])[1] if found else None

    def _count(self, state: State, pick: Callable[[_Entry], bool] = _anyone) -> int:
        return sum(1 for e in self._table.values() if e.state is state and pick(e))

    def arrive(self, sock: socket.socket, source: str = "") -> list[socket.socket]:
        """Register a new connection (proving) from ``source``; the connections it
        replaces, to shut down."""
        with self._cond:
            evicted: list[socket.socket] = []

            def same(e: _Entry) -> bool:
                return e.source == source

            while self._count(State.PROVING, same) >= self.per_source_handshakes:
                oldest = self._oldest(State.PROVING, same)
                assert oldest is not None
                del self._table[oldest]
                evicted.append(oldest)
            while self._count(State.PROVING) >= self.handshakes:
                oldest = self._oldest(State.PROVING)
                assert oldest is not None
                del self._table[oldest]
                evicted.append(oldest)
            self._table[sock] = _Entry(State.PROVING, time.monotonic(), source)
            return evicted

    def _authenticated(self) -> int:
        return len(self._table) - self._count(State.PROVING)

    def _make_room(self, preferred: bool) -> socket.socket | None:
        """The connection a newly authenticated one replaces in a full table, or None."""

        def stranger(e: _Entry) -> bool:
            return not e.preferred

        victim = self._oldest(State.IDLE, stranger) or self._oldest(State.IDLE)
        if victim is None and preferred:
            victim = self._oldest(State.BUSY, stranger)
        return victim

    def authenticated(
        self, sock: socket.socket, wait: float, *, preferred: bool = True
    ) -> tuple[bool, list[socket.socket]]:
        """``sock`` proved the key (``preferred``: from the node's own address or the ring's):
        (whether it may be served, the connections it replaces).

        False when it was replaced meanwhile, its address holds its share already, or no
        place freed within ``wait`` seconds.
        """
        deadline = time.monotonic() + wait
        with self._cond:
            entry = self._table.get(sock)
            if entry is None:
                return False, []
            entry.preferred = preferred
            source = entry.source
            held = sum(1 for e in self._table.values() if e.source == source and e.state is not State.PROVING)
            if not preferred and held >= self.per_peer:
                return False, []
            while True:
                if sock not in self._table:
                    return False, []
                evicted: list[socket.socket] = []
                if self._authenticated() >= self.connections:
                    victim = self._make_room(preferred)
                    if victim is not None:
                        del self._table[victim]
                        evicted.append(victim)
                if self._authenticated() < self.connections:
                    entry.state, entry.since = State.IDLE, time.monotonic()
                    return True, evicted
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, []
                self._cond.wait(left)

    def busy(self, sock: socket.socket) -> bool:
        """A request arrived on ``sock``: False when the connection was replaced (drop it)."""
        with self._cond:
            entry = self._table.get(sock)
            if entry is None:
                return False
            entry.state, entry.since = State.BUSY, time.monotonic()
            return True

    def idle(self, sock: socket.socket) -> None:
        with self._cond:
            entry = self._table.get(sock)
            if entry is not None:
                entry.state, entry.since = State.IDLE, time.monotonic()
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

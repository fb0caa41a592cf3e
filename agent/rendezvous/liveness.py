"""Dead-node detection from heartbeat counters, judged by the observer's own clock.

Each node increments its ``hb/<name>`` counter every keep-alive interval. An
observer remembers the last value it read for a peer and when (its monotonic
clock) that value last moved; a value that has not moved for ``timeout`` seconds
means the peer is dead. Clocks of different machines are never compared.
"""

from __future__ import annotations

__all__ = ["HeartbeatTracker"]


class HeartbeatTracker:
    """Remembers, per peer, the last heartbeat value seen and since when it has not moved."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, name: str, value: int, now: float) -> bool:
        """Record a reading; True if ``name``'s heartbeat has not moved for ``timeout`` s."""
        previous = self._seen.get(name)
        if previous is None or previous[0] != value:
            self._seen[name] = (value, now)
            return False
        return now - previous[1] >= self.timeout

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)

    def retain(self, names: set[str]) -> None:
        """Drop peers no longer watched, so a later watch starts a fresh timer."""
        for name in list(self._seen):
            if name not in names:
                del self._seen[name]

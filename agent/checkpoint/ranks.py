"""Which processes are the node's own ranks: the ones whose saves and restore reports the
checkpoint service takes.

The agent names the processes it started (:meth:`LocalRanks.set`); a pid counts when it is
alive and is one of them or a process one of them started (a rank's own helper), within a
few generations (read from ``/proc``). Before the agent names any (a service started
without an agent, as tests and benches do), any live process of the machine counts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from kelastic.agent.checkpoint.errors import CheckpointError

__all__ = ["LocalRanks"]


class LocalRanks:
    """The processes the agent of node ``node`` started (thread-safe)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._pids: Callable[[], Iterable[int]] | None = None

    def set(self, pids: Callable[[], Iterable[int]] | None) -> None:
        """``pids()`` names the processes the agent started from now on (None: any)."""
        with self._lock:
            self._pids = pids

    @property
    def named(self) -> bool:
        with self._lock:
            return self._pids is not None

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is a live rank of this node, or a process one started."""
        if not _alive(pid):
            return False
        with self._lock:
            pids = self._pids
        return pids is None or _descends(pid, set(pids()))

    def check(self, pid: int, what: str) -> None:
        """CheckpointError saying so when ``what`` (from process ``pid``) is no rank's."""
        if not self.holds(pid):
            raise CheckpointError(
                f"{what} comes only from a rank of node {self.node}; pid {pid} is no process its agent started"
            )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False  # no process of this node: no reservation
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def _descends(pid: int, roots: set[int], depth: int = 8) -> bool:
    """Whether ``pid`` is one of ``roots`` or a descendant of one (a rank's own helper
    process), within ``depth`` generations."""
    for _ in range(depth):
        if pid in roots:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False

"""Wait for processes to exit on descriptors the kernel makes readable, not on a poll period.

A stop sends its signal, then waits for the ranks and their descendants to be gone. Sleeping
a fixed period between checks adds up to that period to every stop (a restart's critical
path); :class:`ExitWatch` instead wakes the moment one of them exits: a *pidfd*
(``pidfd_open``, Linux 5.3) becomes readable when its process has exited (a zombie or
reaped), and a rank's own exit descriptor (a ``multiprocessing`` sentinel, which a fork
server writes the rank's status to once it reaped it) when its exit status can be read.
Where a pidfd cannot be had (another platform, an old kernel, a process already gone) it
falls back to naps of at most :data:`FALLBACK_NAP` seconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Iterable
from types import TracebackType

__all__ = ["FALLBACK_NAP", "ExitWatch", "pidfd"]

#: Longest nap between checks while a watched process has no descriptor (seconds).
FALLBACK_NAP = 0.02


def pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exited), or None where there is none to have."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:  # ESRCH: gone already; ENOSYS: a kernel without pidfds
        return None
    return fd


class ExitWatch:
    """Pidfds of ``pids`` and a :meth:`wait` on them: use as a context manager (it closes them).

    :meth:`wait` returns once ``done()`` is true or ``deadline`` (``time.monotonic()``) passed,
    and tells which; between checks it sleeps until a watched process that ``alive`` still
    counts exits, an ``fds()`` descriptor becomes readable, or the deadline, with no period
    of its own (:data:`FALLBACK_NAP` caps a sleep only while a watched process has no pidfd).
    """

    def __init__(self, pids: Iterable[int], alive: Callable[[int], bool]) -> None:
        self._alive = alive
        self._fds: dict[int, int | None] = {}
        self.add(pids)

    def add(self, pids: Iterable[int]) -> None:
        """Watch ``pids`` too (those already watched are kept)."""
        for pid in pids:
            if pid not in self._fds:
                self._fds[pid] = pidfd(pid)

    def wait(self, done: Callable[[], bool], fds: Callable[[], list[int]], deadline: float) -> bool:
        """True once ``done()``; False when ``deadline`` passed first.

        ``fds()`` (asked before every sleep) are descriptors that become readable when
        ``done()`` may have changed (a rank's exit status can be read).
        """
        while True:
            # What to sleep on is taken before done() is asked: an exit after this makes one
            # of these descriptors readable, so none is missed between the two.
            watched = [(pid, fd) for pid, fd in self._fds.items() if self._alive(pid)]
            waits = [fd for _, fd in watched if fd is not None] + fds()
            if done():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            nap = FALLBACK_NAP if not waits or any(fd is None for _, fd in watched) else left
            try:
                select.select(waits, [], [], min(nap, left))
            except (OSError, ValueError):  # a descriptor closed under us: check again after a nap
                time.sleep(min(FALLBACK_NAP, left))

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

"""Sleep until a file in some directories changes (Linux inotify), a wake-up, or a timeout.

Lets an idle log tailer react to a new line within a millisecond instead of its polling
interval, without waking up when nothing happens. Where inotify is unavailable (other
platforms, exhausted watch limits, a directory that does not exist yet) it degrades to
plain timed sleeps, so callers keep polling at their interval as a fallback anyway.
"""

from __future__ import annotations

import ctypes
import os
import select
from collections.abc import Iterable

__all__ = ["ChangeWaiter"]

_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_IN_MODIFY = 0x2
_IN_CLOSE_WRITE = 0x8
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_MASK = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE


def _inotify_fd(dirs: Iterable[str]) -> int | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd: int = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    watched = 0
    for directory in dirs:
        if libc.inotify_add_watch(fd, os.fsencode(directory), _MASK) >= 0:
            watched += 1
    if not watched:
        os.close(fd)
        return None
    return fd


class ChangeWaiter:
    """``wait(timeout)`` returns when a file in ``dirs`` changed, ``wake()`` was called,
    or ``timeout`` s passed — whichever is first. ``close()`` frees its descriptors."""

    def __init__(self, dirs: Iterable[str]) -> None:
        self._fd = _inotify_fd(sorted(set(dirs)))
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def watching(self) -> bool:
        """True if changes wake us (inotify works), False if this is a timed sleep."""
        return self._fd is not None

    def wait(self, timeout: float) -> None:
        fds = [self._wake_r] if self._fd is None else [self._fd, self._wake_r]
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            return
        for fd in ready:
            try:
                while os.read(fd, 65536):
                    pass
            except (BlockingIOError, OSError):
                pass

    def wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass  # the pipe is full of wake-ups already

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = None

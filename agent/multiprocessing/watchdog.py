"""Launcher side of the watchdog: no rank's tree survives the launcher, even after SIGKILL.

The parent-death signal kills the ranks themselves when the launcher dies, but their
children (a data loader, a shell's commands) would be re-parented and live on. A tiny
watchdog process (one per launcher process, started on first use, in its own session so
terminal signals miss it) is told the process group of every rank; when the launcher
dies it SIGKILLs those groups and every descendant it last saw. ``PContext`` registers
its ranks in ``start()`` and unregisters them in ``close()``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterable

__all__ = ["close_inherited_pipe", "guard", "unguard"]

logger = logging.getLogger(__name__)

_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog_main.py")
_lock = threading.Lock()
_proc: subprocess.Popen[bytes] | None = None


def _send(line: str) -> None:
    global _proc
    with _lock:
        for _attempt in range(2):
            if _proc is None or _proc.poll() is not None or _proc.stdin is None:
                try:
                    _proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", _PROGRAM, str(os.getpid())],
                        stdin=subprocess.PIPE,
                        start_new_session=True,
                        close_fds=True,
                    )
                except OSError as exc:
                    logger.warning(
                        "cannot start the rank watchdog (%s); ranks' children may outlive a killed launcher",
                        exc,
                    )
                    return
            stdin = _proc.stdin
            assert stdin is not None  # started with stdin=PIPE
            try:
                stdin.write(line.encode())
                stdin.flush()
                return
            except (BrokenPipeError, ValueError, OSError):
                _proc = None  # it died (someone killed it): start a new one and resend


def guard(pgids: Iterable[int]) -> None:
    """Ask the watchdog to kill these process groups if this process dies."""
    text = "".join(f"+{pgid}\n" for pgid in pgids)
    if text:
        _send(text)


def unguard(pgids: Iterable[int]) -> None:
    """These groups were closed normally; the watchdog forgets them."""
    text = "".join(f"-{pgid}\n" for pgid in pgids)
    if text and _proc is not None:
        _send(text)


def close_inherited_pipe() -> None:
    """In a forked rank: drop the inherited end of the watchdog's pipe, so that the
    rank's own children do not keep it open after the launcher is gone."""
    global _proc
    proc = _proc
    _proc = None
    if proc is not None and proc.stdin is not None:
        try:
            proc.stdin.close()  # through the file object, so nothing closes the fd twice later
        except (OSError, ValueError):
            pass

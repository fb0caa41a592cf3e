"""Process trees on Linux: parent-death signals, finding descendants, killing a rank's tree.

Every rank is started as the leader of its own session (so its process group is its
pid), which lets ``killpg`` reach the whole tree in one call. Descendants that moved to
another group (``setsid`` in a worker) are found by walking parent links in ``/proc``
*before* the rank dies (afterwards they are re-parented and the link is lost).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from collections.abc import Iterable

from ._watchdog_main import descendants_in, process_table, read_stat

__all__ = [
    "descendants",
    "is_alive",
    "set_parent_death_signal",
    "signal_trees",
]

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """In a child: ask the kernel to send ``sig`` when the parent thread that forked us dies.

    If ``expected_parent`` is given and is already gone (it died between fork and this
    call, so the kernel would never signal us), exit at once with 128+sig.
    Silently does nothing where prctl is unavailable (non-Linux).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def descendants(roots: Iterable[int]) -> set[int]:
    """All live descendants of ``roots`` (not including the roots), from one /proc scan."""
    return descendants_in(process_table(), roots)


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    stat = read_stat(pid)
    return stat is not None and stat[3] not in ("Z", "X")


def signal_trees(leaders: Iterable[int], extra: Iterable[int], sig: int) -> None:
    """Send ``sig`` to the process group of each leader and to every pid in ``extra``.

    Missing processes and groups are ignored (they are already gone).
    """
    for pgid in leaders:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in extra:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

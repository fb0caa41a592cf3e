"""The watchdog process: kills the ranks' process trees if the launcher dies without closing them.

Started by :mod:`.watchdog` as ``python -I -S _watchdog_main.py <launcher pid>`` in its
own session. Self-contained on purpose (no kelastic imports): it must start fast and
keep working whatever happens to the launcher's environment.

Protocol on stdin, one line each: ``+<pgid>`` (a rank's process group to guard) and
``-<pgid>`` (closed normally; forget it). When stdin reaches EOF or the launcher is no
longer our parent, every guarded group is SIGKILLed, and so is every descendant of
theirs seen in the last scan (they may have left the group), then the watchdog exits.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

# typing is not imported at run time (start-up cost); mypy reads this block all the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    # (ppid, pgid, starttime, state) from /proc/<pid>/stat
    Stat = tuple[int, int, int, str]

SCAN_EVERY = 2.0


def read_stat(pid: int) -> Stat | None:
    """(ppid, pgid, starttime, state) of pid from /proc, or None if it is gone.

    Also used by :mod:`.proctree` (this file must stay importable on its own).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: parse after the last ')'.
    rest = raw[raw.rfind(b")") + 2 :].split()
    return int(rest[1]), int(rest[2]), int(rest[19]), rest[0].decode()


def process_table() -> dict[int, Stat]:
    """{pid: read_stat(pid)} for every process."""
    table: dict[int, Stat] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def descendants_in(table: dict[int, Stat], roots: Iterable[int]) -> set[int]:
    """Every descendant of ``roots`` (roots excluded) by the parent links of ``table``.

    Also used by :mod:`.proctree`.
    """
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(stat[0], []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _scan(groups: set[int]) -> dict[int, int]:
    """{pid: starttime} of every process in the groups and all their descendants."""
    table = process_table()
    members = {pid for pid, stat in table.items() if stat[1] in groups}
    return {pid: table[pid][2] for pid in members | descendants_in(table, members)}


def _kill_all(groups: set[int], known: dict[int, int]) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for pid, start in known.items():
        stat = read_stat(pid)
        if stat is not None and stat[2] == start:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main() -> None:
    launcher = int(sys.argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    known: dict[int, int] = {}
    pending = b""
    scanned_at = 0.0
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line[:1] == b"+":
                    groups.add(int(line[1:]))
                elif line[:1] == b"-":
                    groups.discard(int(line[1:]))
                    known = {}
                    scanned_at = 0.0
        if os.getppid() != launcher:
            break
        now = time.monotonic()
        if groups and now - scanned_at >= SCAN_EVERY:
            known = _scan(groups)
            scanned_at = now
    _kill_all(groups, known)
    # Ranks die of their parent-death signal at about the same time; sweep once more
    # for processes of the groups that were being forked during the first pass.
    time.sleep(0.2)
    _kill_all(groups, _scan(groups) if groups else {})


if __name__ == "__main__":
    main()

"""Whether the kernel's OOM killer killed one of the agent's workers.

In a pod the agent and its workers share one container, whose memory limit is its memory
cgroup's. Past it the kernel kills the cgroup's largest process: a rank, most often, not
the agent. The container then goes on (the agent restarts its workers) and Kubernetes never
reports it ``OOMKilled``; the worker only shows as killed by SIGKILL. The cgroup's own
counter of OOM kills tells the two apart: ``oom_kill N`` in ``memory.events`` (cgroup v2)
or ``memory.oom_control`` (v1, Linux 4.13 and later), as mounted in the container.

:class:`OomWatch` reads that counter on each failure and names the workers it killed.
Where no counter can be read (not Linux, no memory controller) it never says OOM-killed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["COUNTERS", "OOM_KILLED", "OomWatch", "oom_cause", "parse_oom_kills", "read_oom_kills"]

#: Where a container sees its memory cgroup's OOM kill counter, v2 first.
COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))

#: The words a worker killed at the container's memory limit is described with.
OOM_KILLED = "OOM-killed (its container reached its memory limit)"

#: A worker killed by SIGKILL has this exit code (multiprocessing's and torch's convention).
SIGKILLED = -9


def parse_oom_kills(text: str) -> int | None:
    """The ``oom_kill N`` line's N of a ``memory.events`` or ``memory.oom_control`` file."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value.strip())
    return None


def read_oom_kills(paths: Sequence[Path] = COUNTERS) -> int | None:
    """The container's OOM kills so far, from the first of ``paths`` that says; None when none does."""
    for path in paths:
        try:
            count = parse_oom_kills(path.read_text())
        except OSError:
            continue
        if count is not None:
            return count
    return None


def oom_cause(exitcodes: Mapping[int, int], before: int | None, now: int | None) -> str:
    """``"rank R was OOM-killed (...)"`` when the counter went up from ``before`` to ``now``
    and rank R (global rank: exit code) died by SIGKILL; else ``""`` (pure)."""
    if before is None or now is None or now <= before:
        return ""
    killed = sorted(rank for rank, code in exitcodes.items() if code == SIGKILLED)
    if not killed:
        return ""
    ranks = ", ".join(str(r) for r in killed)
    return f"rank{'s' if len(killed) > 1 else ''} {ranks} {'were' if len(killed) > 1 else 'was'} {OOM_KILLED}"


class OomWatch:
    """The counter as last read: :meth:`cause` says whether the failure since was an OOM kill."""

    def __init__(self, paths: Sequence[Path] = COUNTERS) -> None:
        self._paths = tuple(paths)
        self._seen = read_oom_kills(self._paths)

    def cause(self, exitcodes: Mapping[int, int]) -> str:
        """:func:`oom_cause` of the workers' exit codes since the previous call (or the start)."""
        now = read_oom_kills(self._paths)
        before, self._seen = self._seen, now if now is not None else self._seen
        return oom_cause(exitcodes, before, now)

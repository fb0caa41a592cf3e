"""Whether the kernel's OOM killer killed one of the agent's workers.

In a pod the agent and its workers share one container, whose memory limit is its memory
cgroup's. Past it the kernel kills the cgroup's largest process: a rank, most often, not
the agent. The container then goes on (the agent restarts its workers) and Kubernetes never
reports it ``OOMKilled``; the worker only shows as killed by SIGKILL. The cgroup's own
counter of OOM kills tells the two apart: ``oom_kill N`` in ``memory.events`` (cgroup v2)
or ``memory.oom_control`` (v1, Linux 4.13 and later), of the agent's own memory cgroup
(:func:`counter_paths`: the path ``/proc/self/cgroup`` names, else the mount's root, which in a
container is the container's cgroup).

:class:`OomWatch` reads that counter on each failure and names the workers it killed.
Where no counter can be read (not Linux, no memory controller) it never says OOM-killed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "OOM_KILLED",
    "OomWatch",
    "counter_paths",
    "oom_cause",
    "own_counters",
    "parse_oom_kills",
    "read_oom_kills",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")

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


def counter_paths(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The OOM kill counters to read: first those of the cgroups ``proc_cgroup`` (the text of
    ``/proc/self/cgroup``) names (v2 ``memory.events``, v1 ``memory.oom_control``), then the
    mounts' roots: in a container on a v1 host the cgroup's own path is not mounted, and the
    root is the container's cgroup (pure)."""
    own: list[Path] = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        relative = path.strip().lstrip("/")
        if controllers == "":
            own.append(root / relative / "memory.events")
        elif "memory" in controllers.split(","):
            own.append(root / "memory" / relative / "memory.oom_control")
    return [*own, root / "memory.events", root / "memory" / "memory.oom_control"]


def own_counters() -> list[Path]:
    """:func:`counter_paths` of this process (the mounts' roots alone where it has no cgroups)."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        text = ""
    return counter_paths(text)


def read_oom_kills(paths: Sequence[Path]) -> int | None:
    """The cgroup's OOM kills so far, from the first of ``paths`` that says; None when none does."""
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

    def __init__(self, paths: Sequence[Path] | None = None) -> None:
        self._paths = tuple(paths) if paths is not None else tuple(own_counters())
        self._seen = read_oom_kills(self._paths)

    def cause(self, exitcodes: Mapping[int, int]) -> str:
        """:func:`oom_cause` of the workers' exit codes since the previous call (or the start)."""
        now = read_oom_kills(self._paths)
        before, self._seen = self._seen, now if now is not None else self._seen
        return oom_cause(exitcodes, before, now)

"""etcd's directories in tmpfs (``/dev/shm``): claimed with their owner's identity, swept when the owner is gone.

A control plane without ``--state-dir`` keeps etcd's data in tmpfs (RAM) for the
cluster's lifetime. :meth:`LocalCluster.stop` removes it, but a ``kelastic local``
that is SIGKILLed (or whose machine runs out of memory) cannot, and each such
directory holds some 60 MB of RAM until the next reboot.

So each directory records who owns it: :func:`claim_scratch_dir` creates
``<base>/kelastic-etcd-XXXX/`` with an ``owner`` file holding the owning process's
pid and its start time (``/proc/<pid>/stat``, clock ticks since boot), and etcd's
data goes to its ``data/`` subdirectory. At the next start :func:`sweep_scratch_dirs`
removes the directories whose owner is gone: no process with that pid, or one that
started at another time (the pid was reused). A live owner's directory is never
touched. A directory without an ``owner`` file (one made before owners were
recorded, or one being created right now) is removed only when no process names it
on its command line (etcd's ``--data-dir``) and it is older than a minute.

:func:`scratch_verdict` is the pure decision; the rest reads ``/proc`` and the directories.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "OWNER_FILE",
    "PREFIX",
    "Owner",
    "SweptDir",
    "claim_scratch_dir",
    "process_start_time",
    "scratch_verdict",
    "sweep_scratch_dirs",
]

#: The name prefix of the directories (under ``/dev/shm``).
PREFIX = "kelastic-etcd-"
#: The file in each directory naming its owner: ``<pid> <start time>``.
OWNER_FILE = "owner"
#: A directory without an owner file is left alone this long (it may be being created).
UNOWNED_GRACE_S = 60.0


@dataclass(frozen=True)
class Owner:
    """A process, identified across pid reuse by its start time."""

    pid: int
    start_time: int

    def render(self) -> str:
        return f"{self.pid} {self.start_time}\n"

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        """From :meth:`render`'s text; None when it is not that."""
        parts = text.split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            return None
        return cls(int(parts[0]), int(parts[1]))


@dataclass(frozen=True)
class SweptDir:
    """A directory that :func:`sweep_scratch_dirs` removed, and why."""

    path: Path
    size_bytes: int
    reason: str


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None when no such process runs.

    A zombie (dead, not yet reaped) counts as gone: it holds nothing any more.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (2nd field) may hold spaces and parentheses: split after its ")".
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is the 3rd field (state); the start time is the 22nd field.
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def scratch_verdict(
    owner: Owner | None, owner_started: int | None, named_by_a_process: bool, age_s: float
) -> str | None:
    """Why a scratch directory is to be removed, or None to keep it.

    ``owner`` is what its owner file says (None: no readable owner file);
    ``owner_started`` the start time of the process now holding that pid (None: none);
    ``named_by_a_process`` whether a running process names the directory on its
    command line; ``age_s`` the directory's age.
    """
    if owner is not None:
        if owner_started is None:
            return f"its owner, pid {owner.pid}, is gone"
        if owner_started != owner.start_time:
            return f"its owner, pid {owner.pid}, is gone (the pid now belongs to another process)"
        return None
    if named_by_a_process or age_s < UNOWNED_GRACE_S:
        return None
    return "it records no owner and no process uses it"


def claim_scratch_dir(base: Path | str = "/dev/shm") -> Path:
    """A new ``<base>/kelastic-etcd-XXXX`` owned by this process; etcd's data goes to its ``data/``."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
    me = Owner(os.getpid(), process_start_time(os.getpid()) or 0)
    # Written under a temporary name and renamed: a sweeper never reads half an owner.
    partial = path / f".{OWNER_FILE}.tmp"
    partial.write_text(me.render())
    partial.rename(path / OWNER_FILE)
    (path / "data").mkdir(mode=0o700)
    return path


def sweep_scratch_dirs(
    base: Path | str = "/dev/shm", *, now: Callable[[], float] = time.time
) -> list[SweptDir]:
    """Remove the scratch directories under ``base`` whose owner is gone; return what was removed."""
    base = Path(base)
    try:
        candidates = sorted(p for p in base.glob(PREFIX + "*") if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    named: set[str] | None = None
    swept: list[SweptDir] = []
    for path in candidates:
        try:
            owner = Owner.parse((path / OWNER_FILE).read_text())
        except OSError:
            owner = None
        started = process_start_time(owner.pid) if owner is not None else None
        in_use = False
        if owner is None:
            if named is None:
                named = _command_lines()
            in_use = any(str(path) in line for line in named)
        try:
            age = now() - path.stat().st_mtime
        except OSError:
            continue  # gone meanwhile
        reason = scratch_verdict(owner, started, in_use, age)
        if reason is None:
            continue
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            swept.append(SweptDir(path, size, reason))
    return swept


def _command_lines() -> set[str]:
    """The command line of every process we may read, arguments joined by spaces."""
    lines: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines.add((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total

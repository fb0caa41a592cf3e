"""What a real-node lane does to the host, and how each thing is undone (root only).

Every function here makes or removes one kind of host state: cgroups (v1 hierarchies),
network namespaces, the bridge and its veths, routes, the lane's nftables table, mounts,
kernel settings. The ones that remove are idempotent and quiet about what is already gone,
so that :mod:`.janitor` can run them after a lane that died at any point.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "FIXED_PATHS",
    "STATE_DIR",
    "SYSCTLS",
    "HostCommandFailed",
    "cgroup_parent",
    "cgroup_pids",
    "claim_slot",
    "enter",
    "hierarchies",
    "kill_cgroup",
    "make_cgroup",
    "mounts_under",
    "remove_cgroup",
    "remove_fixed_paths",
    "restore_sysctls",
    "run",
    "save_fixed_paths",
    "save_sysctls",
    "sysctl",
    "unmount_under",
]

#: Where lanes keep their slot locks, the host's original kernel settings and which of
#: :data:`FIXED_PATHS` were absent.
STATE_DIR = Path(os.environ.get("KELASTIC_NODE_STATE", "/run/kelastic-node"))
#: Host-wide kernel settings a lane changes (the kubelet writes the first four at start);
#: recorded before the first lane starts and restored when the last one ends.
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
)
#: Host paths the nodes' components make whatever their configuration says: the kubelet's
#: device plugin socket directory (a constant of the kubelet) and the CNI plugins' result
#: cache (libcni's default, which containerd does not expose). Shallowest first; those absent
#: before the first lane starts are removed when the last one ends.
FIXED_PATHS = (
    "/var/lib/kubelet",
    "/var/lib/kubelet/device-plugins",
    "/var/lib/cni",
    "/var/lib/cni/results",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CLONE_NEWNET = 0x40000000
MNT_DETACH = 2


class HostCommandFailed(RuntimeError):
    """A host command (ip, nft, ...) failed; the message names it and its output."""


def run(argv: list[str], *, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (inside network namespace ``netns`` when given); raise HostCommandFailed on failure."""
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostCommandFailed(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise HostCommandFailed(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


# -- slots ---------------------------------------------------------------------------------
def claim_slot(slots: int) -> tuple[int, int]:
    """A free lane slot and an open file descriptor holding its lock (flock, closed = freed)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    for slot in range(slots):
        fd = os.open(STATE_DIR / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    raise RuntimeError(f"all {slots} real-node lane slots are taken (locks in {STATE_DIR})")


def other_slots_held(slots: int, mine: int) -> bool:
    """Whether any lane but ``mine`` holds its slot now."""
    for slot in range(slots):
        if slot == mine:
            continue
        path = STATE_DIR / f"slot-{slot}.lock"
        if not path.exists():
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


# -- kernel settings -----------------------------------------------------------------------
def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def sysctl(name: str) -> str:
    return _sysctl_path(name).read_text().strip()


def save_sysctls() -> dict[str, str]:
    """Record the host's settings of :data:`SYSCTLS` unless a running lane already did."""
    values = {name: sysctl(name) for name in SYSCTLS if _sysctl_path(name).exists()}
    return dict(_record_once("sysctl-originals.json", values))


def _record_once(name: str, value: object) -> Any:
    """Write ``value`` to ``STATE_DIR/name`` unless it is there (a running lane wrote it
    first: the host as it was before any lane); what the file holds."""
    path = STATE_DIR / name
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
    return json.loads(path.read_text())


def _recorded(name: str) -> Any:
    """What ``STATE_DIR/name`` holds; None when there is no such record or it is unreadable."""
    try:
        return json.loads((STATE_DIR / name).read_text())
    except (OSError, ValueError):
        return None


def restore_sysctls() -> list[str]:
    """Write back the recorded settings and forget them; the names of those that had changed."""
    values = _recorded("sysctl-originals.json")
    if not isinstance(values, dict):
        return []
    changed = []
    for name, value in values.items():
        with contextlib.suppress(OSError):
            if sysctl(name) != value:
                _sysctl_path(name).write_text(value)
                changed.append(name)
    (STATE_DIR / "sysctl-originals.json").unlink(missing_ok=True)
    return changed


def save_fixed_paths() -> list[str]:
    """Record which of :data:`FIXED_PATHS` are absent, unless a running lane already did;
    the recorded ones."""
    return list(_record_once("absent-paths.json", [p for p in FIXED_PATHS if not os.path.lexists(p)]))


def remove_fixed_paths() -> list[str]:
    """Remove those of :data:`FIXED_PATHS` that were absent before the first lane and forget
    them (no lane may be running); the ones that could not be removed."""
    recorded = _recorded("absent-paths.json")
    if not isinstance(recorded, list):
        return []
    absent = [p for p in recorded if p in FIXED_PATHS]
    left = []
    for made in absent:  # the shallowest first: its tree takes the deeper ones with it
        if os.path.isdir(made) and not os.path.islink(made):
            shutil.rmtree(made, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made)
        if os.path.lexists(made):
            left.append(made)
    (STATE_DIR / "absent-paths.json").unlink(missing_ok=True)
    return left


# -- cgroups (v1) --------------------------------------------------------------------------
def hierarchies(*, unified: bool = False) -> list[Path]:
    """The mount points of the cgroup v1 hierarchies (``/sys/fs/cgroup/memory`` ...), and with
    ``unified`` the v2 one of a hybrid layout too (``/sys/fs/cgroup/unified``), where runc
    mirrors the cgroups it makes: the lane makes its own in v1 only but removes them in both."""
    kinds = {"cgroup", "cgroup2"} if unified else {"cgroup"}
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] in kinds:
            found.append(Path(fields[1]))
    return found


def cgroup_parent() -> str:
    """This process's memory cgroup (v1), where a lane nests its own (``/`` if unknown)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path or "/"
    return "/"


def make_cgroup(relative: str) -> None:
    """Create ``relative`` in every hierarchy (cpuset ones get their parent's cpus and mems)."""
    for hierarchy in hierarchies():
        path = hierarchy / relative.lstrip("/")
        missing = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            directory.mkdir()
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (directory / knob).exists():
                    (directory / knob).write_text((directory.parent / knob).read_text())


def join_cgroup(relative: str, pid: int) -> None:
    """Move ``pid`` into ``relative`` in every hierarchy (ignores hierarchies that refuse)."""
    for hierarchy in hierarchies():
        procs = hierarchy / relative.lstrip("/") / "cgroup.procs"
        with contextlib.suppress(OSError):
            procs.write_text(str(pid))


def _walk(relative: str) -> Iterator[Path]:
    """Every directory of ``relative`` in every hierarchy (v2 included), deepest first."""
    for hierarchy in hierarchies(unified=True):
        top = hierarchy / relative.lstrip("/")
        if not top.is_dir():
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
            yield Path(dirpath)


def cgroup_pids(relative: str) -> set[int]:
    """The processes in ``relative`` or below, in any hierarchy."""
    pids: set[int] = set()
    for directory in _walk(relative):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
    return pids


def kill_cgroup(relative: str, timeout: float = 30.0) -> set[int]:
    """SIGKILL every process in ``relative`` or below (frozen first, so none forks away)."""
    freezer = next((h for h in hierarchies() if h.name == "freezer"), None)
    state = freezer / relative.lstrip("/") / "freezer.state" if freezer else None
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := cgroup_pids(relative):
        if state is not None:
            with contextlib.suppress(OSError):
                state.write_text("FROZEN")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        if state is not None:
            with contextlib.suppress(OSError):
                state.write_text("THAWED")
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} of cgroup {relative} outlived SIGKILL")
        time.sleep(0.1)
    return killed


def remove_cgroup(relative: str) -> list[Path]:
    """rmdir ``relative`` and everything below in every hierarchy; the directories left."""
    for directory in _walk(relative):
        with contextlib.suppress(FileNotFoundError):
            for attempt in range(50):
                try:
                    directory.rmdir()
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or attempt == 49:
                        break
                    time.sleep(0.1)
    return list(_walk(relative))


# -- namespaces and mounts -----------------------------------------------------------------
def enter(netns: str, cgroup: str) -> None:
    """In a child before exec: join ``cgroup`` and network namespace ``netns`` (``ip netns`` name)."""
    join_cgroup(cgroup, os.getpid())
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def mounts_under(prefixes: Iterable[str]) -> list[str]:
    """Mount points at or below any of ``prefixes``, deepest first."""
    wanted = [p.rstrip("/") for p in prefixes]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == p or point.startswith(p + "/") for p in wanted):
            found.append(point)
    return sorted(set(found), key=lambda p: -p.count("/"))


def unmount_under(prefixes: Iterable[str]) -> list[str]:
    """Detach every mount below ``prefixes`` (several passes: mounts stack); those left."""
    libc = ctypes.CDLL(None, use_errno=True)
    prefixes = list(prefixes)
    for _ in range(10):
        points = mounts_under(prefixes)
        if not points:
            return []
        for point in points:
            libc.umount2(point.encode(), MNT_DETACH)
    return mounts_under(prefixes)

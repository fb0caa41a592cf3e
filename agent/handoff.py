"""The hand-off between an agent and the workers it keeps across a re-form.

A worker that runs its training under :func:`kelastic.inprocess.run` survives the loss or
arrival of a peer: it leaves its process group, *parks*, and is handed the ranks of the next
group by its agent, which neither stops it nor starts a new process. The two talk through
two small JSON files in the worker's own directory ``$KELASTIC_HANDOFF_DIR`` (the agent's,
private to the node: one per local rank), each replaced atomically by its one writer:

* ``request.json``, written by the agent (:class:`Request`): the generation the
  worker is to reach and what to do: :attr:`Action.REFORM` (leave the group and park),
  :attr:`Action.GO` (join the group described by ``env``), :attr:`Action.EXIT` (end, as the
  failure the worker parked with);
* ``report.json``, written by the worker (:class:`Report`): its pid, its
  generation, whether it is :attr:`Stage.RUNNING`, :attr:`Stage.PARKED` or :attr:`Stage.DONE`,
  the signal that interrupts its training when a re-form is requested (0: none), and, when it
  parked on its own (``fn`` raised), the exception: the agent takes that as the rank's failure
  (:func:`failed_on_its_own`).

Generations count the groups a worker process has been a member of, from 0 for the group it
was started into; the agent asks for generation ``g + 1`` when it re-forms. The decisions are
pure functions (:func:`keepable`, :func:`parked`); the file I/O is at the bottom.

**Only the agent's user writes there.** A request names the group a worker joins next (its
``MASTER_ADDR``): whoever could write one could point the worker's training at a host of
theirs. So the agent makes the folders itself, mode 0700 (:func:`make_private`), and keeps no
worker when it cannot (the folder was there before, of another user, or open to others);
the worker checks its folder again before it trusts it (:func:`unsafe`), and a file that is
not its user's, that others may write or that is a symbolic link is read as no file at all.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

__all__ = [
    "ENV_HANDOFF_DIR",
    "ENV_HANDOFF_PARKED",
    "ENV_KEEP_WORKERS",
    "Action",
    "Report",
    "Request",
    "Stage",
    "failed_on_its_own",
    "keep_enabled",
    "keepable",
    "make_private",
    "parked",
    "read_report",
    "read_request",
    "report_path",
    "request_path",
    "unsafe",
    "unsafe_mode",
    "write_report",
    "write_request",
]

#: Set by the agent for each worker: the directory of the hand-off files.
ENV_HANDOFF_DIR = "KELASTIC_HANDOFF_DIR"
#: Set by the agent for the workers it starts before they have a group (a standby's): they
#: park at once, before their first group, and wait to be handed one.
ENV_HANDOFF_PARKED = "KELASTIC_HANDOFF_PARKED"
#: Environment variable of the agent: ``0`` stops and restarts every worker at a re-form,
#: also those that could be kept.
ENV_KEEP_WORKERS = "KELASTIC_KEEP_WORKERS"


class Action(str, Enum):
    """What the agent asks of a kept worker."""

    REFORM = "reform"
    GO = "go"
    EXIT = "exit"


class Stage(str, Enum):
    """Where a kept worker is."""

    RUNNING = "running"
    PARKED = "parked"
    DONE = "done"


@dataclass(frozen=True)
class Request:
    """The agent's word to one worker: reach generation ``gen`` by doing ``action``; for
    :attr:`Action.GO`, ``env`` holds the variables of the new group (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and the rest a new worker would be started with)."""

    gen: int
    action: Action
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    """A worker's word to its agent: process ``pid`` is at ``stage`` of generation ``gen``;
    ``signal`` interrupts its training when a re-form is asked for (0: it sees the request
    at its next :func:`kelastic.inprocess.check` or failed collective); ``reason`` says why
    it parked."""

    gen: int
    pid: int
    stage: Stage
    signal: int = 0
    reason: str = ""


def keep_enabled(env: Mapping[str, str]) -> bool:
    """Whether the agent keeps workers that can be kept (the default), from ``env``."""
    return env.get(ENV_KEEP_WORKERS, "").strip().lower() not in ("0", "false", "no", "off")


def keepable(reports: Mapping[int, Report | None], pids: Mapping[int, int], gen: int) -> bool:
    """Whether a re-form may keep these workers (pure): every local rank in ``pids`` (its
    live process) reported, from that very process, that it runs or is parked in
    generation ``gen``. A worker that never reported (its script does not use
    :func:`kelastic.inprocess.run`), that ended, or whose process is not the one that
    reported, is restarted, and with it the node's other workers."""
    if not pids:
        return False
    for local_rank, pid in pids.items():
        report = reports.get(local_rank)
        if report is None or report.pid != pid or report.gen != gen:
            return False
        if report.stage not in (Stage.RUNNING, Stage.PARKED):
            return False
    return True


def failed_on_its_own(report: Report | None, gen: int) -> bool:
    """Whether the worker parked in generation ``gen`` without being asked (pure): its
    training raised; the agent takes it as the rank's failure."""
    return report is not None and report.gen == gen and report.stage is Stage.PARKED and bool(report.reason)


def parked(reports: Mapping[int, Report | None], local_ranks: int, gen: int) -> bool:
    """Whether all ``local_ranks`` workers parked for generation ``gen`` (pure): they left
    the previous group and wait for the next one's ranks."""
    for local_rank in range(local_ranks):
        report = reports.get(local_rank)
        if report is None or report.stage is not Stage.PARKED or report.gen != gen:
            return False
    return True


# --- the files ------------------------------------------------------------------------------


def request_path(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / "request.json"


def report_path(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / "report.json"


def _write(path: Path, value: Mapping[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(value))
    os.replace(tmp, path)


def unsafe_mode(mode: int, uid: int, euid: int, *, directory: bool) -> str | None:
    """Why a hand-off folder (``directory``) or file of ``mode`` owned by ``uid`` cannot be
    trusted by a process of user ``euid``; None when it can (pure). Trusted: this user's,
    not a symbolic link, of the right kind, writable by nobody else."""
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(mode):
        return "is not a regular file"
    if uid != euid:
        return f"belongs to uid {uid}, not to this process's user ({euid})"
    if mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(mode):o})"
    return None


def unsafe(folder: str | os.PathLike[str]) -> str | None:
    """Why the hand-off ``folder`` or the folder holding it cannot be trusted (see
    :func:`unsafe_mode`); None when both can."""
    for path in (Path(folder), Path(folder).parent):
        try:
            st = os.lstat(path)
        except OSError as e:
            return f"{path} cannot be read ({e.strerror})"
        if (why := unsafe_mode(st.st_mode, st.st_uid, os.geteuid(), directory=True)) is not None:
            return f"{path} {why}"
    return None


def make_private(folder: Path) -> str | None:
    """Make ``folder`` and its parent (the attempt's hand-off folder) mode 0700, creating
    them; why they cannot be trusted when that fails (another user's, a symbolic link)."""
    for path in (folder.parent, folder):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            return f"{path} cannot be opened as a folder ({e.strerror})"
        try:
            os.fchmod(fd, 0o700)  # the umask may have left it open (a container's umask 0)
        except PermissionError:
            pass  # another user's: unsafe() says so
        finally:
            os.close(fd)
    return unsafe(folder)


def _read(path: Path) -> dict[str, object] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None  # a symbolic link is nothing the agent or the worker wrote
        raise
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if unsafe_mode(st.st_mode, st.st_uid, os.geteuid(), directory=False) is not None:
            return None
        text = f.read()
    try:
        value = json.loads(text)
    except ValueError:
        return None  # written by os.replace, so never torn; anything else is not ours
    return value if isinstance(value, dict) else None


def write_request(folder: str | os.PathLike[str], request: Request) -> None:
    """Replace the worker's request (atomically: a reader sees the old one or this one)."""
    value = asdict(request)
    value["action"] = request.action.value
    _write(request_path(folder), value)


def read_request(folder: str | os.PathLike[str]) -> Request | None:
    """The worker's current request; None when there is none or it is not one."""
    value = _read(request_path(folder))
    try:
        env = value.get("env", {}) if value is not None else None
        if value is None or not isinstance(env, dict):
            return None
        return Request(
            gen=int(str(value["gen"])),
            action=Action(value["action"]),
            env={str(k): str(v) for k, v in env.items()},
        )
    except (KeyError, ValueError):
        return None


def write_report(folder: str | os.PathLike[str], report: Report) -> None:
    """Replace the worker's report (atomically)."""
    value = asdict(report)
    value["stage"] = report.stage.value
    _write(report_path(folder), value)


def read_report(folder: str | os.PathLike[str]) -> Report | None:
    """The worker's latest report; None when there is none or it is not one."""
    value = _read(report_path(folder))
    if value is None:
        return None
    try:
        return Report(
            gen=int(str(value["gen"])),
            pid=int(str(value["pid"])),
            stage=Stage(value["stage"]),
            signal=int(str(value.get("signal", 0))),
            reason=str(value.get("reason", "")),
        )
    except (KeyError, ValueError):
        return None

"""Helpers of the launcher's tests: rank functions in a module that spawned and forkserver
ranks can import by name (``tests/agent/scripts`` on ``sys.path``) without importing torch."""

from __future__ import annotations

import os
import time
from pathlib import Path


def return_when(rank: int, marker: str, go: str) -> int:
    """Wait (up to 60 s) until the file ``go`` exists (when given), write ``marker``, return ``rank``."""
    deadline = time.monotonic() + 60
    while go and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    return rank


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has already died)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def return_or_check(pid_file: str) -> bool:
    """Group rank 0 returns at once, leaving its pid in ``pid_file``; group rank 1 waits until
    then, and a second more, and returns whether that process is still alive."""
    if os.environ["GROUP_RANK"] == "0":
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return True
    deadline = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # the other rank returned a second ago
    return alive(int(Path(pid_file).read_text()))


def return_or_hang(pid_file: str) -> bool:
    """Group rank 0 as in :func:`return_or_check`; group rank 1 leaves the pid of its agent
    (its parent) in ``pid_file + ".agent1"`` and runs until it is killed."""
    if os.environ["GROUP_RANK"] == "0":
        return return_or_check(pid_file)
    Path(pid_file + ".agent1").write_text(str(os.getppid()))
    time.sleep(600)
    return False


def gloo_return_noting_destroy(marker: str, init_file: str) -> int:
    """A rank of one: gloo through ``init_file``, one ``all_reduce``, return without
    ``destroy_process_group``; a destroy made afterwards (by the rank's process) writes
    ``marker`` and whether the group was still initialized then."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    original = dist.destroy_process_group

    def noting(*args: object, **kwargs: object) -> None:
        Path(marker).write_text(str(dist.is_initialized()))
        original(*args, **kwargs)  # type: ignore[arg-type]

    dist.destroy_process_group = noting  # type: ignore[assignment]
    return 7


def echo_or_exit(msg: str, exitcode: int = 0) -> str:
    """torch's ``echo1`` of its launcher tests: print to both streams and return ``{msg}_{RANK}``,
    or say so on stderr and ``sys.exit(exitcode)`` when ``exitcode`` is not 0."""
    import sys

    rank = int(os.environ["RANK"])
    if exitcode != 0:
        print(f"exit {exitcode} from {rank}", file=sys.stderr)
        sys.exit(exitcode)
    print(f"{msg} stdout from {rank}")
    print(f"{msg} stderr from {rank}", file=sys.stderr)
    return f"{msg}_{rank}"


def echo_or_raise(msg: str, fail: bool = False) -> str:
    """torch's ``echo2`` of its launcher tests: return ``msg``, or raise RuntimeError(msg) when ``fail``."""
    if fail:
        raise RuntimeError(msg)
    return msg

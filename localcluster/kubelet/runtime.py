"""Container processes: start, watch, signal and kill a process group.

Each container run is one session and process group, led by a small shim
(:mod:`kelastic.localcluster.kubelet.shim`) that starts the container's command in it,
so the kubelet can signal the whole tree a container started (workers,
helpers, shells) at once, and the shim kills that whole tree if the kubelet's
thread or process dies without cleaning up. stdout and stderr go, interleaved,
to the run's log file.

When the container's main process exits, whatever it left behind in its process
group is killed (a real runtime tears down the container's cgroup the same way),
before the main process is reaped, so its process-group id cannot be reused in
between. Processes that start their own session escape the group; that is the
one way a process can outlive its container here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ContainerProcess", "ExitStatus", "spawn"]

#: The container's first process (see :mod:`kelastic.localcluster.kubelet.shim`), run by path.
SHIM = Path(__file__).with_name("shim.py")


@dataclass(frozen=True)
class ExitStatus:
    """How a container process ended, in the kubelet's terms."""

    exit_code: int
    signal: int | None
    finished_at: float

    @classmethod
    def from_returncode(cls, returncode: int, finished_at: float) -> ExitStatus:
        if returncode < 0:
            # A runtime reports death by signal N as exit code 128+N.
            return cls(128 - returncode, -returncode, finished_at)
        return cls(returncode, None, finished_at)


class ContainerProcess:
    """A running container process (the leader of its process group).

    Create it with :func:`spawn` from the event loop thread that will also
    await it: the parent-death signal is bound to the spawning thread.
    """

    def __init__(self, popen: subprocess.Popen[bytes], started_at: float) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.started_at = started_at
        self._exit: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._watch()

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._poll_task = loop.create_task(self._poll())
            return

        def readable() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._finish()

        loop.add_reader(fd, readable)

    async def _poll(self) -> None:
        while True:
            try:
                # WNOWAIT: look without reaping, so the group can be killed first.
                result = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped elsewhere: it has exited all the same
                self._finish()
                return
            if result is not None:
                self._finish()
                return
            await asyncio.sleep(0.05)

    def _finish(self) -> None:
        # The leader is a zombie now: its pid (= the group id) is still reserved,
        # so killing the group cannot hit an unrelated process.
        self.kill_group(signal.SIGKILL)
        returncode = self.popen.wait()
        if not self._exit.done():
            self._exit.set_result(ExitStatus.from_returncode(returncode, time.time()))

    @property
    def exited(self) -> bool:
        return self._exit.done()

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._exit)

    def kill_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the container's group (no error if gone)."""
        if self.popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def stop(self, grace: float) -> ExitStatus:
        """SIGTERM the group, wait up to ``grace`` seconds, then SIGKILL it; return the exit."""
        if grace > 0:
            self.kill_group(signal.SIGTERM)
            try:
                return await asyncio.wait_for(self.wait(), grace)
            except asyncio.TimeoutError:
                pass
        self.kill_group(signal.SIGKILL)
        return await self.wait()


def _check_executable(command: str, env: Mapping[str, str], cwd: str) -> None:
    """Raise the OSError that exec would, before the shim is started."""
    if "/" in command:
        path = command if os.path.isabs(command) else os.path.join(cwd, command)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", command)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            raise PermissionError(errno.EACCES, "permission denied", command)
    elif shutil.which(command, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(errno.ENOENT, "executable file not found in $PATH", command)


def spawn(argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path) -> ContainerProcess:
    """Start ``argv`` as a container process logging to ``log_path``.

    Raises OSError (e.g. FileNotFoundError for an unknown executable) when the
    process cannot be started; the caller reports that as a failed start.
    """
    _check_executable(argv[0], env, cwd)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SHIM), str(os.getpid()), *argv],
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    return ContainerProcess(popen, time.time())

"""Ranks that run a binary (``start_processes`` with a str entrypoint)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO, Any

from .child import BINARY_TRAMPOLINE
from .exitwait import pidfd
from .pcontext import PContext
from .spawner import run_on_forking_thread

__all__ = ["SubprocessContext"]


class SubprocessContext(PContext):
    """Each rank is ``entrypoint *map(str, args[rank])`` in its own session.

    The binary is exec'd through a tiny Python trampoline that sets the parent-death
    signal first, so the rank keeps its pid and still dies with the launcher.

    The constructor is torch's: ``(name, entrypoint, args, envs, logs_specs,
    log_line_prefixes=None, numa_options=None, duplicate_stdout_filters=None,
    duplicate_stderr_filters=None)``, and kelastic's ``progbar_events=``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`~.api.PContext`'s arguments, torch's ``SubprocessContext``'s."""
        super().__init__(*args, **kwargs)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pidfds: dict[int, int] = {}

    def command(self, rank: int) -> list[str]:
        """The argv the rank's binary receives (every argument cast with ``str``)."""
        return [str(self.entrypoint), *(str(a) for a in self.args[rank])]

    def _start_one(self, rank: int, launcher_pid: int) -> subprocess.Popen[bytes]:
        logs = self.logs[rank]
        files: list[IO[bytes]] = []
        try:
            out = open(logs.stdout, "ab") if logs.stdout else None  # noqa: SIM115 - closed below
            if out:
                files.append(out)
            err = open(logs.stderr, "ab") if logs.stderr else None  # noqa: SIM115
            if err:
                files.append(err)
            return subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BINARY_TRAMPOLINE, str(launcher_pid), *self.command(rank)],
                env={**os.environ, **self.envs[rank]},
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            for f in files:
                f.close()

    def _start(self) -> None:
        launcher_pid = os.getpid()

        def start_all() -> None:
            for rank in range(self.nprocs):
                self._procs[rank] = self._start_one(rank, launcher_pid)
                fd = pidfd(self._procs[rank].pid)
                if fd is not None:  # else no pidfd support: wait() falls back to short sleeps
                    self._pidfds[rank] = fd

        run_on_forking_thread(start_all)

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._procs.items()}

    def _exitcode(self, rank: int) -> int | None:
        proc = self._procs.get(rank)
        return None if proc is None else proc.poll()

    def _sentinels(self) -> list[int]:
        return [fd for rank, fd in self._pidfds.items() if self._procs[rank].returncode is None]

    def _return_values(self) -> dict[int, Any]:
        return dict.fromkeys(range(self.nprocs))

    def _release(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

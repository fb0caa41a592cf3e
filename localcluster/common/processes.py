"""Stopping a child process: one way for every part of the local cluster.

:func:`stop_process` sends SIGTERM (or ``sig``), gives the process ``grace`` seconds, then
says through ``progress`` that it ignored the signal and sends SIGKILL, and reaps it, so no
zombie is left. With ``group`` the signals go to the process group the child leads (started
with ``start_new_session=True``); with ``kill_leftovers`` what is left of that group once the
leader exited is killed too (children that outlived it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

__all__ = ["stop_process"]


def stop_process(
    proc: subprocess.Popen[Any],
    grace: float,
    *,
    name: str = "",
    progress: Callable[[str], None] | None = None,
    group: bool = False,
    kill_leftovers: bool = False,
    sig: int = signal.SIGTERM,
    kill_grace: float | None = None,
) -> int:
    """Stop ``proc`` and reap it: ``sig``, up to ``grace`` s, then SIGKILL (said through
    ``progress``, naming ``name``), and up to ``kill_grace`` s (None: as long as it takes) for
    it to go. Returns its exit code; a process that had exited already is only reaped."""

    def send(s: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, s)
            else:
                proc.send_signal(s)

    if proc.poll() is None:
        send(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            if progress is not None:
                who = name or f"process {proc.pid}"
                progress(f"{who} ignored {signal.Signals(sig).name} for {grace:g} s: killing it")
            send(signal.SIGKILL)
    if group and kill_leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(kill_grace)

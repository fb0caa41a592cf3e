"""Stopping a child process (localcluster/common/processes.py), with real processes: SIGTERM
first, SIGKILL for one that ignores it (said through the progress callback), the process
group and what outlived its leader, and always reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kelastic.localcluster.common.processes import stop_process
from kelastic.localcluster.testing import process_alive, wait_for

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(600)"
)
#: A leader that stops on SIGTERM and leaves a child (in its group) that ignores it.
LEADER = (
    "import subprocess, sys, time; "
    f"child = subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}], stdout=subprocess.PIPE, text=True); "
    "child.stdout.readline(); print(child.pid, flush=True); time.sleep(600)"
)


def start(code: str, new_session: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=new_session
    )


def test_a_process_that_stops_on_sigterm_is_reaped_and_nothing_is_said() -> None:
    said: list[str] = []
    proc = start("import time; print('ready', flush=True); time.sleep(600)")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert stop_process(proc, 30, name="sleeper", progress=said.append) == -signal.SIGTERM
    assert said == [] and not process_alive(proc.pid)


def test_a_process_that_ignores_sigterm_is_killed_and_that_is_said() -> None:
    said: list[str] = []
    proc = start(IGNORES_SIGTERM)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert stop_process(proc, 0.2, name="stubborn", progress=said.append) == -signal.SIGKILL
    assert said == ["stubborn ignored SIGTERM for 0.2 s: killing it"]
    assert not process_alive(proc.pid)


@pytest.mark.parametrize("kill_leftovers", [True, False])
def test_what_outlived_the_groups_leader_is_killed_when_asked(kill_leftovers: bool) -> None:
    proc = start(LEADER, new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        assert stop_process(proc, 30, group=True, kill_leftovers=kill_leftovers) == -signal.SIGTERM
        if kill_leftovers:  # the child is the leader's, reaped by whoever inherited it
            wait_for(lambda: not process_alive(child), 30, f"the leader's child {child} to be killed")
        else:
            assert process_alive(child), "without kill_leftovers the group's other members are left"
    finally:
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_process_that_exited_already_is_only_reaped() -> None:
    said: list[str] = []
    proc = start("raise SystemExit(3)")
    proc.wait()
    assert stop_process(proc, 1, progress=said.append) == 3 and said == []

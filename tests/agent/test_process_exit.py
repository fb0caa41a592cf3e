"""The agent's process ends without finalizing the interpreter (kelastic.agent.process_exit)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).parent / "scripts" / "exit_probe.py"


def run_probe(mode: str, delay: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROBE), mode, str(delay)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.03, 0.1])
def test_a_torch_call_returning_while_the_agent_exits_does_not_abort_it(delay: float) -> None:
    """The call returns while the process ends (it aborts the interpreter's own exit on this
    machine every time at these delays, see the probe): the status is the one asked for, the
    atexit callbacks ran and nothing written was lost."""
    for _ in range(2):
        done = run_probe("kelastic", delay)
        assert done.returncode == 3, done.stderr[-2000:]
        assert done.stdout == "unflushed;atexit ran\n"
        assert "terminate called" not in done.stderr


@pytest.mark.slow
def test_the_interpreters_own_exit_is_what_aborts() -> None:
    """What the probe shows without kelastic's exit: the same process, ended by ``sys.exit``,
    dies of SIGABRT in at least one of a few runs (every one, on an idle machine). Were this
    to stop happening (CPython 3.14 no longer ends such threads with ``pthread_exit``), the
    test above would show nothing and should be revisited."""
    if sys.version_info >= (3, 14):
        pytest.skip("CPython 3.14 no longer ends a daemon thread that wakes during finalization")
    codes = [run_probe("sys", 0.1).returncode for _ in range(4)]
    assert -signal.SIGABRT in codes or 128 + signal.SIGABRT in codes, codes

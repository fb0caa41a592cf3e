"""A failed agent's last words: the termination message and the restart count it publishes.

Real ``python -m kelastic.agent`` processes whose only worker always crashes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.agent.rendezvous import ServerProcess, control, start_server_process

_CRASH = """
from kelastic.agent.multiprocessing import record

@record
def main() -> None:
    raise ValueError("planned crash\\nsecond line of the message")

main()
"""


def _run_agent(
    tmp_path: Path, agent_args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "crash.py"
    script.write_text(_CRASH)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "KELASTIC_"))}
    cmd = [
        sys.executable, "-m", "kelastic.agent", "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
        "--log-dir", str(tmp_path / "logs"), *agent_args, str(script),
    ]  # fmt: skip
    return subprocess.run(
        cmd,
        env={**base, "KELASTIC_NODE_NAME": "node-a", "PYTHONUNBUFFERED": "1", **env},
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,
    )


def test_failed_agent_writes_the_root_cause_to_its_termination_message(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    done = _run_agent(
        tmp_path,
        ["--standalone", "--max-restarts", "0"],
        {"KELASTIC_TERMINATION_MESSAGE_PATH": str(message)},
    )
    assert done.returncode == 1, done.stderr
    assert (
        message.read_text()
        == "rank 0 (local rank 0, node node-a) exited with code 1: ValueError: planned crash\n"
    )
    # the torchrun-style summary on stderr is unchanged
    assert "Root Cause (first observed failure):" in done.stderr
    assert "second line of the message" in done.stderr


def test_an_unwritable_termination_message_path_does_not_change_the_outcome(tmp_path: Path) -> None:
    done = _run_agent(
        tmp_path,
        ["--standalone", "--max-restarts", "0"],
        {"KELASTIC_TERMINATION_MESSAGE_PATH": str(tmp_path / "missing-dir" / "termination-log")},
    )
    assert done.returncode == 1, done.stderr
    assert "Root Cause (first observed failure):" in done.stderr
    assert not (tmp_path / "missing-dir").exists()


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    proc = start_server_process("127.0.0.1", 0, timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_crash_looping_agent_publishes_its_restarts(tmp_path: Path, server: ServerProcess) -> None:
    # The worker crashes at once, before any progress report or monitor tick.
    rdzv = [
        "--rdzv-backend", "kelastic", "--rdzv-endpoint", server.endpoint, "--rdzv-id", "crashloop",
        "--nnodes", "1", "--max-restarts", "2",
    ]  # fmt: skip
    done = _run_agent(
        tmp_path,
        rdzv,
        {"KELASTIC_TERMINATION_MESSAGE_PATH": str(tmp_path / "termination-log")},
    )
    assert done.returncode == 1, done.stderr
    status = control.read_status(control.connect(server.endpoint), "crashloop")
    assert status.members == ("node-a",)
    assert status.restarts == 2

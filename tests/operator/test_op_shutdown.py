"""A real ``kelastic-operator`` process stops promptly on SIGTERM, even when its API server is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.localcluster.testing import stop_process


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``kelastic local up`` (the emulator, CRDs applied, no operator) in its own process group."""
    data = tmp_path / "cluster"
    log = tmp_path / "cluster.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kelastic.localcluster",
            "local",
            "up",
            "--no-operator",
            "--data-dir",
            str(data),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_line(log, "kelastic local is up", proc, 60)
        yield proc, data / "kubeconfig"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        stop_process(proc, 15, group=True)


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"no {text!r} in {log} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_with_an_unanswering_api_server_exits_within_seconds(
    tmp_path: Path, api_server: tuple[subprocess.Popen[bytes], Path]
) -> None:
    cluster, kubeconfig = api_server
    log = tmp_path / "operator.log"
    operator = subprocess.Popen(
        [sys.executable, "-m", "kelastic.operator", "--kubeconfig", str(kubeconfig), "-n", "default"],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_line(log, "acquired leadership", operator, 60)
        # Gone without a trace: connections are accepted by the kernel, never answered.
        os.killpg(cluster.pid, signal.SIGSTOP)
        time.sleep(1.0)  # the election's next renewal is now blocked in a request
        operator.send_signal(signal.SIGTERM)
        # Generous for a busy machine; before the fix this took the requests' timeouts (30 s and more).
        code = operator.wait(20)
    finally:
        stop_process(operator, 1, group=True)
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert "could not release lease default/kelastic-operator: no answer within 2 s" in text
    assert "exiting without them" in text

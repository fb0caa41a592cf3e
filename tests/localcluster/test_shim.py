"""The container shim mirrors its command's end: exit code, or death by the same signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kelastic.localcluster.kubelet.runtime import SHIM


def _run_shim(script: str) -> subprocess.CompletedProcess[str]:
    # The shim checks that its parent is the "kubelet": this test process is.
    return subprocess.run(
        [sys.executable, "-I", "-S", str(SHIM), str(os.getpid()), "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        start_new_session=True,  # the shim leads its own group, as under the kubelet
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_shim_dies_by_the_signal_that_killed_its_command(sig: signal.Signals) -> None:
    # SIGKILL cannot be given a handler: the shim must not try (it used to fail with OSError).
    done = _run_shim(f"kill -{int(sig)} $$")
    assert done.returncode == -int(sig), done.stderr
    assert done.stderr == ""


def test_shim_exits_with_its_commands_exit_code() -> None:
    done = _run_shim("echo out; exit 3")
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "")

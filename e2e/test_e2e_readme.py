"""End-to-end: the README's main command, `kelastic local run examples/elasticjob.yaml`.

Runs the CLI as a user would, from the repository checkout: it starts a local
cluster and the operator, applies the example, relays logs and progress, and
must exit 0 once the job Succeeded. Local mode only (it brings its own cluster),
on both lanes: the API server emulator, and the real control plane with
``--control-plane`` (the operator then installed from the chart).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KELASTIC_E2E_REAL") == "1", reason="runs its own kelastic local cluster"
    ),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lane", ["emulator", "control-plane"])
def test_readme_main_command_runs_the_example_to_success(lane: str, request: pytest.FixtureRequest) -> None:
    kelastic = shutil.which("kelastic")
    command = [kelastic] if kelastic else [sys.executable, "-m", "kelastic.localcluster"]
    extra: list[str] = []
    if lane == "control-plane":
        extra = ["--control-plane", str(request.getfixturevalue("control_plane_bin"))]
    proc = subprocess.Popen(
        [*command, "local", "run", "--timeout", "300", "examples/elasticjob.yaml", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the CLI stops its cluster and pods on SIGINT
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"kelastic local run did not finish within 360 s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"kelastic local run exited {proc.returncode}:\n{output[-4000:]}"
    # Readable logs and progress reached the terminal: the pods' output is relayed with their names.
    assert "[train] done: 300 steps" in output, output[-4000:]
    assert "train-example-worker-" in output
    assert "Succeeded" in output

"""The last progress the workers report reaches the rendezvous store before the agent ends
(the job's PROGRESS must not stay at the previous periodic publication)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent.rendezvous import ServerProcess, control

pytestmark = pytest.mark.slow  # a real agent, worker and store

SCRIPT = """
import time
from kelastic.agent import progress
progress.update(1, 10)
progress.flush()
time.sleep(1.5)  # one periodic publication (once a second) carries step 1
progress.update(10, 10)
progress.flush()  # and the worker ends at once: only the agent's last word carries 10
"""


def test_the_final_step_is_in_the_store_when_the_agent_ends(
    server: ServerProcess, run_id: str, tmp_path: Path
) -> None:
    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable, "-m", "kelastic.agent", "--rdzv-backend", "kelastic", "--rdzv-endpoint",
        server.endpoint, "--rdzv-id", run_id, "--nnodes", "1", "--nproc-per-node", "1",
        "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"), str(script),
    ]  # fmt: skip
    env = {**os.environ, "KELASTIC_NODE_NAME": "node-a"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = control.read_progress(control.connect(server.endpoint, timeout=10), run_id, "node-a")
    assert report is not None and (report.step, report.total) == (10, 10)

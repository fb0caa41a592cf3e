"""End-to-end: an ElasticJob's life from apply to Succeeded, Failed or deleted.

Scenarios (a) and (h) of the operator issue. See conftest.py for the
cluster these run on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.lanes("emulator")
def test_a_example_job_runs_to_succeeded(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-a", steps=60, step_delay=0.05))
    uid = job["metadata"]["uid"]
    status = kel.wait_phase("e2e-a", {"Succeeded", "Failed"}, timeout=240)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    assert history[0]["event"] == "start" and history[0]["world_size"] == 3, history[:2]
    assert history[-1] == {**history[-1], "event": "done", "step": 60}
    assert status.get("completionTime") and status.get("startTime")
    assert status["replicaStatuses"]["Worker"]["succeeded"] >= 1
    # Readable logs: rank 0's pod says what it did.
    logs = "\n".join(
        kel.kubectl.run("logs", p["metadata"]["name"], check=False).stdout
        for p in kel.pods("e2e-a", role="worker")
    )
    assert "[train] done: 60 steps" in logs or not kel.pods("e2e-a", role="worker"), logs[-2000:]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (local mode: pods are processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.mark.lanes("control-plane")
def test_h_deleting_the_job_removes_every_pod_service_and_process(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-h", steps=2000, step_delay=0.05))
    uid = job["metadata"]["uid"]
    kel.wait_history(
        uid, "training to start in elasticjob/e2e-h", lambda h: any(e["event"] == "first_step" for e in h)
    )
    assert kel.pods("e2e-h") and kel.services("e2e-h")
    kel.kubectl.run("delete", "elasticjob", "e2e-h", "--wait=false")
    kel.wait_gone("e2e-h", timeout=90)
    if kel.local:
        # The rendezvous id (the job's UID) is on every agent's command line.
        def no_processes() -> bool:
            left = processes_mentioning(uid)
            if left:
                raise kel.LastSeen(left)
            return True

        kel.wait_for(f"every process of elasticjob/e2e-h (run id {uid}) to exit", no_processes, 60)

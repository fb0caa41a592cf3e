"""Table tests of reconcile's deadline policy: spec.activeDeadlineSeconds
(operator/reconcile/deadline.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_active_deadline(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        activeDeadlineSeconds=100, status={"phase": "Running", "startTime": "2026-01-01T12:00:00Z"}
    )
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))
    before = harness.run(body, kit.observed(*pods, at=40))
    assert before.status["phase"] == "Running" and before.requeue_after == pytest.approx(60)
    after = harness.run(body, kit.observed(*pods, at=100))
    assert after.status["phase"] == "Failed"
    assert harness.cond(after, "Failed")["reason"] == "DeadlineExceeded"
    assert "spec.activeDeadlineSeconds=100" in harness.cond(after, "Failed")["message"]
    assert len(harness.deleted_names(after)) == 4

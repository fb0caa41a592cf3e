"""Table tests of reconcile's below-minimum policy: too few workers for longer than
minReplicasTimeout fails the job (operator/reconcile/below_min.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.operator.observed import PodPhase

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_too_few_workers_for_too_long(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = (kit.store(), kit.worker(0), kit.worker(1, PodPhase.PENDING), kit.worker(2, PodPhase.PENDING))
    d = harness.run(body, kit.observed(*pods, at=0))
    assert d.status["belowMinSince"] == "2026-01-01T12:00:00Z"
    assert d.requeue_after == pytest.approx(60)
    body["status"] = d.status
    d2 = harness.run(body, kit.observed(*pods, at=61))
    assert d2.status["phase"] == "Failed"
    c = harness.cond(d2, "Failed")
    assert c["reason"] == "NotEnoughWorkers" and "spec.minReplicas=2" in c["message"]
    # recovering in time clears the clock
    d3 = harness.run(
        body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), kit.worker(2, PodPhase.PENDING), at=30)
    )
    assert "belowMinSince" not in d3.status and d3.status["phase"] != "Failed"


def test_annotation_overrides_min_replicas_timeout(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "belowMinSince": "2026-01-01T12:00:00Z"})
    body["metadata"]["annotations"] = {"kelastic.dev/min-replicas-timeout-seconds": "5"}
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), at=6))
    assert d.status["phase"] == "Failed"

"""Table tests of reconcile's success policy: the first wanted worker to succeed ends the job,
after a grace for the others (operator/reconcile/success.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile import DeleteService, Emit

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_success_when_workers_succeed(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = [kit.worker(i, PodPhase.SUCCEEDED, exit_code=0, finished_at=kit.T0) for i in range(3)]
    d = harness.run(body, kit.observed(kit.store(), *pods, at=2))
    assert d.status["phase"] == "Succeeded"
    assert d.status["completionTime"] == "2026-01-01T12:00:02Z"
    assert harness.cond(d, "Succeeded")["status"] == "True"
    assert harness.cond(d, "Running") is None or harness.cond(d, "Running")["status"] == "False"
    # cleanPodPolicy Running (default): succeeded pods stay for their logs; the store goes
    assert harness.deleted_names(d) == ["demo-rendezvous"]
    assert [a.name for a in harness.kinds(d, DeleteService)] == ["demo-rendezvous"]
    assert not any(a.warning for a in d.actions if not isinstance(a, Emit)), "cleanup is Normal"
    assert not harness.created_names(d)


def test_success_waits_for_stragglers_within_grace(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = [kit.worker(0, PodPhase.SUCCEEDED, exit_code=0, finished_at=kit.T0), kit.worker(1), kit.worker(2)]
    waiting = harness.run(body, kit.observed(kit.store(), *pods, at=3))
    assert waiting.status["phase"] == "Running"
    assert waiting.requeue_after == pytest.approx(7.0)
    assert not harness.created_names(waiting)
    done = harness.run(body, kit.observed(kit.store(), *pods, at=11))
    assert done.status["phase"] == "Succeeded"
    assert harness.deleted_names(done) == ["demo-worker-1", "demo-worker-2", "demo-rendezvous"]

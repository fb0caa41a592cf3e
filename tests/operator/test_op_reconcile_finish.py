"""Table tests of reconcile's end of a job: suspension, an invalid spec, the TTL and cleanPodPolicy
(operator/reconcile/finish.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile import CreateService, DeleteJob, Emit

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_suspend_and_resume(kit: SimpleNamespace) -> None:
    running = [{"type": "Running", "status": "True", "reason": "WorkersRunning", "message": ""}]
    status = {"phase": "Running", "scaledTo": 3, "startTime": "2026-01-01T11:00:00Z", "conditions": running}
    body = kit.job_body(suspend=True, status=status)
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))
    d = harness.run(body, kit.observed(*pods))
    assert d.status["phase"] == "Suspended"
    assert sorted(harness.deleted_names(d)) == [
        "demo-rendezvous",
        "demo-worker-0",
        "demo-worker-1",
        "demo-worker-2",
    ]
    assert "startTime" not in d.status
    assert not harness.created_names(d)
    body["status"] = d.status
    quiet = harness.run(body, kit.observed())
    assert not quiet.actions
    body["spec"]["suspend"] = False
    resumed = harness.run(body, kit.observed(at=50))
    assert sorted(harness.created_names(resumed)) == [
        "demo-rendezvous",
        "demo-worker-0",
        "demo-worker-1",
        "demo-worker-2",
    ]
    assert resumed.status["startTime"] == "2026-01-01T12:00:50Z"
    assert resumed.status["phase"] == "Restarting"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["spec"].update(maxReplicas=1), "spec.maxReplicas"),
        (
            lambda b: b["spec"]["replicaSpecs"]["Worker"].update(replicas=9),
            "spec.replicaSpecs.Worker.replicas",
        ),
        (lambda b: b["spec"]["replicaSpecs"]["Worker"].pop("template"), "spec.replicaSpecs.Worker.template"),
    ],
    ids=["max<min", "replicas-out-of-range", "no-template"],
)
def test_invalid_spec_fails_with_condition_and_event(kit: SimpleNamespace, mutate: Any, field: str) -> None:
    body = kit.job_body()
    mutate(body)
    d = harness.run(body, kit.observed(services=()))
    assert d.status["phase"] == "Failed"
    invalid = harness.cond(d, "Invalid")
    assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec"
    assert field in invalid["message"]
    (event,) = harness.kinds(d, Emit)
    assert event.warning and field in event.message
    assert not harness.created_names(d)
    # the same invalid job again: no second Event (no event storm from the periodic timer)
    body["status"] = d.status
    assert not harness.kinds(harness.run(body, kit.observed(services=(), at=5)), Emit)


def test_fixing_an_invalid_spec_restarts_the_job(kit: SimpleNamespace) -> None:
    body = kit.job_body(max_r=1)
    bad = harness.run(body, kit.observed(services=()))
    body["status"] = bad.status
    body["spec"]["maxReplicas"] = 4
    good = harness.run(body, kit.observed(services=(), at=3))
    assert harness.cond(good, "Invalid")["status"] == "False"
    assert good.status["phase"] == "Created"
    assert "completionTime" not in good.status
    assert harness.kinds(good, CreateService)


def test_finished_job_is_left_alone_then_deleted_after_ttl(kit: SimpleNamespace) -> None:
    status = {"phase": "Succeeded", "completionTime": "2026-01-01T12:00:00Z"}
    body = kit.job_body(ttlSecondsAfterFinished=30, status=status)
    done = [kit.worker(i, PodPhase.SUCCEEDED, exit_code=0) for i in range(3)]
    d = harness.run(body, kit.observed(*done, services=(), at=10))
    assert not d.actions and d.requeue_after == pytest.approx(20)
    d2 = harness.run(body, kit.observed(*done, services=(), at=31))
    assert harness.kinds(d2, DeleteJob)


def test_clean_pod_policy_all_and_none(kit: SimpleNamespace) -> None:
    status = {"phase": "Failed", "completionTime": "2026-01-01T12:00:00Z"}
    pods = (kit.worker(0, PodPhase.FAILED, exit_code=1), kit.worker(1))
    all_ = harness.run(kit.job_body(cleanPodPolicy="All", status=status), kit.observed(*pods, services=()))
    assert harness.deleted_names(all_) == ["demo-worker-0", "demo-worker-1"]
    none = harness.run(kit.job_body(cleanPodPolicy="None", status=status), kit.observed(*pods, services=()))
    assert harness.deleted_names(none) == []

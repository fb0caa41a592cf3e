"""Table tests of reconcile's membership policy: the running workers within range are published to
the rendezvous (operator/reconcile/membership.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile import CreatePod, DeletePod, Emit, PublishMembership

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_running_job_is_steady_and_publishes_membership(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "startTime": "2026-01-01T12:00:00Z"})
    obs = kit.observed(kit.store(), *(kit.worker(i, ready=True) for i in range(3)), at=5)
    d = harness.run(body, obs)
    assert not harness.kinds(d, CreatePod) and not harness.kinds(d, DeletePod)
    (pub,) = harness.kinds(d, PublishMembership)
    assert pub.nodes == ("demo-worker-0", "demo-worker-1", "demo-worker-2")
    # The bounds are minReplicas and replicas (not maxReplicas): a pod past replicas parks as a standby.
    assert (pub.min_nodes, pub.max_nodes, pub.run_id, pub.store_id) == (2, 3, "uid-demo", "store-1")
    assert d.status["phase"] == "Running"
    assert d.status["replicaStatuses"]["Worker"] == {"active": 3, "ready": 3, "succeeded": 0, "failed": 0}
    # applying the status and reconciling again is a fixed point
    body["status"] = d.status
    again = harness.run(body, obs)
    assert again.status == d.status
    assert not harness.kinds(again, Emit)


def test_lost_pod_is_replaced_and_pending_pods_are_not_members(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        status={"phase": "Running", "scaledTo": 3, "conditions": [], "startTime": "2026-01-01T12:00:00Z"}
    )
    body["status"]["conditions"] = [
        {"type": "Running", "status": "True", "reason": "WorkersRunning", "message": ""}
    ]
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(2), at=5))
    assert harness.created_names(d) == ["demo-worker-1"]
    assert harness.kinds(d, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")
    assert d.status["phase"] == "Restarting"
    # the replacement is Pending: it is not listed, so it cannot block the survivors
    d2 = harness.run(
        body, kit.observed(kit.store(), kit.worker(0), kit.worker(1, PodPhase.PENDING), kit.worker(2), at=6)
    )
    assert not harness.created_names(d2)
    assert harness.kinds(d2, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")


def test_c10d_backend_publishes_no_membership(kit: SimpleNamespace) -> None:
    body = kit.job_body(rdzvBackend="c10d", status={"phase": "Running"})
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert not harness.kinds(d, PublishMembership)

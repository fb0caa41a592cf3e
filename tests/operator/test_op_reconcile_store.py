"""Table tests of reconcile's store policy: the rendezvous store's pod and Service created,
repaired, or not needed (operator/reconcile/store.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import PodPhase, ServiceView
from kelastic.operator.reconcile import CreateService, DeletePod, PublishMembership, ReconcileConfig

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_dead_store_is_recreated_and_membership_republished(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    workers = [kit.worker(i) for i in range(3)]
    dead = harness.run(body, kit.observed(kit.store(PodPhase.FAILED), *workers))
    assert harness.deleted_names(dead) == ["demo-rendezvous"]
    assert [a.warning for a in harness.kinds(dead, DeletePod)] == [True]
    assert not harness.kinds(dead, PublishMembership)
    gone = harness.run(body, kit.observed(*workers))
    assert harness.created_names(gone) == ["demo-rendezvous"]
    back = harness.run(body, kit.observed(kit.store(uid="store-2"), *workers))
    assert harness.kinds(back, PublishMembership)[0].store_id == "store-2"


def test_lost_service_is_recreated(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), services=()))
    assert harness.kinds(d, CreateService)


def test_external_endpoint_needs_no_store(kit: SimpleNamespace) -> None:
    body = kit.job_body(rdzvEndpoint="10.0.0.9:29400")
    d = harness.run(body, kit.observed(services=()), ReconcileConfig(allow_external_stores=True))
    assert not harness.kinds(d, CreateService)
    assert harness.created_names(d) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]


def test_service_of_an_earlier_job_with_the_same_name_is_not_used(kit: SimpleNamespace) -> None:
    old = ServiceView(name="demo-rendezvous", uid="svc-old", cluster_ip="127.2.0.9", owner_uid="uid-previous")
    d = harness.run(kit.job_body(), kit.observed(services=(old,)))
    assert not harness.kinds(d, CreateService), "the name is taken until the old Service is gone"
    assert harness.created_names(d) == ["demo-rendezvous"]  # the store pod; no workers without an endpoint
    assert "rdzvEndpoint" not in d.status

"""Table tests of reconcile's lost-node policy (operator/reconcile/lost_node.py): a worker or
store pod that the control plane evicted from a node it gave up is force-deleted, and its
replacement follows; nothing else is.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile import DeletePod
from kelastic.operator.reconcile.lost_node import REASON, nodes_to_read

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))

EVICTED = {"terminating": True, "disruption": "DeletionByTaintManager", "node": "n2"}


def running(kit: SimpleNamespace) -> dict:
    return kit.job_body(status={"phase": "Running", "scaledTo": 3})


def forced(decision: object) -> list[DeletePod]:
    return [a for a in harness.kinds(decision, DeletePod) if a.reason == REASON]


def test_a_worker_evicted_from_a_lost_node_is_force_deleted_then_replaced(kit: SimpleNamespace) -> None:
    body = running(kit)
    alive = [kit.worker(0, node="n1"), kit.worker(2, node="n1"), kit.store(node="n1")]
    dead = kit.worker(1, uid="pod-old", **EVICTED)
    d = harness.run(body, kit.observed(*alive, dead, lost_nodes={"n2": "unreachable"}))
    (action,) = forced(d)
    assert (action.name, action.uid, action.grace_seconds, action.warning) == (
        "demo-worker-1",
        "pod-old",
        0,
        True,
    )
    assert action.message == (
        "worker pod demo-worker-1 was on node n2, which is unreachable; its containers cannot be stopped "
        "there: deleted so that its replacement can start"
    )
    assert not harness.created_names(d), "the name is taken until the force delete went through"
    assert harness.cond(d, "Disrupted")["reason"] == "DeletionByTaintManager"
    # Gone: the replacement takes its name (wherever the scheduler puts it).
    after = harness.run(body, kit.observed(*alive))
    assert harness.created_names(after) == ["demo-worker-1"] and not forced(after)


def test_the_store_evicted_from_a_lost_node_is_force_deleted_then_recreated(kit: SimpleNamespace) -> None:
    body = running(kit)
    workers = [kit.worker(i, node="n1") for i in range(3)]
    d = harness.run(
        body, kit.observed(*workers, kit.store(uid="store-old", **EVICTED), lost_nodes={"n2": "NotReady"})
    )
    (action,) = forced(d)
    assert (action.name, action.uid, action.grace_seconds) == ("demo-rendezvous", "store-old", 0)
    assert "rendezvous store pod demo-rendezvous was on node n2, which is NotReady" in action.message
    assert not harness.created_names(d)
    after = harness.run(body, kit.observed(*workers))
    assert harness.created_names(after) == ["demo-rendezvous"]


def test_nothing_is_forced_unless_the_control_plane_gave_up_both_pod_and_node(kit: SimpleNamespace) -> None:
    body = running(kit)
    alive = [kit.worker(0, node="n1"), kit.worker(2, node="n1"), kit.store(node="n1")]
    cases = {
        # the taint manager deleted it, but its node reports again (or is merely slow to stop it)
        "node held": (kit.worker(1, **EVICTED), {}),
        "another node lost": (kit.worker(1, **EVICTED), {"n3": "unreachable"}),
        # deleted by someone else (a user, a scale-down): its kubelet, or its node's return, ends it
        "deleted by a user": (kit.worker(1, terminating=True, node="n2"), {"n2": "unreachable"}),
        "evicted by the API": (
            kit.worker(1, terminating=True, disruption="EvictionByEvictionAPI", node="n2"),
            {"n2": "unreachable"},
        ),
        # the condition is written before the delete: not terminating yet, nothing to force
        "marked, not deleted": (
            kit.worker(1, disruption="DeletionByTaintManager", node="n2"),
            {"n2": "unreachable"},
        ),
        "never scheduled": (
            kit.worker(1, PodPhase.PENDING, terminating=True, disruption="DeletionByTaintManager"),
            {"n2": "unreachable"},
        ),
    }
    for what, (pod, lost) in cases.items():
        d = harness.run(body, kit.observed(*alive, pod, lost_nodes=lost))
        assert not forced(d), what


def test_the_controller_reads_only_the_nodes_of_pods_the_taint_manager_deleted(kit: SimpleNamespace) -> None:
    pods = [
        kit.worker(0, node="n1"),
        kit.worker(1, **EVICTED),
        kit.worker(2, terminating=True, node="n3"),
        kit.store(**{**EVICTED, "node": "n4"}),
    ]
    assert nodes_to_read(pods) == {"n2", "n4"}
    assert nodes_to_read([kit.worker(0, node="n1")]) == set()


def test_the_executor_force_deletes_on_the_api_server_and_says_so(kit: SimpleNamespace, kube: object) -> None:
    """The decision carried out by the real executor on the API server emulator: the pod, bound
    to a node whose kubelet never answers, is gone at once, with one ``ForceDeleted`` Event."""
    from kelastic.operator.kube import ApiError
    from kelastic.operator.spec import parse_job

    body = running(kit)
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-worker-1"},
        "spec": {"nodeName": "n2", "containers": [{"name": "trainer", "image": "x"}]},
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
    kube.request("POST", "/api/v1/namespaces", namespace)  # type: ignore[attr-defined]
    uid = kube.create("ns", "pods", manifest)["metadata"]["uid"]  # type: ignore[attr-defined]
    alive = [kit.worker(0, node="n1"), kit.worker(2, node="n1"), kit.store(node="n1")]
    dead = kit.worker(1, uid=uid, **EVICTED)
    decision = harness.run(body, kit.observed(*alive, dead, lost_nodes={"n2": "unreachable"}))
    executor, posted = harness.apply_decision(kube, parse_job(body), body, decision)
    assert [reason for reason, _ in posted if reason == REASON] == [REASON], posted
    assert not executor.failed
    try:
        kube.request("GET", kube.core_path("ns", "pods", "demo-worker-1"))  # type: ignore[attr-defined]
        raise AssertionError("the force-deleted pod is still there")
    except ApiError as err:
        assert err.status == 404, err

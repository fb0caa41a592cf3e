"""A lost node (operator/nodeloss.py): the tolerations the operator gives its worker and store
pods, and when it reads a node as given up by the control plane.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kelastic.operator import nodeloss
from kelastic.operator.builders import BuildConfig, store_pod, worker_pod
from kelastic.operator.spec import parse_job

UNREACHABLE, NOT_READY = nodeloss.NODE_LOSS_TAINTS


def loss_tolerations(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod's tolerations of the node-loss taints, by key."""
    return {
        t["key"]: t for t in pod["spec"].get("tolerations") or () if t.get("key") in nodeloss.NODE_LOSS_TAINTS
    }


def test_worker_and_store_pods_leave_a_lost_node_after_a_few_seconds(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body())
    for pod in (
        worker_pod(job, 0, endpoint="10.0.0.1:29400", config=BuildConfig()),
        store_pod(job, config=BuildConfig()),
    ):
        assert loss_tolerations(pod) == {
            key: {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}
            for key in (UNREACHABLE, NOT_READY)
        }, pod["metadata"]["name"]
    config = BuildConfig(node_loss_toleration=30)
    assert {t["tolerationSeconds"] for t in loss_tolerations(store_pod(job, config=config)).values()} == {30}
    # None: the API server's default (300 s, which it adds itself)
    config = BuildConfig(node_loss_toleration=None)
    assert "tolerations" not in worker_pod(job, 0, endpoint="10.0.0.1:29400", config=config)["spec"]


def test_the_templates_own_tolerations_of_those_taints_win(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    mine = [
        {"key": "gpu", "operator": "Exists"},
        {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 600},
    ]
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["tolerations"] = mine
    job = parse_job(body)
    for pod in (
        worker_pod(job, 1, endpoint="10.0.0.1:29400", config=BuildConfig()),
        store_pod(job, config=BuildConfig()),
    ):
        assert pod["spec"]["tolerations"] == [
            *mine,
            {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
        ]
    # A toleration of every taint (no key, Exists) tolerates these too, for ever: left alone.
    everything = [{"operator": "Exists"}]
    assert nodeloss.with_node_loss_tolerations(everything, 5) == everything
    # A toleration with the key and another effect still counts as the user's choice for that key.
    assert nodeloss.with_node_loss_tolerations([{"key": NOT_READY, "operator": "Exists"}], 5) == [
        {"key": NOT_READY, "operator": "Exists"},
        {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
    ]


def node(ready: str | None, *taints: tuple[str, str]) -> dict[str, Any]:
    conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {
        "metadata": {"name": "n1"},
        "spec": {"taints": [{"key": k, "effect": e} for k, e in taints]},
        "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}, *conditions]},
    }


def test_a_node_is_lost_when_it_is_not_ready_tainted_for_it_or_gone() -> None:
    assert nodeloss.node_lost(node("True")) is None
    assert nodeloss.node_lost(node(None)) is None  # not reported yet: the control plane holds it
    # a user's NoExecute taint on a Ready node: the kubelet there stops the pods itself
    assert nodeloss.node_lost(node("True", ("maintenance", "NoExecute"))) is None
    assert nodeloss.node_lost(node("True", (UNREACHABLE, "NoSchedule"))) is None
    assert nodeloss.node_lost(node("Unknown")) == "unreachable"
    assert nodeloss.node_lost(node("False")) == "NotReady"
    assert nodeloss.node_lost(node("Unknown", (UNREACHABLE, "NoExecute"))) == "unreachable"
    assert nodeloss.node_lost(node("True", (NOT_READY, "NoExecute"))) == "NotReady"  # taint not yet lifted
    assert nodeloss.node_lost(None) == "gone"


def test_a_force_delete_removes_only_that_incarnation_at_once(kube: Any) -> None:
    """``Kube.delete`` with ``grace_seconds=0`` on the API server emulator: a pod bound to a node
    whose kubelet never answers goes at once; a precondition on another uid deletes nothing."""
    from kelastic.operator.kube import ApiError

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w"},
        "spec": {"nodeName": "n2", "containers": [{"name": "c", "image": "x"}]},
    }
    created = kube.create("default", "pods", pod)
    try:
        kube.delete("default", "pods", "w", "another-uid", 0)
        raise AssertionError("a delete with another uid's precondition went through")
    except ApiError as err:
        assert err.status == 409, err
    kube.delete("default", "pods", "w", created["metadata"]["uid"], 0)
    try:
        kube.request("GET", kube.core_path("default", "pods", "w"))
        raise AssertionError("the force-deleted pod is still there")
    except ApiError as err:
        assert err.status == 404, err

"""Evicted and preempted workers: recognised, recreated without touching backoffLimit, named in a condition."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.disruption import CONDITION_DISRUPTED, describe, disruption_reason
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.observed import PodPhase, pod_view
from kelastic.operator.reconcile import DeletePod, Emit, reconcile
from kelastic.operator.spec import parse_job
from kelastic.operator.status import find_condition


def test_disruption_reason_from_the_condition_or_the_kubelets_reason() -> None:
    evicted = {
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    }
    assert disruption_reason(evicted) == "EvictionByEvictionAPI"
    assert disruption_reason({"phase": "Failed", "reason": "Evicted"}) == "Evicted"
    assert disruption_reason({"conditions": [{"type": "DisruptionTarget", "status": "False"}]}) is None
    assert disruption_reason({"phase": "Failed", "reason": "Error"}) is None
    assert describe("w-1", "PreemptionByScheduler") == "worker pod w-1 was preempted (PreemptionByScheduler)"
    body = {"metadata": {"name": "w-1", "uid": "u"}, "status": {"phase": "Failed", "reason": "Evicted"}}
    assert pod_view(body).disruption == "Evicted"


def _conditions(decision: Any) -> list[dict[str, Any]]:
    return list(decision.status.get("conditions") or [])


def test_a_node_evicted_worker_is_recreated_without_counting_against_backoff(kit: SimpleNamespace) -> None:
    body = kit.job_body(backoffLimit=0, status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    evicted = kit.worker(1, PodPhase.FAILED, reason="Evicted", exit_code=137, disruption="Evicted")
    decision = reconcile(parse_job(body), kit.observed(kit.store(), kit.worker(0), evicted, kit.worker(2)))
    deletes = [a for a in decision.actions if isinstance(a, DeletePod)]
    assert [(a.reason, a.name) for a in deletes] == [("RecreateEvicted", "demo-worker-1")]
    assert decision.status["phase"] != "Failed"  # backoffLimit 0 and yet no failure
    assert int(decision.status.get("backoffCount") or 0) == 0
    cond = find_condition(_conditions(decision), CONDITION_DISRUPTED)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "Evicted"
    assert "demo-worker-1 was evicted by its node" in cond["message"]
    assert any(isinstance(a, Emit) and a.reason == "Evicted" and a.warning for a in decision.actions)


def test_an_eviction_through_the_api_names_the_reason_and_clears_once_replaced(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    going = kit.worker(2, terminating=True, disruption="EvictionByEvictionAPI")
    decision = reconcile(parse_job(body), kit.observed(kit.store(), kit.worker(0), kit.worker(1), going))
    assert not [a for a in decision.actions if isinstance(a, DeletePod)]  # already being deleted
    cond = find_condition(_conditions(decision), CONDITION_DISRUPTED)
    assert cond is not None and cond["reason"] == "EvictionByEvictionAPI"
    # the same pass again: no second Event for the same condition
    again = reconcile(
        parse_job({**body, "status": decision.status}),
        kit.observed(kit.store(), kit.worker(0), kit.worker(1), going),
    )
    assert not [a for a in again.actions if isinstance(a, Emit) and a.reason == "EvictionByEvictionAPI"]
    # gone and replaced: the condition turns False
    back = reconcile(
        parse_job({**body, "status": again.status}),
        kit.observed(kit.store(), kit.worker(0), kit.worker(1), kit.worker(2, uid="new")),
    )
    cond = find_condition(_conditions(back), CONDITION_DISRUPTED)
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "Recovered"


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        # bound to a node, so deleting it waits out a grace period (an unbound pod goes at once)
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x"}]},
    }


def test_the_emulators_eviction_marks_the_pod_then_deletes_it(kube: Kube, tmp_path: Path) -> None:
    kube.create("default", "pods", _pod("victim"))
    path = kube.core_path("default", "pods", "victim") + "/eviction"
    with pytest.raises(ApiError, match="does not match"):
        kube.request(
            "POST", path, {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "other"}}
        )
    answer = kube.request(
        "POST",
        path,
        {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": "victim"},
            "deleteOptions": {"gracePeriodSeconds": 30},
        },
    )
    assert answer["kind"] == "Status" and answer["status"] == "Success"
    pod = kube.request("GET", kube.core_path("default", "pods", "victim"))
    # no kubelet runs on this bare API server: the pod waits out its grace period, marked
    assert pod["metadata"]["deletionTimestamp"]
    (cond,) = [c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "True",
        "EvictionByEvictionAPI",
        "Eviction API: evicting",
    )
    assert pod_view(pod).disruption == "EvictionByEvictionAPI"

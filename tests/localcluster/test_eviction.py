"""The emulator's pods/eviction subresource honours PodDisruptionBudgets (429 as kube-apiserver answers).

The budget arithmetic and the verdict are pure functions; one test drives the
emulator over HTTP with the official client, as ``kubectl drain`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.apiserver.eviction import VIOLATION, budget_of, pdb_verdict


def pod(
    name: str, *, ready: bool = True, phase: str = "Running", deleting: bool = False, **labels: str
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels or {"app": "guarded"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pdb(name: str = "guard", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selector": {"matchLabels": {"app": "guarded"}}, **spec}}


def test_budget_figures_follow_min_available_and_max_unavailable() -> None:
    pods = [pod("a"), pod("b"), pod("c", ready=False), pod("d", deleting=True), pod("x", app="other")]
    assert budget_of(pdb(minAvailable=2), pods).__dict__ == {
        "name": "guard",
        "expected_pods": 4,
        "desired_healthy": 2,
        "current_healthy": 2,
    }
    assert budget_of(pdb(minAvailable=1), pods).disruptions_allowed == 1
    assert budget_of(pdb(minAvailable="50%"), pods).desired_healthy == 2
    assert budget_of(pdb(minAvailable="60%"), pods).desired_healthy == 3  # rounded up
    assert budget_of(pdb(maxUnavailable=1), pods).desired_healthy == 3
    assert budget_of(pdb(maxUnavailable="30%"), pods).desired_healthy == 2  # 4 - ceil(1.2)


def test_the_verdict_refuses_what_the_budget_forbids() -> None:
    running = [pod("a"), pod("b")]
    refusal = pdb_verdict(running[0], [pdb(minAvailable=2)], running)
    assert refusal is not None and (refusal.code, refusal.reason, refusal.message) == (
        429,
        "TooManyRequests",
        VIOLATION,
    )
    assert refusal.to_status()["details"] == {
        "causes": [
            {
                "reason": "DisruptionBudget",
                "message": "The disruption budget guard needs 2 healthy pods and has 2 currently",
            }
        ]
    }
    assert pdb_verdict(running[0], [pdb(minAvailable=1)], running) is None
    assert pdb_verdict(running[0], [], running) is None
    two = pdb_verdict(running[0], [pdb("one", minAvailable=1), pdb("two", minAvailable=1)], running)
    assert two is not None and two.code == 500 and "more than one PodDisruptionBudget" in two.message


@pytest.mark.parametrize(
    ("evicted", "why"),
    [
        (pod("p", phase="Pending"), "not started"),
        (pod("s", phase="Succeeded"), "ended"),
        (pod("f", phase="Failed"), "ended"),
        (pod("x", app="other"), "not covered"),
        (pod("u", ready=False), "unhealthy, and the budget is met without it"),
    ],
)
def test_pods_that_disrupt_nothing_go_regardless(evicted: dict[str, Any], why: str) -> None:
    pods = [pod("a"), pod("b"), evicted]
    assert pdb_verdict(evicted, [pdb(minAvailable=2)], pods) is None, why


def test_an_unhealthy_pod_of_an_unmet_budget_needs_always_allow() -> None:
    pods = [pod("a"), pod("u", ready=False)]
    assert pdb_verdict(pods[1], [pdb(minAvailable=2)], pods) is not None
    assert pdb_verdict(pods[1], [pdb(minAvailable=2, unhealthyPodEvictionPolicy="AlwaysAllow")], pods) is None


def test_an_empty_selector_covers_nothing() -> None:
    pods = [pod("a")]
    assert (
        pdb_verdict(
            pods[0], [{"metadata": {"name": "all"}, "spec": {"selector": {}, "minAvailable": 5}}], pods
        )
        is None
    )


def test_the_emulator_answers_429_until_the_budget_allows_the_eviction(api: ApiServer) -> None:
    api_client = config.new_client_from_config(str(api.data_dir / "kubeconfig"))
    core, policy = client.CoreV1Api(api_client), client.PolicyV1Api(api_client)
    ns = "default"
    for name in ("guarded-a", "guarded-b"):
        core.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": name, "labels": {"app": "guarded"}},
                "spec": {"nodeName": "elsewhere", "containers": [{"name": "c", "image": "x"}]},
            },
        )
        core.patch_namespaced_pod_status(
            name, ns, {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        )
    policy.create_namespaced_pod_disruption_budget(
        ns,
        {
            "metadata": {"name": "guard"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}},
        },
    )
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "guarded-a"},
        "deleteOptions": {"gracePeriodSeconds": 0},
    }
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction("guarded-a", ns, eviction)
    assert refused.value.status == 429 and "disruption budget" in str(refused.value.body)
    assert core.read_namespaced_pod("guarded-a", ns).metadata.deletion_timestamp is None  # untouched
    policy.patch_namespaced_pod_disruption_budget("guard", ns, {"spec": {"minAvailable": 1}})
    core.create_namespaced_pod_eviction("guarded-a", ns, eviction)
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("guarded-a", ns)
    assert gone.value.status == 404
    # The last healthy pod is what the budget keeps.
    with pytest.raises(ApiException) as last:
        core.create_namespaced_pod_eviction("guarded-b", ns, {**eviction, "metadata": {"name": "guarded-b"}})
    assert last.value.status == 429 and "needs 1 healthy pods and has 1 currently" in str(last.value.body)

"""Conformance of what operating kelastic relies on: NetworkPolicies, PodGroup custom resources and the
pods/eviction subresource, on the emulator and the real kube-apiserver (v1.20), answers compared.

PodDisruptionBudgets: an eviction the budget forbids is refused with 429 by both (the budget
created in the version discovery offers). Not compared, as the releases differ among themselves:
a pod covered by two budgets (v1.20 answers a bare 500 Status, later releases an InternalError),
and the eviction of a pod that is not Ready (allowed when the budget is met from v1.26 on).

Known, intended differences (the emulator answers as the v1.37 it reports): it marks an evicted
pod with the ``DisruptionTarget`` condition before deleting it, which v1.26+ servers do and v1.20
does not; and it takes ``policy/v1`` Evictions, which v1.20 refuses (policy/v1beta1 only).
The sequence evicts unscheduled pods, which both delete at once, so the transcripts agree; the
condition itself is tested against the emulator alone (tests/operator/test_op_disruption.py).
"""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

conformance = runpy.run_path(str(Path(__file__).with_name("test_conformance.py")))
Server, status_body, wait, NS = (
    conformance["Server"],
    conformance["status_body"],
    conformance["wait"],
    conformance["NS"],
)
PODGROUP_CRDS = Path(__file__).parents[1] / "operator" / "crds" / "podgroups.yaml"

pytestmark = pytest.mark.slow

POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "store"},
    "spec": {
        "podSelector": {"matchLabels": {"kelastic.dev/role": "rendezvous"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {"kelastic.dev/role": "worker"}}}],
                "ports": [{"protocol": "TCP", "port": 29400}],
            }
        ],
    },
}


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def eviction(name: str, version: str = "policy/v1beta1") -> dict[str, Any]:
    return {"apiVersion": version, "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}


def run_sequence(server: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policies = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
    code, body = server.raw("POST", policies, POLICY)
    out["netpol create"] = (code, body.get("spec"))
    code, body = server.raw("POST", policies, POLICY)
    out["netpol again/409"] = (code, status_body(body))
    code, body = server.raw(
        "PATCH", f"{policies}/store", {"spec": {"policyTypes": ["Ingress"]}}, "application/merge-patch+json"
    )
    out["netpol merge patch"] = (code, body.get("spec", {}).get("ingress"))

    server.kubectl("apply", "-f", str(PODGROUP_CRDS))
    wait(
        "the PodGroup kinds",
        lambda: server.raw("GET", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{NS}/podgroups")[0] == 200,
        60,
    )
    wait(
        "the Volcano kind",
        lambda: server.raw("GET", f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups")[0] == 200,
        60,
    )
    for api in ("scheduling.volcano.sh/v1beta1", "scheduling.x-k8s.io/v1alpha1"):
        path = f"/apis/{api}/namespaces/{NS}/podgroups"
        group = {"apiVersion": api, "kind": "PodGroup", "metadata": {"name": "job"}, "spec": {"minMember": 2}}
        code, body = server.raw("POST", path, group)
        out[f"{api} create"] = (code, body.get("spec"))
        code, body = server.raw(
            "PATCH", f"{path}/job", {"spec": {"minMember": 1}}, "application/merge-patch+json"
        )
        out[f"{api} patch minMember"] = (code, body.get("spec"))

    pods = f"/api/v1/namespaces/{NS}/pods"
    # policy/v1beta1: a v1.20 server has no policy/v1 Eviction (400 "no kind Eviction is registered
    # for version policy/v1"); v1.22+ and the emulator (a v1.37) take both.
    for version in ("policy/v1beta1",):
        name = "evict-" + version.split("/")[1]
        server.raw("POST", pods, pod(name))
        code, body = server.raw("POST", f"{pods}/{name}/eviction", eviction(name, version))
        out[f"evict {version}"] = (code, status_body(body))
        out[f"evicted {version} gone"] = wait(
            "the evicted pod to go", lambda n=name: server.raw("GET", f"{pods}/{n}")[0] == 404, 30
        )
    server.raw("POST", pods, pod("keep"))
    code, body = server.raw("POST", f"{pods}/keep/eviction", eviction("other"))
    out["evict name mismatch/400"] = (code, body.get("reason"), "does not match" in str(body.get("message")))
    code, body = server.raw("POST", f"{pods}/missing/eviction", eviction("missing"))
    out["evict missing/404"] = (code, status_body(body))
    out.update(disruption_budget_sequence(server))
    return out


def _served(server: Any, group_version: str, plural: str) -> bool:
    code, body = server.raw("GET", f"/apis/{group_version}")
    return code == 200 and any(r.get("name") == plural for r in body.get("resources") or [])


def disruption_budget_sequence(server: Any) -> dict[str, Any]:
    """Evictions against a PodDisruptionBudget: 429 while it forbids them, 201 once it allows one.

    The budget's version is the one discovery offers (v1.20: policy/v1beta1 only; the
    emulator: policy/v1 only). The pods are made Running and Ready by hand (no kubelet
    here) on a Node object of their own. kube-apiserver judges by the budget's status,
    which its disruption controller computes a moment after each change: the sequence
    waits for that there; the emulator works the figures out at the eviction itself.
    """
    out: dict[str, Any] = {}
    pods = f"/api/v1/namespaces/{NS}/pods"
    version = next(v for v in ("policy/v1", "policy/v1beta1") if _served(server, v, "poddisruptionbudgets"))
    budgets = f"/apis/{version}/namespaces/{NS}/poddisruptionbudgets"
    server.raw("POST", "/api/v1/nodes", {"metadata": {"name": "conformance-node"}})
    for name in ("guarded-a", "guarded-b"):
        body = {**pod(name), "metadata": {"name": name, "labels": {"app": "guarded"}}}
        body["spec"] = {**body["spec"], "nodeName": "conformance-node"}
        code, _ = server.raw("POST", pods, body)
        assert code == 201, (server.name, name, code)
        code, _ = server.raw(
            "PATCH",
            f"{pods}/{name}/status",
            {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
            "application/merge-patch+json",
        )
        assert code == 200, (server.name, name, code)
    guard = {
        "apiVersion": version,
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guard"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    code, _ = server.raw("POST", budgets, guard)
    out["pdb create"] = code

    def processed(**figures: int) -> bool:
        if server.name == "emulator":
            return True  # no disruption controller: the figures are worked out at the eviction
        body = server.raw("GET", f"{budgets}/guard")[1]
        status = body.get("status") or {}
        caught_up = int(status.get("observedGeneration") or 0) >= int(body["metadata"].get("generation") or 0)
        return caught_up and all(int(status.get(k) or 0) == v for k, v in figures.items())

    def evict(name: str) -> tuple[int, Any, Any, list[Any]]:
        request = {**eviction(name), "deleteOptions": {"gracePeriodSeconds": 0}}
        code, body = server.raw("POST", f"{pods}/{name}/eviction", request)
        causes = [c.get("message") for c in (body.get("details") or {}).get("causes") or []]
        return code, status_body(body), body.get("message"), causes

    wait("the disruption controller to count 2 healthy pods", lambda: processed(currentHealthy=2), 60)
    out["evict violating the budget/429"] = evict("guarded-a")
    out["refused pod untouched"] = server.raw("GET", f"{pods}/guarded-a")[1]["metadata"].get(
        "deletionTimestamp"
    )
    code, _ = server.raw(
        "PATCH", f"{budgets}/guard", {"spec": {"minAvailable": 1}}, "application/merge-patch+json"
    )
    out["pdb lowered"] = code
    wait("the disruption controller to allow 1 disruption", lambda: processed(disruptionsAllowed=1), 60)
    out["evict within the budget"] = evict("guarded-a")
    out["evicted within the budget gone"] = wait(
        "the evicted pod to go", lambda: server.raw("GET", f"{pods}/guarded-a")[0] == 404, 30
    )
    wait("the disruption controller to count 1 healthy pod", lambda: processed(currentHealthy=1), 60)
    out["evict the last healthy pod/429"] = evict("guarded-b")
    return out


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from conformance["emulator"].__wrapped__(tmp_path_factory)


@pytest.fixture(scope="module")
def real(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from conformance["real"].__wrapped__(control_plane_bin, tmp_path_factory)


def test_emulator_answers_like_the_real_api_server_for_operations(emulator: Any, real: Any) -> None:
    expected = run_sequence(real)
    got = run_sequence(emulator)
    print(yaml.safe_dump({"kube-apiserver": expected}, default_flow_style=None)[:3000])
    differences = [
        f"{step}:\n    kube-apiserver: {expected.get(step)!r}\n    emulator:       {got.get(step)!r}"
        for step in expected
        if expected.get(step) != got.get(step)
    ]
    assert not differences, "the emulator differs from the real API server:\n" + "\n".join(differences)

"""Conformance of what operating kelastic relies on: NetworkPolicies, PodGroup custom resources and the
pods/eviction subresource, on the emulator and the real kube-apiserver (v1.20), answers compared.

Known, intended differences (the emulator answers as the v1.32 it reports): it marks an evicted
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
    # for version policy/v1"); v1.22+ and the emulator (a v1.32) take both.
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

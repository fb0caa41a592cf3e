"""API server conformance: ownerReference garbage collection (background, foreground, orphan),
strategic merge patches from ``kubectl apply``, JSON patch, and namespace deletion.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.testing import Kubectl, wait_for


@pytest.fixture(scope="module")
def core(api: ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(api.data_dir / "kubeconfig")))


@pytest.fixture(scope="module")
def kubectl(api: ApiServer) -> Kubectl:
    return Kubectl(api.data_dir / "kubeconfig")


def _family(core: client.CoreV1Api, ns: str) -> str:
    """An owner ConfigMap with two dependent ConfigMaps (one blocking its owner's deletion)."""
    core.create_namespace({"metadata": {"name": ns}})
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(ns, {"metadata": {"name": "dep1", "ownerReferences": [ref]}})
    core.create_namespaced_config_map(
        ns,
        {
            "metadata": {
                "name": "dep2",
                "ownerReferences": [{**ref, "blockOwnerDeletion": True}],
                "finalizers": ["example.com/slow"],
            }
        },
    )
    return owner.metadata.uid


def _names(core: client.CoreV1Api, ns: str) -> list[str]:
    return sorted(c.metadata.name for c in core.list_namespaced_config_map(ns).items)


def test_background_cascade(core: client.CoreV1Api, kubectl: Kubectl) -> None:
    _family(core, "bg")
    kubectl("delete", "configmap", "owner", "-n", "bg", "--cascade=background")
    wait_for(lambda: _names(core, "bg") == ["dep2"], 5, "dep1 to be collected")
    dep2 = core.read_namespaced_config_map("dep2", "bg")
    assert dep2.metadata.deletion_timestamp is not None  # deleted, held by its own finalizer
    core.patch_namespaced_config_map("dep2", "bg", {"metadata": {"finalizers": None}})
    wait_for(lambda: _names(core, "bg") == [], 5, "dep2 to go once its finalizer is removed")


def test_foreground_cascade_waits_for_blocking_dependents(core: client.CoreV1Api) -> None:
    _family(core, "fg")
    core.delete_namespaced_config_map("owner", "fg", propagation_policy="Foreground")
    owner = core.read_namespaced_config_map("owner", "fg")
    assert "foregroundDeletion" in owner.metadata.finalizers and owner.metadata.deletion_timestamp
    wait_for(lambda: _names(core, "fg") == ["dep2", "owner"], 5, "dep1 to be deleted first")
    core.patch_namespaced_config_map("dep2", "fg", {"metadata": {"finalizers": None}})
    wait_for(lambda: _names(core, "fg") == [], 5, "the owner to go after its last blocking dependent")


def test_orphan_keeps_dependents_without_the_reference(core: client.CoreV1Api, kubectl: Kubectl) -> None:
    _family(core, "orph")
    kubectl("delete", "configmap", "owner", "-n", "orph", "--cascade=orphan")
    wait_for(lambda: _names(core, "orph") == ["dep1", "dep2"], 5, "the owner to go, dependents to stay")
    for name in ("dep1", "dep2"):
        assert not core.read_namespaced_config_map(name, "orph").metadata.owner_references


def test_dependent_with_a_missing_owner_is_collected(core: client.CoreV1Api) -> None:
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "ghost",
        "uid": "00000000-0000-0000-0000-000000000000",
    }
    core.create_namespaced_config_map("default", {"metadata": {"name": "orphaned", "ownerReferences": [ref]}})
    wait_for(lambda: "orphaned" not in _names(core, "default"), 5, "the dangling dependent to be collected")


def test_namespace_deletion_removes_its_content(core: client.CoreV1Api, kubectl: Kubectl) -> None:
    core.create_namespace({"metadata": {"name": "doomed"}})
    core.create_namespaced_config_map("doomed", {"metadata": {"name": "c"}})
    kubectl("delete", "namespace", "doomed", "--timeout=10s")
    with pytest.raises(ApiException) as exc:
        core.read_namespace("doomed")
    assert exc.value.status == 404


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, labels: {{app: web}}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      containers:
      - name: main
        image: python:3.11
        env: {env}
        ports: [{{containerPort: 8080}}]
{sidecar}
"""


def test_kubectl_apply_twice_uses_strategic_merge(
    kubectl: Kubectl, core: client.CoreV1Api, api: ApiServer
) -> None:
    env1 = json.dumps([{"name": "A", "value": "1"}, {"name": "B", "value": "2"}])
    kubectl.apply(DEPLOYMENT.format(replicas=1, env=env1, sidecar=""))
    apps = client.AppsV1Api(config.new_client_from_config(str(api.data_dir / "kubeconfig")))
    # Another writer adds a container env var and an annotation that the manifest never mentions.
    apps.patch_namespaced_deployment("web", "default", {"metadata": {"annotations": {"other": "kept"}}})
    env2 = json.dumps([{"name": "A", "value": "10"}])
    sidecar = "      - {name: side, image: busybox}"
    out = kubectl.apply(DEPLOYMENT.format(replicas=3, env=env2, sidecar=sidecar))
    assert "configured" in out
    d = kubectl.json("deployment", "web")
    containers = d["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["main", "side"]
    assert containers[0]["env"] == [{"name": "A", "value": "10"}]  # B removed: it left the manifest
    assert containers[0]["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]
    assert d["spec"]["replicas"] == 3 and d["metadata"]["annotations"]["other"] == "kept"
    assert d["metadata"]["generation"] == 2  # the annotation patch did not bump it
    # JSON patch through kubectl, and the Table of a built-in kind.
    kubectl(
        "patch",
        "deployment",
        "web",
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/replicas","value":2}]',
    )
    assert kubectl.json("deployment", "web")["spec"]["replicas"] == 2
    kubectl("scale", "deployment", "web", "--replicas=4")
    assert kubectl.json("deployment", "web")["spec"]["replicas"] == 4


SSA_FIRST = """
apiVersion: v1
kind: ConfigMap
metadata: {name: ssa, labels: {a: "1", b: "2"}}
data: {one: "1", two: "2"}
"""
SSA_SECOND = """
apiVersion: v1
kind: ConfigMap
metadata: {name: ssa, labels: {a: "1"}}
data: {one: "10"}
"""


def test_server_side_apply_removes_fields_the_manager_dropped(kubectl: Kubectl) -> None:
    assert "serverside-applied" in kubectl("apply", "--server-side", "-f", "-", input=SSA_FIRST)
    kubectl("label", "configmap", "ssa", "other=kept")  # another manager's field
    kubectl("apply", "--server-side", "-f", "-", input=SSA_SECOND)
    cm = kubectl.json("configmap", "ssa", "--show-managed-fields")
    assert cm["data"] == {"one": "10"}
    assert cm["metadata"]["labels"] == {"a": "1", "other": "kept"}
    applied = [m for m in cm["metadata"]["managedFields"] if m["operation"] == "Apply"]
    assert applied[0]["manager"] == "kubectl" and "f:two" not in json.dumps(applied[0]["fieldsV1"])
    rv = cm["metadata"]["resourceVersion"]
    kubectl("apply", "--server-side", "-f", "-", input=SSA_SECOND)
    assert (
        kubectl.json("configmap", "ssa")["metadata"]["resourceVersion"] == rv
    )  # a no-op apply writes nothing


def test_wrong_types_in_builtin_objects_are_400(core: client.CoreV1Api) -> None:
    import urllib.request

    url = core.api_client.configuration.host + "/api/v1/namespaces/default/pods"
    body = {"metadata": {"name": "typed"}, "spec": {"containers": [{"name": "c", "image": True}]}}
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400
    assert "spec.containers[0].image: expected str, got bool" in exc.value.read().decode()

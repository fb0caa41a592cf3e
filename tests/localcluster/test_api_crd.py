"""API server conformance for CustomResourceDefinitions, driven by kubectl and the official client:
schema validation (422 naming the field), defaults, pruning, printer columns, status and scale
subresources, ``kubectl explain``.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.testing import Kubectl

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.test.kelastic.io
spec:
  group: test.kelastic.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wd], categories: [all]}
  versions:
  - name: v1
    served: true
    storage: true
    subresources:
      status: {}
      scale: {specReplicasPath: .spec.replicas, statusReplicasPath: .status.replicas,
              labelSelectorPath: .status.selector}
    additionalPrinterColumns:
    - {name: Replicas, type: integer, jsonPath: .spec.replicas}
    - {name: Phase, type: string, jsonPath: .status.phase}
    - {name: Ready, type: string, jsonPath: '.status.conditions[?(@.type=="Ready")].status'}
    - {name: Age, type: date, jsonPath: .metadata.creationTimestamp}
    schema:
      openAPIV3Schema:
        type: object
        description: A widget for tests.
        properties:
          spec:
            type: object
            required: [image]
            properties:
              image: {type: string, description: The image to run., pattern: '^[a-z0-9./:-]+$'}
              replicas: {type: integer, minimum: 1, maximum: 10, default: 2}
              policy: {type: string, enum: [Always, Never], default: Never}
              port: {x-kubernetes-int-or-string: true}
              extra: {type: object, x-kubernetes-preserve-unknown-fields: true}
              limits:
                type: object
                default: {}
                properties:
                  cpu: {type: string, default: "1"}
          status:
            type: object
            properties:
              phase: {type: string}
              replicas: {type: integer}
              selector: {type: string}
              conditions:
                type: array
                items:
                  type: object
                  properties:
                    type: {type: string}
                    status: {type: string}
"""


@pytest.fixture(scope="module")
def kubectl(api: ApiServer) -> Kubectl:
    kc = Kubectl(api.data_dir / "kubeconfig")
    assert "created" in kc.apply(CRD)
    kc("wait", "--for=condition=Established", "crd/widgets.test.kelastic.io", "--timeout=10s")
    return kc


@pytest.fixture(scope="module")
def custom(api: ApiServer, kubectl: Kubectl) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(config.new_client_from_config(str(api.data_dir / "kubeconfig")))


def _run(kc: Kubectl, *args: str, input: str | None = None) -> str:
    """kubectl's combined output, for commands expected to fail."""
    proc = subprocess.run(
        [kc.exe, "--kubeconfig", str(kc.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
        input=input,
    )
    return proc.stdout + proc.stderr


def _widget(name: str, **spec: object) -> str:
    import json

    return json.dumps(
        {"apiVersion": "test.kelastic.io/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}
    )


def test_cr_apply_with_validation_defaults_and_printer_columns(kubectl: Kubectl) -> None:
    assert "widget.test.kelastic.io/w1 created" in kubectl.apply(_widget("w1", image="busybox"))
    w = kubectl.json("widget", "w1")
    assert w["spec"] == {"image": "busybox", "replicas": 2, "policy": "Never", "limits": {"cpu": "1"}}
    assert w["metadata"]["generation"] == 1
    table = kubectl("get", "widgets")
    header = table.splitlines()[0].split()
    assert header == ["NAME", "REPLICAS", "PHASE", "READY", "AGE"]
    # Missing values print as blank cells, as against a real cluster.
    row = table.splitlines()[1].split()
    assert row[:2] == ["w1", "2"] and len(row) == 3
    # Re-applying a change is a merge patch: the changed field moves, generation follows the spec.
    assert "configured" in kubectl.apply(_widget("w1", image="busybox", replicas=3, port="http"))
    w = kubectl.json("wd", "w1")
    assert w["spec"]["replicas"] == 3 and w["spec"]["port"] == "http" and w["metadata"]["generation"] == 2
    assert "unchanged" in kubectl.apply(_widget("w1", image="busybox", replicas=3, port="http"))
    assert "w1" in kubectl("get", "all", "-o", "name")


def test_schema_violations_are_422_naming_the_field(
    kubectl: Kubectl, custom: client.CustomObjectsApi
) -> None:
    out = _run(kubectl, "apply", "-f", "-", input=_widget("bad", image="busybox", replicas=50))
    assert 'The Widget "bad" is invalid' in out or "is invalid" in out
    assert "spec.replicas" in out and "less than or equal to 10" in out
    out = _run(kubectl, "apply", "-f", "-", input=_widget("bad", replicas=1))
    assert "spec.image: Required value" in out
    body = {
        "apiVersion": "test.kelastic.io/v1",
        "kind": "Widget",
        "metadata": {"name": "bad"},
        "spec": {"image": "UPPER", "policy": "Sometimes", "port": 1.5},
    }
    with pytest.raises(ApiException) as exc:
        custom.create_namespaced_custom_object("test.kelastic.io", "v1", "default", "widgets", body)
    assert exc.value.status == 422
    import json

    status = json.loads(exc.value.body)
    fields = {c["field"] for c in status["details"]["causes"]}
    assert fields == {"spec.image", "spec.policy", "spec.port"}
    assert status["reason"] == "Invalid"


def test_unknown_fields_are_pruned_or_refused(kubectl: Kubectl, custom: client.CustomObjectsApi) -> None:
    body = {
        "apiVersion": "test.kelastic.io/v1",
        "kind": "Widget",
        "metadata": {"name": "pruned"},
        "spec": {"image": "busybox", "bogus": 1, "extra": {"anything": {"goes": True}}},
        "junk": 1,
    }
    created = custom.create_namespaced_custom_object("test.kelastic.io", "v1", "default", "widgets", body)
    assert "bogus" not in created["spec"] and "junk" not in created
    assert created["spec"]["extra"] == {"anything": {"goes": True}}
    # kubectl validates strictly by default: the server refuses the unknown field by name.
    out = _run(kubectl, "apply", "-f", "-", input=_widget("strict", image="busybox", bogus=1))
    assert 'unknown field "spec.bogus"' in out


def test_status_subresource_and_scale(kubectl: Kubectl, custom: client.CustomObjectsApi) -> None:
    kubectl.apply(_widget("sc", image="busybox"))
    args = ("test.kelastic.io", "v1", "default", "widgets", "sc")
    # Status on the main resource is ignored; spec on /status is ignored; generation stays.
    custom.patch_namespaced_custom_object(*args, {"status": {"phase": "Ignored"}})
    st = custom.patch_namespaced_custom_object_status(
        *args,
        {
            "spec": {"replicas": 9},
            "status": {
                "phase": "Running",
                "replicas": 2,
                "selector": "app=sc",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        },
    )
    assert st["status"]["phase"] == "Running" and st["spec"]["replicas"] == 2
    assert st["metadata"]["generation"] == 1
    kubectl("scale", "widget", "sc", "--replicas=5")
    w = kubectl.json("widget", "sc")
    assert w["spec"]["replicas"] == 5 and w["metadata"]["generation"] == 2
    scale = custom.get_namespaced_custom_object_scale(*args)
    assert scale["spec"]["replicas"] == 5 and scale["status"] == {"replicas": 2, "selector": "app=sc"}
    row = next(r for r in kubectl("get", "widgets").splitlines() if r.startswith("sc ")).split()
    assert row[:4] == ["sc", "5", "Running", "True"]
    out = _run(kubectl, "scale", "widget", "sc", "--replicas=50")
    assert "less than or equal to 10" in out


def test_explain_and_crd_removal(kubectl: Kubectl, custom: client.CustomObjectsApi) -> None:
    out = kubectl("explain", "widgets.spec")
    assert "image" in out and "The image to run." in out and "replicas" in out
    kubectl("delete", "crd", "widgets.test.kelastic.io")
    out = _run(kubectl, "get", "widgets")
    assert "the server doesn't have a resource type" in out or "NotFound" in out or "not find" in out


def test_explain_builtin_kinds(kubectl: Kubectl) -> None:
    out = kubectl("explain", "pods.spec.restartPolicy")
    assert "FIELD: restartPolicy <string>" in out and "Always" in out
    assert "replicas" in kubectl("explain", "deployment.spec")


RULES_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: ranges.test.kelastic.io}
spec:
  group: test.kelastic.io
  scope: Namespaced
  names: {plural: ranges, singular: range, kind: Range}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - {rule: "self.min <= self.max", message: "min must not exceed max"}
            - {rule: "self.max >= oldSelf.max", message: "max may not shrink"}
            properties:
              min: {type: integer}
              max: {type: integer}
"""


def test_cel_validation_rules(kubectl: Kubectl) -> None:
    kubectl.apply(RULES_CRD)
    kubectl("wait", "--for=condition=Established", "crd/ranges.test.kelastic.io", "--timeout=10s")

    def rng(lo: int, hi: int) -> str:
        return json.dumps(
            {
                "apiVersion": "test.kelastic.io/v1",
                "kind": "Range",
                "metadata": {"name": "r"},
                "spec": {"min": lo, "max": hi},
            }
        )

    out = _run(kubectl, "apply", "-f", "-", input=rng(5, 1))
    assert "is invalid" in out and "spec: Invalid value" in out and "min must not exceed max" in out
    kubectl.apply(rng(1, 5))
    out = _run(kubectl, "apply", "-f", "-", input=rng(1, 3))
    assert "max may not shrink" in out
    assert "configured" in kubectl.apply(rng(1, 8))

"""Fidelity: every API-server behaviour kelastic's code and tests rely on, asked of the emulator
and of a real kube-apiserver, with the same outcome required of both.

Two ``kelastic local`` clusters run side by side for the module: one on the emulator, one on
the real control plane of ``control_plane_bin`` (etcd, kube-apiserver, controller-manager,
scheduler), each with the process kubelet (and a node of one fake GPU, for preemption). Each
test runs one scenario on both and compares what it observed: status codes, the ``Status``
body (reason, message, the fields of its causes), warnings, conditions, and the objects
afterwards (without UIDs, resourceVersions and times). The real server's answer is the
expected one; a difference fails the test naming the step and both answers, and is fixed in
the emulator (or in kelastic), never here.

The emulator follows current Kubernetes (v1.37). A lane whose kube-apiserver predates what
it models (v1.20: no Pod Security admission, CEL rules, server-side field validation or
``policy/v1``, and loopback addresses taken in EndpointSlices) is told by its answers to
probes at the start, and the module is skipped there, naming what that server lacks: its
answers are those of another generation, not a measure of the emulator. The transcripts of
``test_conformance.py`` and ``test_conformance_ops.py``, which hold across releases, run on
every lane.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.testing import Kubectl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ELASTICJOB_CRD = REPO / "crds" / "elasticjob.yaml"
EXAMPLE = REPO / "examples" / "elasticjob.yaml"
GROUP = "fidelity.kelastic.dev"


# -- the two sides ----------------------------------------------------------------------------
@dataclass
class Answer:
    """One HTTP answer: status code, decoded body, and the ``Warning`` headers' texts."""

    code: int
    body: Any
    warnings: list[str] = field(default_factory=list)


@dataclass
class Side:
    """One cluster under test, reached as a client reaches it (HTTP, kubectl, the Python client)."""

    name: str
    cluster: LocalCluster
    url: str
    ssl: ssl.SSLContext | None

    @property
    def kubeconfig(self) -> Path:
        return Path(self.cluster.kubeconfig)

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **params: str,
    ) -> Answer:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path + (f"?{query}" if query else ""), data=data, method=method
        )
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.ssl) as resp:
                return Answer(resp.status, _decode(resp.read()), _warnings(resp.headers))
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, _decode(exc.read()), _warnings(exc.headers))

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return Kubectl(self.kubeconfig).run(*args, timeout=60, input=stdin)

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create namespace ``name`` (fresh for each test) and wait until it can hold pods."""
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        created = self.call("POST", "/api/v1/namespaces", body)
        assert created.code == 201, (self.name, created.body)
        wait(
            f"{self.name}: the default ServiceAccount of namespace {name}",
            lambda: self.call("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default").code == 200,
        )
        return name


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}


def _warnings(headers: Any) -> list[str]:
    """The texts of ``Warning: 299 - "text"`` headers, in order."""
    out = []
    for value in headers.get_all("Warning") or []:
        found = re.match(r'\s*\d{3} \S+ "(.*)"\s*$', value)
        out.append(found.group(1).replace('\\"', '"') if found else value)
    return out


def wait(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def status(answer: Answer) -> dict[str, Any]:
    """The comparable whole of an error answer: code, reason, message, the causes' fields."""
    body = answer.body if isinstance(answer.body, dict) else {}
    details = dict(body.get("details") or {})
    details.pop("uid", None)
    causes = sorted(
        (c.get("reason", ""), c.get("field", ""), c.get("message", ""))
        for c in details.pop("causes", []) or []
    )
    return {
        "code": answer.code,
        "kind": body.get("kind"),
        "status": body.get("status"),
        "reason": body.get("reason"),
        "message": body.get("message"),
        "details": details,
        "causes": causes,
    }


VOLATILE = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "selfLink")


def shape(obj: Any) -> Any:
    """An object without what differs between any two servers (identity, versions, times)."""
    if not isinstance(obj, dict):
        return obj
    out = copy.deepcopy(obj)
    meta = out.get("metadata") or {}
    for key in VOLATILE:
        meta.pop(key, None)
    if meta.get("deletionTimestamp"):
        meta["deletionTimestamp"] = "<set>"
    for ref in meta.get("ownerReferences") or []:
        ref.pop("uid", None)
    return out


def times(value: Any) -> Any:
    """``value`` with RFC 3339 times replaced by their format (seconds or micro-seconds)."""
    text = json.dumps(value)
    text = re.sub(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"', '"<micro-time>"', text)
    text = re.sub(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"', '"<time>"', text)
    return json.loads(text)


def compare(real: Side, emulator: Side, scenario: Callable[[Side], dict[str, Any]]) -> None:
    """Run ``scenario`` on the real server, then on the emulator; fail on any difference."""
    expected = scenario(real)
    got = scenario(emulator)
    differences = [
        f"{step}:\n    kube-apiserver: {expected.get(step)!r}\n    emulator:       {got.get(step)!r}"
        for step in expected
        if expected.get(step) != got.get(step)
    ]
    assert not differences, "the emulator differs from the real API server:\n" + "\n".join(differences)
    print(f"{len(expected)} steps alike on {real.name} and the emulator: {', '.join(expected)}")


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    tmp = tmp_path_factory.mktemp("fidelity-real")
    cluster = LocalCluster(
        tmp / "cluster", workdir=tmp, control_plane=control_plane_bin, gpus=1, progress=print
    )
    cluster.start()
    try:
        cp = cluster.control_plane
        assert cp is not None
        side = Side(f"kube-apiserver {cp.version}", cluster, cp.url, cp.ssl_context(cp.credentials("admin")))
        lacking = missing_behaviours(side)
        if cp.loopback_slices:
            lacking.append("refusal of loopback addresses in EndpointSlices (a dry-run slice took 127.1.0.1)")
        if lacking:
            pytest.skip(
                f"{side.name} predates what the emulator models (current Kubernetes); it lacks "
                + "; ".join(lacking)
                + ". Run this module on a current control plane (make control-plane)"
            )
        yield side
    finally:
        cluster.stop()


def missing_behaviours(side: Side) -> list[str]:
    """What the server lacks of what the emulator models, each with the answer that shows it."""
    out = []
    if side.call("GET", "/apis/policy/v1").code != 200:
        out.append("policy/v1 (not served)")
    side.namespace("fid-probe", {"pod-security.kubernetes.io/enforce": "restricted"})
    probe = side.call("POST", "/api/v1/namespaces/fid-probe/pods", privileged_pod("probe"), dryRun="All")
    if probe.code == 201:
        out.append("Pod Security admission (a privileged pod was admitted to a restricted namespace)")
    probe = side.call(
        "POST", "/api/v1/namespaces/fid-probe/configmaps", {"metadata": {"name": "probe"}, "junk": 1},
        fieldValidation="Strict", dryRun="All",
    )  # fmt: skip
    if probe.code == 201:
        out.append("server-side field validation (fieldValidation=Strict took an unknown field)")
    crd = copy.deepcopy(GADGET_CRD)
    crd["metadata"]["name"] = f"probes.{GROUP}"
    crd["spec"]["names"] = {"plural": "probes", "singular": "probe", "kind": "Probe"}
    made = side.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, dryRun="All")
    schema = made.body["spec"]["versions"][0]["schema"]["openAPIV3Schema"] if made.code == 201 else {}
    if "x-kubernetes-validations" not in json.dumps(schema):
        out.append("CEL validation rules (the CRD's x-kubernetes-validations were dropped)")
    return out


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    tmp = tmp_path_factory.mktemp("fidelity-emulator")
    cluster = LocalCluster(tmp / "cluster", workdir=tmp, gpus=1)
    cluster.start()
    try:
        yield Side("emulator", cluster, str(cluster.url), None)
    finally:
        cluster.stop()


# -- Pod Security admission ------------------------------------------------------------------
def privileged_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": ["python", "-c", "pass"],
                    "securityContext": {"privileged": True},
                }
            ],
        },
    }


def restricted_pod(name: str) -> dict[str, Any]:
    pod = privileged_pod(name)
    pod["spec"]["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pod["spec"]["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    return pod


def test_pod_security_admission_warns_of_and_refuses_a_privileged_pod(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        enforce = side.namespace("fid-psa-enforce", {"pod-security.kubernetes.io/enforce": "restricted"})
        warn = side.namespace(
            "fid-psa-warn",
            {
                "pod-security.kubernetes.io/warn": "restricted",
                "pod-security.kubernetes.io/enforce": "baseline",
            },
        )
        refused = side.call("POST", f"/api/v1/namespaces/{enforce}/pods", privileged_pod("priv"))
        out["privileged pod, enforce=restricted"] = (status(refused), refused.warnings)
        out["restricted pod, enforce=restricted (dry run)"] = _code_and_warnings(
            side.call("POST", f"/api/v1/namespaces/{enforce}/pods", restricted_pod("fine"), dryRun="All")
        )
        out["privileged pod, warn=restricted enforce=baseline"] = status(
            side.call("POST", f"/api/v1/namespaces/{warn}/pods", privileged_pod("priv"), dryRun="All")
        )
        plain = {**privileged_pod("root"), "spec": {**privileged_pod("root")["spec"]}}
        plain["spec"]["containers"] = [{"name": "main", "image": "python", "command": ["python"]}]
        out["root pod, warn=restricted (dry run)"] = _code_and_warnings(
            side.call("POST", f"/api/v1/namespaces/{warn}/pods", plain, dryRun="All")
        )
        applied = side.kubectl("apply", "-n", warn, "--dry-run=server", "-f", "-", stdin=json.dumps(plain))
        out["kubectl apply, warn=restricted"] = (applied.returncode, applied.stderr.strip().splitlines())
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "priv"},
            "spec": {
                "selector": {"matchLabels": {"app": "priv"}},
                "template": {
                    "metadata": {"labels": {"app": "priv"}},
                    "spec": {**privileged_pod("x")["spec"], "restartPolicy": "Always"},
                },
            },
        }
        out["deployment of privileged pods, enforce=restricted (dry run)"] = _code_and_warnings(
            side.call("POST", f"/apis/apps/v1/namespaces/{enforce}/deployments", deployment, dryRun="All")
        )
        labels = side.call("GET", f"/api/v1/namespaces/{enforce}").body["metadata"]["labels"]
        out["namespace labels"] = labels
        return out

    compare(real, emulator, scenario)


def _code_and_warnings(answer: Answer) -> tuple[int, list[str]]:
    return answer.code, answer.warnings


# -- CRD: structural schema, defaults, pruning, CEL rules -----------------------------------
GADGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"gadgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "x-kubernetes-validations": [
                                    {"rule": "self.low <= self.high", "message": "low must not exceed high"},
                                    {"rule": "self.size % 2 == 0"},
                                ],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 2},
                                    "low": {"type": "integer", "default": 1},
                                    "high": {"type": "integer", "default": 4},
                                    "color": {
                                        "type": "string",
                                        "default": "blue",
                                        "x-kubernetes-validations": [
                                            {"rule": "self == oldSelf", "message": "color is immutable"}
                                        ],
                                    },
                                    "labels": {
                                        "type": "object",
                                        "additionalProperties": {"type": "string"},
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def gadget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Gadget", "metadata": {"name": name}, "spec": spec}


def gadget_crd(side: Side) -> str:
    """Apply the Gadget CRD (once per side) and return its collection path in namespace fid-crd."""
    applied = side.kubectl("apply", "-f", "-", stdin=json.dumps(GADGET_CRD))
    assert applied.returncode == 0, applied.stderr
    side.kubectl("wait", "--for=condition=Established", f"crd/gadgets.{GROUP}", "--timeout=60s")
    if side.call("GET", "/api/v1/namespaces/fid-crd").code == 404:
        side.namespace("fid-crd")
    path = f"/apis/{GROUP}/v1/namespaces/fid-crd/gadgets"
    wait(f"{side.name}: gadgets to be served", lambda: side.call("GET", path).code == 200)
    return path


def test_crd_structural_schema_defaults_pruning_and_cel_rules(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        path = gadget_crd(side)
        created = side.call("POST", path, {**gadget("g1", size=2, junk=True), "extra": 1})
        out["create: defaults, pruning, warnings"] = (
            created.code,
            created.body.get("spec"),
            created.warnings,
        )
        out["create: extra top-level field kept?"] = "extra" in created.body
        for name, spec in (
            ("size below minimum", {"size": 0}),
            ("size missing", {"low": 1}),
            ("size of the wrong type", {"size": "two"}),
        ):
            out[f"create: {name}"] = status(side.call("POST", path, gadget("bad", **spec)))
        out["cel: rule with a message"] = status(
            side.call("POST", path, gadget("bad", size=2, low=5, high=3))
        )
        out["cel: rule without a message"] = status(side.call("POST", path, gadget("bad", size=3)))
        out["cel: two rules broken"] = status(side.call("POST", path, gadget("bad", size=3, low=9)))
        current = side.call("GET", f"{path}/g1").body
        current["spec"]["color"] = "red"
        out["cel: transition rule (oldSelf)"] = status(side.call("PUT", f"{path}/g1", current))
        patched = side.call("PATCH", f"{path}/g1", {"spec": {"low": 2}}, "application/merge-patch+json")
        out["cel: an update keeping the rules"] = (patched.code, patched.body.get("spec"))
        return out

    compare(real, emulator, scenario)


# -- strict field validation: kubectl and the Python client ----------------------------------
def test_strict_field_validation_from_kubectl_and_the_python_client(real: Side, emulator: Side) -> None:
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        path = gadget_crd(side)
        typo = json.dumps({**gadget("typo", size=2), "spec": {"size": 2, "colour": "red"}})
        applied = side.kubectl("apply", "-n", "fid-crd", "-f", "-", stdin=typo)
        out["kubectl apply (strict by default)"] = (applied.returncode, applied.stderr.strip())
        warned = side.kubectl(
            "apply", "-n", "fid-crd", "--validate=warn", "--dry-run=server", "-f", "-", stdin=typo
        )
        out["kubectl apply --validate=warn"] = (warned.returncode, warned.stderr.strip().splitlines())
        ignored = side.kubectl(
            "apply", "-n", "fid-crd", "--validate=false", "--dry-run=server", "-f", "-", stdin=typo
        )
        out["kubectl apply --validate=false"] = (ignored.returncode, ignored.stderr.strip())

        api = client.ApiClient(config.new_client_from_config(str(side.kubeconfig)).configuration)
        try:
            custom = client.CustomObjectsApi(api)
            body = {**gadget("py", size=2), "spec": {"size": 2, "colour": "red"}}
            try:
                custom.create_namespaced_custom_object(
                    GROUP, "v1", "fid-crd", "gadgets", body, field_validation="Strict"
                )
                out["python client, custom object, Strict"] = "created"
            except ApiException as exc:
                out["python client, custom object, Strict"] = (exc.status, exc.reason, json.loads(exc.body))
            _, code, headers = custom.create_namespaced_custom_object_with_http_info(
                GROUP, "v1", "fid-crd", "gadgets", body, field_validation="Warn", dry_run="All"
            )
            out["python client, custom object, Warn"] = (code, headers.get("Warning"))
            try:
                custom.create_namespaced_custom_object(
                    GROUP, "v1", "fid-crd", "gadgets", body, field_validation="Bogus", dry_run="All"
                )
                out["python client, unknown fieldValidation"] = "created"
            except ApiException as exc:
                out["python client, unknown fieldValidation"] = (exc.status, exc.reason, json.loads(exc.body))
        finally:
            api.close()
        out["custom object not created"] = side.call("GET", f"{path}/py").code
        return out

    compare(real, emulator, scenario)


# -- server-side apply ------------------------------------------------------------------------
def test_server_side_apply_conflicts_and_force(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        path = gadget_crd(side)
        apply = "application/apply-patch+yaml"

        def by(manager: str, spec: dict[str, Any], **params: str) -> Answer:
            doc = yaml.safe_dump(gadget("ssa", **spec))
            return side.call("PATCH", f"{path}/ssa", doc, apply, fieldManager=manager, **params)

        first = by("alice", {"size": 2, "color": "green"})
        out["alice creates"] = (first.code, first.body.get("spec"), _managers(first.body))
        out["alice again, same"] = by("alice", {"size": 2, "color": "green"}).code
        out["bob, same values: shared"] = _managers(by("bob", {"size": 2}).body)
        out["bob, other value: conflict"] = status(by("bob", {"size": 4, "color": "green"}))
        forced = by("bob", {"size": 4, "color": "green"}, force="true")
        out["bob forces"] = (forced.code, forced.body.get("spec"), _managers(forced.body))
        out["alice drops color"] = _managers(by("alice", {"size": 4}).body)
        out["no fieldManager"] = status(
            side.call("PATCH", f"{path}/ssa", yaml.safe_dump(gadget("ssa", size=2)), apply)
        )
        merged = side.call(
            "PATCH", f"{path}/ssa", {"spec": {"low": 0}}, "application/merge-patch+json", fieldManager="carol"
        )
        out["carol updates"] = _managers(merged.body)
        return out

    compare(real, emulator, scenario)


def _managers(obj: Any) -> list[tuple[str, str, str, Any]]:
    entries = (obj.get("metadata") or {}).get("managedFields") or [] if isinstance(obj, dict) else []
    return sorted(
        (m.get("manager"), m.get("operation"), m.get("subresource", ""), m.get("fieldsV1")) for m in entries
    )


# -- status and scale subresources of the ElasticJob CRD -------------------------------------
def elasticjob(namespace: str) -> dict[str, Any]:
    (job,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d["kind"] == "ElasticJob"]
    job["metadata"] = {"name": "scaled", "namespace": namespace}
    return job


def test_status_and_scale_subresources_of_the_elasticjob_crd(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        applied = side.kubectl("apply", "-f", str(ELASTICJOB_CRD))
        assert applied.returncode == 0, applied.stderr
        side.kubectl("wait", "--for=condition=Established", "crd/elasticjobs.kelastic.dev", "--timeout=60s")
        ns = side.namespace("fid-scale")
        jobs = f"/apis/kelastic.dev/v1alpha1/namespaces/{ns}/elasticjobs"
        wait(f"{side.name}: elasticjobs served", lambda: side.call("GET", jobs).code == 200)
        created = side.call("POST", jobs, elasticjob(ns))
        out["create"] = (created.code, shape(created.body).get("spec"))
        scale = side.call("GET", f"{jobs}/scaled/scale")
        out["get scale"] = (scale.code, shape(scale.body))
        patched = side.call(
            "PATCH",
            f"{jobs}/scaled/status",
            {"status": {"phase": "Running", "selector": "kelastic.dev/job-name=scaled",
                        "replicaStatuses": {"Worker": {"active": 2}}}, "spec": {"minReplicas": 1}},
            "application/merge-patch+json",
        )  # fmt: skip
        out["status patch ignores spec"] = (
            patched.code,
            patched.body["spec"]["minReplicas"],
            patched.body.get("status"),
        )
        out["scale after status"] = shape(side.call("GET", f"{jobs}/scaled/scale").body)
        resized = side.call(
            "PATCH", f"{jobs}/scaled/scale", {"spec": {"replicas": 4}}, "application/merge-patch+json"
        )
        out["patch scale"] = (resized.code, shape(resized.body))
        job = side.call("GET", f"{jobs}/scaled").body
        out["job after scale"] = (
            job["spec"]["replicaSpecs"]["Worker"]["replicas"],
            job["metadata"]["generation"],
        )
        stale = side.call("GET", f"{jobs}/scaled/scale").body
        stale["metadata"]["resourceVersion"] = "1"
        stale["spec"]["replicas"] = 3
        out["put scale, stale resourceVersion"] = status(side.call("PUT", f"{jobs}/scaled/scale", stale))
        out["patch scale to -1"] = status(
            side.call(
                "PATCH", f"{jobs}/scaled/scale", {"spec": {"replicas": -1}}, "application/merge-patch+json"
            )
        )
        job["status"] = {"phase": "Failed"}
        job["spec"]["minReplicas"] = 2
        put = side.call("PUT", f"{jobs}/scaled", job)
        out["put main ignores status"] = (put.code, put.body["spec"]["minReplicas"], put.body.get("status"))
        return out

    compare(real, emulator, scenario)


# -- eviction: DisruptionTarget and PodDisruptionBudgets -------------------------------------
def sleeper(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": ["python", "-c", "import time; time.sleep(600)"],
                }
            ],
            **spec,
        },
    }


def running(side: Side, ns: str, name: str, timeout: float = 60) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pod = side.call("GET", f"/api/v1/namespaces/{ns}/pods/{name}").body
        conditions = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
        return pod if conditions.get("Ready") == "True" else None

    return dict(wait(f"{side.name}: pod {ns}/{name} to be Running and Ready", ready, timeout))


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return {k: v for k, v in c.items() if k not in ("lastTransitionTime", "lastProbeTime")}
    return None


def test_eviction_marks_the_pod_and_a_disruption_budget_refuses_it(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-evict")
        pods = f"/api/v1/namespaces/{ns}/pods"
        policy = "policy/v1" if side.call("GET", "/apis/policy/v1").code == 200 else "policy/v1beta1"
        # The finalizer holds the evicted pod until its condition and deletion mark are read:
        # a sleeper stops at once on SIGTERM, and under load the pod could be gone before that.
        guarded = sleeper("guarded", {"app": "guarded"})
        guarded["metadata"]["finalizers"] = ["fidelity.kelastic.dev/hold"]
        side.call("POST", pods, guarded)
        running(side, ns, "guarded")
        budget = {
            "apiVersion": policy,
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "budget"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        }
        budgets = f"/apis/{policy}/namespaces/{ns}/poddisruptionbudgets"
        out["budget created"] = side.call("POST", budgets, budget).code
        wait(
            f"{side.name}: the budget's status to count the pod",
            lambda: (
                (side.call("GET", f"{budgets}/budget").body.get("status") or {}).get("currentHealthy") == 1
            ),
        )
        evict = {"apiVersion": policy, "kind": "Eviction", "metadata": {"name": "guarded", "namespace": ns}}
        out["evict under the budget"] = status(side.call("POST", f"{pods}/guarded/eviction", evict))
        budget_status = side.call("GET", f"{budgets}/budget").body["status"]
        out["budget status"] = {
            k: v for k, v in budget_status.items() if k not in ("observedGeneration", "conditions")
        }
        out["budget condition"] = [
            {k: v for k, v in c.items() if k not in ("lastTransitionTime", "observedGeneration")}
            for c in budget_status.get("conditions") or []
        ]
        side.call("DELETE", f"{budgets}/budget")
        evicted = side.call("POST", f"{pods}/guarded/eviction", evict)
        out["evict without a budget"] = (evicted.code, evicted.body.get("kind"), evicted.body.get("status"))
        after = side.call("GET", f"{pods}/guarded").body
        out["evicted pod's condition"] = condition(after, "DisruptionTarget")
        out["evicted pod is being deleted"] = bool(after["metadata"].get("deletionTimestamp"))
        side.call(
            "PATCH", f"{pods}/guarded", {"metadata": {"finalizers": None}}, "application/merge-patch+json"
        )
        wait(f"{side.name}: the evicted pod to go", lambda: side.call("GET", f"{pods}/guarded").code == 404)
        out["missing pod"] = status(
            side.call("POST", f"{pods}/nobody/eviction", {**evict, "metadata": {"name": "nobody"}})
        )
        return out

    compare(real, emulator, scenario)


# -- preemption by the scheduler ---------------------------------------------------------------
def test_a_preempted_pod_carries_the_schedulers_condition(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-preempt")
        pods = f"/api/v1/namespaces/{ns}/pods"
        for name, value in (("fid-low", 100), ("fid-high", 1000)):
            pc = {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
            side.call("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", pc)
        gpu = {"limits": {"nvidia.com/gpu": "1"}}
        low = sleeper("low", {"app": "low"}, priorityClassName="fid-low")
        low["spec"]["containers"][0]["resources"] = gpu
        side.call("POST", pods, low)
        running(side, ns, "low")
        high = sleeper("high", {"app": "high"}, priorityClassName="fid-high")
        high["spec"]["containers"][0]["resources"] = gpu
        rv = side.call("GET", pods).body["metadata"]["resourceVersion"]

        def told(events: list[dict[str, Any]]) -> bool:
            """The victim's deletion and the preemptor's nomination have come."""
            return any(
                e["type"] == "DELETED" and e["object"]["metadata"]["name"] == "low" for e in events
            ) and any(
                e["object"]["metadata"]["name"] == "high" and e["object"]["status"].get("nominatedNodeName")
                for e in events
            )

        with Watch(side, pods, rv, until=told) as seen:
            side.call("POST", pods, high)
            wait(f"{side.name}: the victim to go", lambda: side.call("GET", f"{pods}/low").code == 404, 90)
        marks = [
            condition(e["object"], "DisruptionTarget")
            for e in seen.events
            if e["object"]["metadata"]["name"] == "low" and condition(e["object"], "DisruptionTarget")
        ]
        out["victim's condition"] = marks[0] if marks else None
        # Kept to the end: the kubelet's status writes must not erase another component's condition.
        last = [e["object"] for e in seen.events if e["object"]["metadata"]["name"] == "low"][-1:]
        out["victim's last state still marked"] = [condition(o, "DisruptionTarget") is not None for o in last]
        out["preemptor while it waits"] = [
            (e["object"]["status"].get("nominatedNodeName"), condition(e["object"], "PodScheduled"))
            for e in seen.events
            if e["object"]["metadata"]["name"] == "high" and e["object"]["status"].get("nominatedNodeName")
        ][:1]
        wait(f"{side.name}: the victim to go", lambda: side.call("GET", f"{pods}/low").code == 404, 90)
        pod = running(side, ns, "high", 90)
        out["preemptor"] = (
            pod["spec"].get("nodeName"),
            pod["status"].get("phase"),
            pod["spec"].get("priority"),
        )
        events = side.call("GET", f"/api/v1/namespaces/{ns}/events").body.get("items") or []
        out["victim's events"] = sorted(
            (e.get("reason"), re.sub(r"[0-9a-f-]{36}", "<uid>", e.get("message", "")))
            for e in events
            if (e.get("involvedObject") or {}).get("name") == "low" and e.get("reason") == "Preempted"
        )
        side.call("DELETE", f"{pods}/high", {"gracePeriodSeconds": 0})
        for name in ("fid-low", "fid-high"):
            side.call("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
        return out

    compare(real, emulator, scenario)


# -- what `kubectl get pods` prints in every phase ---------------------------------------------
def pod_columns(side: Side, ns: str) -> dict[str, tuple[str, ...]]:
    """NAME → (READY, STATUS, RESTARTS) as the real kubectl prints them from the server's Table."""
    listed = side.kubectl("get", "pods", "-n", ns)
    assert listed.returncode == 0, (side.name, listed.stderr)
    lines = listed.stdout.splitlines()
    assert re.split(r"\s{2,}", lines[0].strip())[:4] == ["NAME", "READY", "STATUS", "RESTARTS"], lines[0]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    # A restart count reads "1 (5s ago)": the time since is the one thing that may differ.
    return {r[0]: (r[1], r[2], re.sub(r" \(.*? ago\)", " (<ago>)", r[3])) for r in rows}


def state_keys(pod: dict[str, Any]) -> list[list[str]]:
    """The keys of each container's ``state``: a container has exactly one state."""
    return [sorted(s.get("state") or {}) for s in (pod.get("status") or {}).get("containerStatuses") or []]


T0 = "2026-01-01T00:00:00Z"
OOM_KILLED = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": T0, "finishedAt": T0}}


def container_status(name: str, state: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``containerStatuses`` as a kubelet writes it."""
    started = "running" in state
    return {
        "name": name,
        "image": "python",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": started,
        "state": state,
        "lastState": {},
    }


def test_kubectl_get_pods_reads_the_same_in_every_phase(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-phases")
        pods = f"/api/v1/namespaces/{ns}/pods"

        def phase_is(name: str, *phases: str) -> Callable[[], bool]:
            return lambda: side.call("GET", f"{pods}/{name}").body.get("status", {}).get("phase") in phases

        def once(name: str, code: str) -> dict[str, Any]:
            pod = sleeper(name, {"app": name}, restartPolicy="Never")
            pod["spec"]["containers"][0]["command"] = ["python", "-c", f"raise SystemExit({code})"]
            return pod

        stubborn = sleeper("deleting", {"app": "deleting"}, terminationGracePeriodSeconds=60)
        # Running is not yet ignoring: a SIGTERM before the handler is set ends the pod at once
        # (a loaded machine's python takes a second to get there). The container says when it
        # ignores it in a file of the host's (the process kubelet runs it on the host's files).
        ignoring = Path(tempfile.mkdtemp(prefix="kelastic-fidelity-")) / "ignoring"
        stubborn["spec"]["containers"][0]["command"] = [
            "python", "-c",
            "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ignoring)!r}).touch(); time.sleep(600)",
        ]  # fmt: skip
        initializing = sleeper("initializing", {"app": "initializing"})
        initializing["spec"]["initContainers"] = [
            {"name": "setup", "image": "python", "command": ["python", "-c", "import time; time.sleep(600)"]}
        ]
        pending = sleeper("pending", {"app": "pending"})
        pending["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}  # of 1
        for made in (
            pending,
            sleeper("running", {"app": "running"}),
            once("succeeded", "0"),
            once("failed", "3"),
            stubborn,
            initializing,
        ):
            assert side.call("POST", pods, made).code == 201, (side.name, made["metadata"]["name"])
        running(side, ns, "running")
        running(side, ns, "deleting")
        wait(f"{side.name}: pod deleting to ignore SIGTERM", ignoring.exists)
        wait(f"{side.name}: pod succeeded to succeed", phase_is("succeeded", "Succeeded"))
        wait(f"{side.name}: pod failed to fail", phase_is("failed", "Failed"))
        wait(
            f"{side.name}: the init container of pod initializing to run",
            lambda: any(
                "running" in (s.get("state") or {})
                for s in side.call("GET", f"{pods}/initializing").body["status"].get("initContainerStatuses")
                or []
            ),
        )
        # No kubelet here runs out of memory: a pod on a node without one gets the status a
        # kubelet writes for a container the kernel killed, running first, then OOMKilled (made
        # last: kube-controller-manager removes a pod of a node that does not exist after a while).
        oom = sleeper("oom-killed", {"app": "oom"}, restartPolicy="Never", nodeName="fid-no-kubelet")
        assert side.call("POST", pods, oom).code == 201, side.name
        for phase, state in (("Running", {"running": {"startedAt": T0}}), ("Failed", OOM_KILLED)):
            written = side.call(
                "PATCH",
                f"{pods}/oom-killed/status",
                {"status": {"phase": phase, "containerStatuses": [container_status("main", state)]}},
                content_type="application/strategic-merge-patch+json",
            )
            assert written.code == 200, (side.name, written.body)
        assert side.call("DELETE", f"{pods}/deleting").code == 200, side.name
        out["kubectl get pods"] = pod_columns(side, ns)
        items = side.call("GET", pods).body["items"]
        out["container states"] = {p["metadata"]["name"]: state_keys(p) for p in items}
        side.call("DELETE", pods, {"gracePeriodSeconds": 0})
        shutil.rmtree(ignoring.parent, ignore_errors=True)
        return out

    compare(real, emulator, scenario)


class Watch:
    """The events of a watch on ``path`` from ``rv``, collected by a thread while in the block and
    after it until ``until(events)`` holds (at most 30 s): the block's own waits look at the
    objects, and a watch's events may come a moment after what a read already shows."""

    def __init__(self, side: Side, path: str, rv: str, until: Callable[[list[dict[str, Any]]], bool]) -> None:
        import threading

        self.events: list[dict[str, Any]] = []
        self._seen: list[dict[str, Any]] = []
        self._until = until
        # The server ends the watch after a while: the reading thread never outlives the test.
        url = f"{side.url}{path}?watch=true&resourceVersion={rv}&timeoutSeconds=60"
        self._response = urllib.request.urlopen(url, timeout=90, context=side.ssl)
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            for line in self._response:
                if line.strip():
                    event = json.loads(line)
                    if event.get("type") != "BOOKMARK":
                        self._seen.append(event)
        except (OSError, ValueError, http.client.HTTPException):
            pass  # shut down by __exit__
        finally:
            self._response.close()

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 30
        while not self._until(list(self._seen)) and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.events = list(self._seen)
        # Shut the stream down under the reading thread, which then closes it (a close from
        # here would not wake its recv, and would pull the response from under it).
        raw = getattr(getattr(self._response, "fp", None), "raw", None)
        with contextlib.suppress(AttributeError, OSError):
            raw._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        self._thread.join(5)


# -- Endpoints and EndpointSlices of the store's Service -------------------------------------
def test_endpoints_and_endpoint_slices_of_the_stores_service(real: Side, emulator: Side) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-endpoints")
        port = 29400
        store = sleeper("store", {"kelastic.dev/role": "rendezvous"})
        store["spec"]["containers"][0]["command"] = [
            "python", "-c",
            "import os, socket\ns = socket.create_server((os.environ['POD_IP'], 29400))\n"
            "while True:\n    c, _ = s.accept()\n    c.sendall(b'store')\n    c.close()",
        ]  # fmt: skip
        store["spec"]["containers"][0]["env"] = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
        store["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 1}
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "store"},
            "spec": {
                "selector": {"kelastic.dev/role": "rendezvous"},
                "ports": [{"name": "rdzv", "port": port}],
            },
        }
        created = side.call("POST", f"/api/v1/namespaces/{ns}/services", service)
        out["service"] = (created.code, created.body["spec"]["ports"], created.body["spec"]["type"])
        side.call("POST", f"/api/v1/namespaces/{ns}/pods", store)
        running(side, ns, "store")
        cluster_ip = created.body["spec"]["clusterIP"]

        def reached() -> bytes | None:
            try:
                with socket.create_connection((cluster_ip, port), timeout=3) as conn:
                    return conn.recv(16) or None
            except OSError:
                return None

        out["the store through its cluster IP"] = wait(f"{side.name}: {cluster_ip}:{port}", reached, 30)
        out["Endpoints of the service"] = side.call("GET", f"/api/v1/namespaces/{ns}/endpoints/store").code
        slices = side.call(
            "GET", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            labelSelector="kubernetes.io/service-name%3Dstore",
        )  # fmt: skip
        out["EndpointSlices listing the pod"] = [
            e for s in slices.body.get("items") or [] for e in s.get("endpoints") or []
        ]
        loopback = {
            "metadata": {"name": "loop"},
            "subsets": [{"addresses": [{"ip": "127.1.0.9"}], "ports": [{"port": port}]}],
        }
        out["Endpoints with a loopback address"] = status(
            side.call("POST", f"/api/v1/namespaces/{ns}/endpoints", loopback)
        )
        routable = copy.deepcopy(loopback)
        routable["subsets"][0]["addresses"][0]["ip"] = "10.1.2.3"
        made = side.call("POST", f"/api/v1/namespaces/{ns}/endpoints", routable)
        out["Endpoints with a routable address"] = (made.code, shape(made.body).get("subsets"))
        slice_body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "manual", "labels": {"kubernetes.io/service-name": "store"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.1.2.3"]}],
            "ports": [{"name": "rdzv", "port": port}],
        }
        slices_path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        made = side.call("POST", slices_path, slice_body)
        out["EndpointSlice with a routable address"] = (
            made.code,
            made.body.get("endpoints"),
            made.body.get("ports"),
        )
        bad = copy.deepcopy(slice_body)
        bad["metadata"]["name"] = "loop"
        bad["endpoints"] = [{"addresses": ["127.1.0.9"]}, {"addresses": ["169.254.0.1"]}, {"addresses": []}]
        out["EndpointSlice with loopback and link-local addresses"] = status(
            side.call("POST", slices_path, bad)
        )
        return out

    compare(real, emulator, scenario)


# -- watch from a resourceVersion the server no longer has ------------------------------------
def test_a_watch_resumed_or_from_a_compacted_resource_version(real: Side, emulator: Side) -> None:
    """A watch from a recent resourceVersion gets what happened since; one from a version the
    server's watch history does not reach (before the custom resource was served: kelastic's
    informers on ElasticJobs meet it after a restart) gets 410 Gone as an ERROR event."""

    def watch(side: Side, path: str, rv: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{side.url}{path}?watch=true&resourceVersion={rv}&timeoutSeconds=2")
        try:
            with urllib.request.urlopen(request, timeout=30, context=side.ssl) as resp:
                return [json.loads(line) for line in resp.read().splitlines() if line.strip()]
        except urllib.error.HTTPError as exc:
            return [{"type": f"HTTP {exc.code}", "object": json.loads(exc.read() or b"{}")}]

    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        path = gadget_crd(side)
        rv = side.call("GET", path).body["metadata"]["resourceVersion"]
        side.call("POST", path, gadget("watched", size=2))
        side.call("PATCH", f"{path}/watched", {"spec": {"size": 4}}, "application/merge-patch+json")
        events = watch(side, path, rv)
        out["resumed"] = [
            (e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] != "BOOKMARK"
        ]
        (gone,) = watch(side, path, "1")
        error = gone["object"]
        message = re.sub(r"\d+", "N", str(error.get("message", "")))
        out["from version 1"] = (
            gone["type"],
            error.get("kind"),
            error.get("code"),
            error.get("reason"),
            message,
        )
        return out

    compare(real, emulator, scenario)


# -- garbage collection: background, foreground, orphan ---------------------------------------
def test_owner_reference_garbage_collection_foreground_background_and_orphan(
    real: Side, emulator: Side
) -> None:
    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-gc")
        maps = f"/api/v1/namespaces/{ns}/configmaps"

        def family(owner: str, hold: bool = False) -> None:
            made = side.call("POST", maps, {"metadata": {"name": owner}}).body
            ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner, "uid": made["metadata"]["uid"]}
            held = {"finalizers": ["fidelity.kelastic.dev/hold"]} if hold else {}
            side.call(
                "POST",
                maps,
                {
                    "metadata": {
                        "name": f"{owner}-a",
                        "ownerReferences": [{**ref, "blockOwnerDeletion": True}],
                        **held,
                    }
                },
            )
            side.call("POST", maps, {"metadata": {"name": f"{owner}-b", "ownerReferences": [ref]}})

        def gone(name: str) -> bool:
            return side.call("GET", f"{maps}/{name}").code == 404

        family("bg")
        deleted = side.call("DELETE", f"{maps}/bg", {"propagationPolicy": "Background"})
        out["background: answer"] = (deleted.code, deleted.body.get("kind"), deleted.body.get("status"))
        out["background: owner gone at once"] = gone("bg")
        wait(f"{side.name}: background dependents to go", lambda: gone("bg-a") and gone("bg-b"), 90)

        family("fg", hold=True)
        deleted = side.call("DELETE", f"{maps}/fg", {"propagationPolicy": "Foreground"})
        out["foreground: answer"] = (deleted.code, shape(deleted.body).get("metadata"))
        wait(f"{side.name}: the unheld dependent to go", lambda: gone("fg-b"), 90)
        owner = side.call("GET", f"{maps}/fg")
        out["foreground: owner waits for the held dependent"] = (
            owner.code,
            shape(owner.body).get("metadata"),
        )
        held = side.call("GET", f"{maps}/fg-a").body
        out["foreground: held dependent"] = shape(held).get("metadata")
        side.call("PATCH", f"{maps}/fg-a", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
        wait(f"{side.name}: the owner to go once its dependents did", lambda: gone("fg-a") and gone("fg"), 90)

        family("or")
        deleted = side.call("DELETE", f"{maps}/or", {"propagationPolicy": "Orphan"})
        out["orphan: answer"] = (deleted.code, shape(deleted.body).get("metadata"))
        wait(f"{side.name}: the orphaning owner to go", lambda: gone("or"), 90)
        left = side.call("GET", f"{maps}/or-a").body
        out["orphan: dependent kept, reference removed"] = shape(left).get("metadata")
        return out

    compare(real, emulator, scenario)


# -- Lease leader election (the operator's own elector) ---------------------------------------
def test_lease_leader_election_as_the_operator_runs_it(real: Side, emulator: Side) -> None:
    from datetime import timedelta

    from kelastic.operator.clock import FakeClock
    from kelastic.operator.kube import Kube, load_configuration
    from kelastic.operator.leader import LeaderElector

    def scenario(side: Side) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ns = side.namespace("fid-lease")
        kube = Kube(load_configuration(str(side.kubeconfig)))
        try:
            clock_a, clock_b = FakeClock(), FakeClock()
            a = LeaderElector(kube, namespace=ns, name="kelastic-operator", identity="a", clock=clock_a)
            b = LeaderElector(kube, namespace=ns, name="kelastic-operator", identity="b", clock=clock_b)
            path = a.path
            out["a takes the free lease"] = a.try_acquire()
            out["b while a holds it"] = b.try_acquire()
            out["a renews"] = a.try_acquire()
            clock_b.advance(timedelta(seconds=30).total_seconds())
            out["b once a's lease expired"] = b.try_acquire()
            out["a after b took over"] = a.try_acquire()
            lease = side.call("GET", path).body
            out["the lease"] = times(shape(lease))
            stale = copy.deepcopy(lease)
            stale["metadata"]["resourceVersion"] = "1"
            out["a stale write"] = status(side.call("PUT", path, stale))
            bad = copy.deepcopy(lease)
            bad["spec"]["renewTime"] = "yesterday"
            out["a bad micro-time"] = status(side.call("PUT", path, bad))
        finally:
            kube.close()
        return out

    compare(real, emulator, scenario)

"""Conformance: one kubectl/HTTP sequence against the emulator and the real kube-apiserver, answers compared.

The sequence covers what kelastic relies on: a CRD with a structural schema
(defaults, pruning of unknown fields, validation), the status and scale
subresources, printer columns, server-side apply (and its conflicts), watch
from a resourceVersion, the ``Status`` bodies of 404/409/410/422, and the
garbage collector's ownerReference cascade. Each step's answer is normalized
(no UIDs, resourceVersions or timestamps) so the two servers' transcripts can
be compared key by key; a difference fails the test naming the step and both
answers.

The real lane needs the control-plane binaries (``control_plane_bin``); it is
slow (a control plane start plus the garbage collector's pace).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.controlplane.controlplane import ControlPlane, ControlPlaneBinaries
from kelastic.localcluster.testing import Kubectl, wait_for

pytestmark = pytest.mark.slow

GROUP = "conformance.kelastic.dev"
CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "color": {"type": "string", "default": "blue"},
                                    "replicas": {"type": "integer", "default": 1},
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "phase": {"type": "string"},
                                    "replicas": {"type": "integer"},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}
NS = "default"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/{NS}/widgets"


@dataclass
class Server:
    """One API server under test: its URL, a TLS context (real) and a kubeconfig for kubectl."""

    name: str
    url: str
    kubeconfig: Path
    ssl: ssl.SSLContext | None = None

    def raw(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.ssl) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return Kubectl(self.kubeconfig).run(*args, timeout=60, input=stdin)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"{}")
    except json.JSONDecodeError:  # e.g. "404 page not found" for a group not served yet
        return {"text": raw.decode(errors="replace")}


def status_body(body: Any) -> dict[str, Any]:
    """The comparable part of a ``Status``: kind, status, reason, code, details without UIDs."""
    details = dict(body.get("details") or {})
    details.pop("uid", None)
    causes = sorted((c.get("reason", ""), c.get("field", "")) for c in details.pop("causes", []) or [])
    return {
        "kind": body.get("kind"),
        "status": body.get("status"),
        "reason": body.get("reason"),
        "code": body.get("code"),
        "details": details,
        "causes": causes,
    }


def wait(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    return wait_for(probe, timeout, what, interval=0.2)


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


def run_sequence(server: Server) -> dict[str, Any]:
    """The normalized answers of ``server`` to the conformance sequence, by step."""
    out: dict[str, Any] = {}
    applied = server.kubectl("apply", "-f", "-", stdin=json.dumps(CRD))
    assert applied.returncode == 0, applied.stderr
    wait(
        "the CRD to be served",
        lambda: server.raw("GET", f"/apis/{GROUP}/v1")[0] == 200 and server.raw("GET", WIDGETS)[0] == 200,
    )

    # Defaults applied, unknown fields pruned (a warning-free create).
    code, body = server.raw(
        "POST", WIDGETS, {**widget("w1", size=3), "extra": 1, "spec": {"size": 3, "junk": True}}
    )
    out["create/defaults+pruning"] = (code, body.get("spec"), "extra" in body)
    # 409 AlreadyExists, 404 NotFound, 422 Invalid.
    code, body = server.raw("POST", WIDGETS, widget("w1", size=3))
    out["create again/409"] = (code, status_body(body))
    code, body = server.raw("GET", f"{WIDGETS}/nope")
    out["get missing/404"] = (code, status_body(body))
    code, body = server.raw("POST", WIDGETS, widget("bad", size=0))
    out["create invalid/422"] = (code, status_body(body))
    code, body = server.raw("POST", WIDGETS, {**widget("nosize"), "spec": {"color": "red"}})
    out["create missing required/422"] = (code, status_body(body))

    # Status subresource: the main resource ignores status, /status ignores spec.
    code, current = server.raw("GET", f"{WIDGETS}/w1")
    changed = {**current, "status": {"phase": "Ready"}, "spec": {**current["spec"], "size": 4}}
    code, body = server.raw("PUT", f"{WIDGETS}/w1", changed)
    out["put main ignores status"] = (code, body.get("spec", {}).get("size"), body.get("status"))
    code, body = server.raw(
        "PATCH",
        f"{WIDGETS}/w1/status",
        {"status": {"phase": "Ready", "replicas": 1}, "spec": {"size": 9}},
        "application/merge-patch+json",
    )
    out["patch status ignores spec"] = (code, body.get("spec", {}).get("size"), body.get("status"))

    # Scale subresource.
    code, body = server.raw("GET", f"{WIDGETS}/w1/scale")
    out["get scale"] = (
        code,
        body.get("kind"),
        body.get("apiVersion"),
        body.get("spec"),
        body.get("status", {}).get("replicas"),
    )
    code, body = server.raw(
        "PATCH", f"{WIDGETS}/w1/scale", {"spec": {"replicas": 3}}, "application/merge-patch+json"
    )
    out["patch scale"] = (code, body.get("spec"))
    out["spec after scale"] = server.raw("GET", f"{WIDGETS}/w1")[1]["spec"]

    # Printer columns (the Table kubectl reads).
    got = server.kubectl("get", "widgets", "w1", "-n", NS)
    out["printer columns"] = got.stdout.split("\n")[0].split() + got.stdout.split("\n")[1].split()[:-1]

    # Server-side apply: ownership, and a conflict with another manager.
    manifest = json.dumps({**widget("w2", size=5, color="green")})
    first = server.kubectl("apply", "--server-side", "--field-manager=alice", "-f", "-", stdin=manifest)
    code, body = server.raw("GET", f"{WIDGETS}/w2")
    managers = sorted(
        (m.get("manager"), m.get("operation")) for m in body["metadata"].get("managedFields") or []
    )
    out["ssa create"] = (first.returncode, body["spec"], managers)
    other = json.dumps(widget("w2", size=6))
    conflict = server.kubectl("apply", "--server-side", "--field-manager=bob", "-f", "-", stdin=other)
    out["ssa conflict"] = (
        conflict.returncode,
        "conflict" in conflict.stderr.lower(),
        ".spec.size" in conflict.stderr,
    )
    forced = server.kubectl(
        "apply", "--server-side", "--field-manager=bob", "--force-conflicts", "-f", "-", stdin=other
    )
    code, body = server.raw("GET", f"{WIDGETS}/w2")
    out["ssa force"] = (forced.returncode, body["spec"])

    # Watch from a resourceVersion: only what happened after it.
    code, listing = server.raw("GET", WIDGETS)
    rv = listing["metadata"]["resourceVersion"]
    server.raw("POST", WIDGETS, widget("w3", size=1))
    request = urllib.request.Request(
        f"{server.url}{WIDGETS}?watch=true&resourceVersion={rv}&timeoutSeconds=2"
    )
    with urllib.request.urlopen(request, timeout=30, context=server.ssl) as resp:
        events = [json.loads(line) for line in resp.read().splitlines() if line.strip()]
    out["watch from rv"] = [
        (e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] != "BOOKMARK"
    ]

    # 410 Gone: a watch from a version long compacted away.
    for i in range(120):  # enough writes to push version 1 out of any watch cache
        server.raw(
            "PATCH", f"{WIDGETS}/w3", {"metadata": {"labels": {"n": str(i)}}}, "application/merge-patch+json"
        )
    request = urllib.request.Request(f"{server.url}{WIDGETS}?watch=true&resourceVersion=1&timeoutSeconds=2")
    try:
        with urllib.request.urlopen(request, timeout=30, context=server.ssl) as resp:
            lines = [json.loads(line) for line in resp.read().splitlines() if line.strip()]
        errors = [e["object"] for e in lines if e["type"] == "ERROR"]
        out["watch too old/410"] = (
            "event",
            errors[0].get("code") if errors else None,
            errors[0].get("reason") if errors else None,
        )
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
        out["watch too old/410"] = ("status", body.get("code"), body.get("reason"))

    # ownerReference cascade by the garbage collector (background deletion).
    code, owner = server.raw("POST", f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    server.raw(
        "POST",
        f"/api/v1/namespaces/{NS}/configmaps",
        {"metadata": {"name": "child", "ownerReferences": [ref]}},
    )
    server.raw(
        "POST",
        WIDGETS,
        {**widget("w-child", size=1), "metadata": {"name": "w-child", "ownerReferences": [ref]}},
    )
    code, body = server.raw(
        "DELETE", f"/api/v1/namespaces/{NS}/configmaps/owner", {"propagationPolicy": "Background"}
    )
    out["delete owner"] = code
    wait(
        "the garbage collector to delete the owner's dependents",
        lambda: (
            server.raw("GET", f"/api/v1/namespaces/{NS}/configmaps/child")[0] == 404
            and server.raw("GET", f"{WIDGETS}/w-child")[0] == 404
        ),
        90,
    )
    out["cascade"] = "dependents deleted"

    # Endpoints refuse loopback addresses (Services' pods are on 127.1.x here).
    code, body = server.raw(
        "POST",
        f"/api/v1/namespaces/{NS}/endpoints",
        {
            "metadata": {"name": "loop"},
            "subsets": [{"addresses": [{"ip": "127.1.0.5"}], "ports": [{"port": 80}]}],
        },
    )
    out["endpoints loopback/422"] = (code, status_body(body))
    return out


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("emulator")
    api = ApiServer(data_dir=data)
    api.start()
    kubeconfig = api.write_kubeconfig(data / "kubeconfig")
    try:
        yield Server("emulator", str(api.url), Path(kubeconfig))
    finally:
        api.stop()


@pytest.fixture(scope="module")
def real(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("control-plane")
    plane = ControlPlane(ControlPlaneBinaries.find(control_plane_bin), state)
    with plane:
        admin = plane.ssl_context(plane.credentials("admin"))
        yield Server("kube-apiserver", plane.url, plane.admin_kubeconfig, admin)


def test_emulator_answers_like_the_real_api_server(emulator: Server, real: Server) -> None:
    expected = run_sequence(real)
    got = run_sequence(emulator)
    differences = [
        f"{step}:\n    kube-apiserver: {expected.get(step)!r}\n    emulator:       {got.get(step)!r}"
        for step in expected
        if expected.get(step) != got.get(step)
    ]
    assert not differences, "the emulator differs from the real API server:\n" + "\n".join(differences)

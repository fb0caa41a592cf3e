"""kopf, a real operator framework, runs against the API server without errors in its log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.testing import Kubectl, stop_process, wait_for

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.test.kelastic.io"},
    "spec": {
        "group": "test.kelastic.io",
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
                                "properties": {"size": {"type": "integer", "default": 1}},
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}

OPERATOR = """
import kopf

@kopf.on.create("test.kelastic.io", "v1", "gadgets")
def created(spec, patch, body, logger, **_):
    patch.status["phase"] = "Seen"
    patch.status["observedSize"] = spec["size"]
    kopf.info(body, reason="Seen", message="gadget seen by the test operator")
    logger.info("gadget handled")

@kopf.on.update("test.kelastic.io", "v1", "gadgets", field="spec.size")
def resized(new, patch, **_):
    patch.status["observedSize"] = new

@kopf.on.delete("test.kelastic.io", "v1", "gadgets")
def deleted(logger, **_):
    logger.info("gadget cleaned up")
"""


@pytest.mark.slow
def test_kopf_operator_patches_status_and_posts_events(api: ApiServer, tmp_path: Path) -> None:
    kubectl = Kubectl(api.data_dir / "kubeconfig")
    kubectl.apply(json.dumps(CRD))
    op = tmp_path / "op.py"
    op.write_text(OPERATOR)
    log = tmp_path / "kopf.log"
    env = {**os.environ, "KUBECONFIG": str(api.data_dir / "kubeconfig")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace", "default", str(op)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:
        kubectl.apply(
            json.dumps(
                {
                    "apiVersion": "test.kelastic.io/v1",
                    "kind": "Gadget",
                    "metadata": {"name": "g1"},
                    "spec": {"size": 3},
                }
            )
        )
        wait_for(
            lambda: kubectl.json("gadget", "g1").get("status", {}).get("phase") == "Seen",
            20,
            f"kopf to set status.phase (log: {log})",
        )
        kubectl("patch", "gadget", "g1", "--type=merge", "-p", '{"spec":{"size":5}}')
        wait_for(
            lambda: kubectl.json("gadget", "g1")["status"].get("observedSize") == 5,
            20,
            "kopf to react to the spec change",
        )
        events = kubectl.json("events", "--field-selector", "involvedObject.name=g1")["items"]
        assert any(e["reason"] == "Seen" for e in events)
        # The delete handler runs behind kopf's finalizer; the object goes once kopf removes it.
        assert kubectl.json("gadget", "g1")["metadata"]["finalizers"]
        kubectl("delete", "gadget", "g1", "--timeout=20s")
        assert "g1" not in kubectl("get", "gadgets", "-o", "name")
    finally:
        stop_process(proc, 15, kill_grace=5)
    text = log.read_text()
    assert "gadget handled" in text and "gadget cleaned up" in text
    bad = [line for line in text.splitlines() if any(w in line for w in ("ERROR", "Traceback", "WARNING"))]
    assert not bad, text

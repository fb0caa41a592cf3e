"""crds/elasticjob.yaml's spec.checkpoint and status.checkpoint on both API servers, with the real kubectl.

The emulator and the real kube-apiserver must both accept the CRD, default
``spec.checkpoint``, refuse values the schema forbids and, through kubectl, a mistyped
field; and show ``status.checkpoint.latest`` in the Checkpoint column.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "elasticjob.yaml"


if TYPE_CHECKING:
    from kelastic.localcluster.testing import KubectlApi as Server


@pytest.fixture(scope="module")
def server(kubectl_api: Server) -> Server:
    return kubectl_api


@pytest.fixture(scope="module")
def crd(server: Server) -> Server:
    server.ok("apply", "-f", str(CRD))
    deadline = time.monotonic() + 60
    while server.kubectl("get", "elasticjobs").returncode != 0:
        assert time.monotonic() < deadline, "the ElasticJob CRD was not served within 60 s"
        time.sleep(0.5)
    return server


def job(name: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "trainer", "image": "torch:1", "command": ["python", "train.py"]}
    container["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 3,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "containers": [container],
                            "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                        }
                    },
                }
            },
            **spec,
        },
    }


def stored(server: Server, name: str) -> dict[str, Any]:
    return json.loads(server.ok("get", "ej", name, "-o", "json"))  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_checkpoint_spec_is_accepted_and_defaulted(crd: Server) -> None:
    full = {
        "replicas": 2,
        "memoryLimit": "6Gi",
        "persist": {"path": "/ckpt/run", "every": 10, "intervalSeconds": 600},
    }
    crd.ok("apply", "-f", "-", stdin=yaml.safe_dump(job("full", checkpoint=full)))
    assert stored(crd, "full")["spec"]["checkpoint"] == full
    crd.ok("apply", "-f", "-", stdin=yaml.safe_dump(job("bytes", checkpoint={"memoryLimit": 4294967296})))
    assert stored(crd, "bytes")["spec"]["checkpoint"] == {"memoryLimit": 4294967296, "replicas": 1}
    # A job that says nothing gets the checkpoint's defaults, visible in kubectl get -o yaml.
    crd.ok("apply", "-f", "-", stdin=yaml.safe_dump(job("plain")))
    assert stored(crd, "plain")["spec"]["checkpoint"] == {"replicas": 1}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "says"),
    [
        ({"replicas": 4}, "spec.checkpoint.replicas"),
        ({"replicas": -1}, "spec.checkpoint.replicas"),
        ({"memoryLimit": "4GB"}, "spec.checkpoint.memoryLimit"),
        ({"memoryLimit": "-1Gi"}, "spec.checkpoint.memoryLimit"),
        ({"persist": {"every": 2}}, "spec.checkpoint.persist.path"),
        ({"persist": {"path": "ckpt"}}, "spec.checkpoint.persist.path"),
        ({"persist": {"path": "/ckpt", "every": 0}}, "spec.checkpoint.persist.every"),
    ],
)
def test_the_schema_refuses_bad_values(crd: Server, checkpoint: dict[str, Any], says: str) -> None:
    # --validate=false: the API server's own verdict (kubectl may also check the published
    # schema on the client, and refuse these with its own words first).
    bad = yaml.safe_dump(job("bad", checkpoint=checkpoint))
    done = crd.kubectl("apply", "--validate=false", "-f", "-", stdin=bad)
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert crd.kubectl("apply", "-f", "-", stdin=bad).returncode != 0


@pytest.mark.slow
def test_kubectl_refuses_a_mistyped_checkpoint_field(crd: Server) -> None:
    """kubectl asks for strict field validation: the unknown field is refused by name on both servers."""
    done = crd.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job("typo", checkpoint={"replica": 2})))
    assert done.returncode != 0 and "replica" in done.stderr, done.stderr
    assert crd.kubectl("get", "ej", "typo").returncode != 0


@pytest.mark.slow
def test_status_checkpoint_is_stored_and_shown_in_the_checkpoint_column(crd: Server) -> None:
    crd.ok("apply", "-f", "-", stdin=yaml.safe_dump(job("shown")))
    status = {
        "checkpoint": {
            "latest": 12,
            "step": 340,
            "restoredId": 11,
            "restoredFrom": "replica",
            "restoredSeconds": 0.4,
            "restoredTime": "2026-01-01T12:00:00.300Z",
        }
    }
    crd.ok(
        "patch", "ej", "shown", "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
    )
    assert stored(crd, "shown")["status"]["checkpoint"] == status["checkpoint"]
    header, row = crd.ok("get", "ej", "shown").splitlines()
    assert row[header.index("CHECKPOINT") :].split()[0] == "12", f"{header}\n{row}"

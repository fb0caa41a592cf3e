"""Claims on kelastic local: bound at once, one shared directory per claim, mount paths relocated to it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.controllers.provisioner import volume_for
from kelastic.localcluster.testing import wait_for


def test_volume_for_a_claim_is_prebound_to_it(tmp_path: Path) -> None:
    claim = {
        "metadata": {"name": "data", "namespace": "ns", "uid": "u-1"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Gi"}}},
    }
    pv = volume_for(claim, tmp_path / "ns" / "data")
    assert pv["metadata"]["name"] == "kelastic-u-1"
    assert pv["spec"]["claimRef"] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": "ns",
        "name": "data",
        "uid": "u-1",
    }
    assert pv["spec"]["capacity"] == {"storage": "2Gi"} and pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["hostPath"]["path"] == str(tmp_path / "ns" / "data")
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain" and pv["spec"]["storageClassName"] == ""


def test_pods_share_a_claim_through_its_mount_path(tmp_path: Path) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }

    def writer(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "c",
                        "image": "python",
                        # The mount path in the command line is relocated to the claim's directory.
                        "command": ["python", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"],
                        "args": [f"/kelastic-test-claim/{name}.txt", name],
                        "volumeMounts": [{"name": "d", "mountPath": "/kelastic-test-claim"}],
                    }
                ],
                "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "shared"}}],
            },
        }

    with LocalCluster(tmp_path / "cluster", workdir=tmp_path) as cluster:
        kubectl = ["kubectl", "--kubeconfig", str(cluster.kubeconfig)]
        docs = [claim, writer("a"), writer("b")]
        subprocess.run([*kubectl, "apply", "-f", "-"], input=yaml.safe_dump_all(docs), text=True, check=True)

        def phase(kind: str, name: str) -> str:
            out = subprocess.run([*kubectl, "get", kind, name, "-o", "json"], capture_output=True, text=True)
            return str((json.loads(out.stdout or "{}").get("status") or {}).get("phase", ""))

        wait_for(lambda: phase("pvc", "shared") == "Bound", 60, "the claim to be Bound", interval=0.3)
        wait_for(
            lambda: phase("pod", "a") == phase("pod", "b") == "Succeeded",
            120,
            "both writers to succeed",
            interval=0.3,
        )
        directory = cluster.data_dir / "claims" / "default" / "shared"
        assert sorted(p.read_text() for p in directory.iterdir()) == ["a", "b"]
    assert not Path("/kelastic-test-claim").exists()

"""The real control plane across starts on one state directory.

Binaries from the ``control_plane_bin`` fixture (skipped with a reason without
them). The first test runs etcd and kube-apiserver alone (it is about etcd's
data, and every start costs seconds); the second the whole local cluster.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from pathlib import Path

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.controlplane.controlplane import ControlPlane, ControlPlaneBinaries
from kelastic.localcluster.testing import Kubectl, wait_for

pytestmark = pytest.mark.slow


def _etcd_and_apiserver(control_plane_bin: Path) -> ControlPlaneBinaries:
    """The binaries without the controller-manager and scheduler."""
    found = ControlPlaneBinaries.find(control_plane_bin)
    return ControlPlaneBinaries(found.apiserver, found.etcd)


def _request(
    cp: ControlPlane, method: str, path: str, body: dict[str, object] | None = None
) -> dict[str, object]:
    ctx: ssl.SSLContext = cp.ssl_context(cp.credentials("admin"))
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        cp.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
        return dict(json.loads(resp.read()))


def test_a_state_dir_is_reused_and_keeps_its_objects(control_plane_bin: Path, tmp_path: Path) -> None:
    binaries = _etcd_and_apiserver(control_plane_bin)
    state = tmp_path / "state"
    lines: list[str] = []
    with ControlPlane(binaries, state, progress=lines.append) as first:
        _request(
            first,
            "POST",
            "/api/v1/namespaces/default/configmaps",
            {"metadata": {"name": "kept"}, "data": {"k": "v"}},
        )
    member = (state / "etcd-member").read_text().strip()
    assert member.startswith("kelastic-"), member
    # A second start on the same directory: the same etcd member, the object still there.
    with ControlPlane(binaries, state, progress=lines.append, timeout=60.0) as second:
        kept = _request(second, "GET", "/api/v1/namespaces/default/configmaps/kept")
        assert kept["data"] == {"k": "v"}
    assert (state / "etcd-member").read_text().strip() == member
    assert sum("etcd healthy" in line for line in lines) == 2, lines


def test_a_local_cluster_restarted_on_its_state_dir_keeps_objects_and_runs_pods(
    control_plane_bin: Path, tmp_path: Path
) -> None:
    # What `kelastic local up --control-plane DIR --state-dir S` does twice.
    state = tmp_path / "state"

    with LocalCluster(state / "data", state_dir=state, control_plane=control_plane_bin) as first:
        Kubectl(first.kubeconfig)("create", "configmap", "kept", "--from-literal=k=v")
    with LocalCluster(state / "data", state_dir=state, control_plane=control_plane_bin) as second:
        kubectl = Kubectl(second.kubeconfig)
        assert kubectl.json("configmap", "kept")["data"] == {"k": "v"}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "after-restart"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "c", "image": "x", "command": ["true"]}],
            },
        }
        kubectl.apply_object(pod)
        wait_for(
            lambda: kubectl.json("pod", "after-restart")["status"].get("phase") == "Succeeded",
            90,
            "a pod to run on the restarted cluster",
            interval=0.5,
        )

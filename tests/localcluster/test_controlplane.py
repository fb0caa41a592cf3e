"""``LocalCluster(control_plane=DIR)``: the process kubelet and proxy against the real kube-apiserver.

One cluster for the module (the real etcd, kube-apiserver, controller-manager
and scheduler); kubectl and pods talk to it as to any cluster. Binaries come
from the ``control_plane_bin`` fixture (skipped with a reason without them).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.testing import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cp_cluster(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lines: list[str] = []
    cluster = LocalCluster(
        tmp_path_factory.mktemp("cp"), control_plane=control_plane_bin, progress=lines.append
    )
    cluster.kubelet_config.heartbeat_s = 1.0
    with cluster:
        assert any("etcd healthy after" in line for line in lines), lines
        assert any(line.startswith("control plane v") and "ready after" in line for line in lines), lines
        yield cluster


def kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
    return done.stdout


def get(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json"))


def wait(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    return wait_for(probe, timeout, what, interval=0.2)


def test_components_are_out_of_reach_of_a_terminals_ctrl_c(cp_cluster: LocalCluster) -> None:
    # Ctrl-C signals the terminal's process group: only kelastic must get it (it stops them in order).
    assert cp_cluster.control_plane is not None
    groups = {name: os.getpgid(pid) for name, pid in cp_cluster.control_plane.pids().items()}
    assert groups and os.getpgrp() not in groups.values(), groups


def test_the_node_registers_stays_ready_and_renews_its_lease(cp_cluster: LocalCluster) -> None:
    assert cp_cluster.control_plane is not None and cp_cluster.control_plane.version is not None
    node = get(cp_cluster, "node", "kelastic-local")
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    # The API server's TaintNodesByCondition admission taints a new Node not-ready; the node
    # lifecycle controller lifts it once it sees the Ready heartbeat.
    wait(
        "the not-ready taint to be lifted",
        lambda: not get(cp_cluster, "node", "kelastic-local")["spec"].get("taints"),
        30,
    )
    assert node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] > 0
    # The node reports the control plane's version (no skew for version-aware clients).
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith(str(cp_cluster.control_plane.version))
    first = get(cp_cluster, "lease", "-n", "kube-node-lease", "kelastic-local")["spec"]["renewTime"]
    wait(
        "the node lease to be renewed",
        lambda: (
            get(cp_cluster, "lease", "-n", "kube-node-lease", "kelastic-local")["spec"]["renewTime"] != first
        ),
        15,
    )


def test_a_pod_runs_as_its_service_account_and_its_logs_are_served(cp_cluster: LocalCluster) -> None:
    # The official client in the pod, configured only by what the kubelet hands it.
    script = (
        "import kubernetes as k\n"
        "k.config.load_kube_config()\n"
        "try:\n"
        "    k.client.CoreV1Api().list_namespaced_pod('default')\n"
        "except k.client.ApiException as e:\n"
        "    print('status', e.status, 'user', e.body)\n"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "whoami", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "python", "command": ["python", "-c", script]}],
        },
    }
    kubectl(cp_cluster, "apply", "-f", "-", stdin=json.dumps(pod))
    wait(
        "pod whoami to finish",
        lambda: get(cp_cluster, "pod", "whoami")["status"].get("phase") in ("Succeeded", "Failed"),
    )
    status = get(cp_cluster, "pod", "whoami")
    assert status["status"]["phase"] == "Succeeded", status["status"]
    assert status["spec"]["nodeName"] == "kelastic-local"  # bound by the real scheduler
    logs = kubectl(cp_cluster, "logs", "whoami")  # the API server asks the kubelet's log endpoint
    assert "status 403" in logs and "system:serviceaccount:default:default" in logs, logs
    assert kubectl(cp_cluster, "logs", "whoami", "--tail=1").count("\n") == 1
    kubectl(cp_cluster, "delete", "pod", "whoami", "--wait=true", "--timeout=60s")


def test_a_projected_token_is_rewritten_before_it_expires(cp_cluster: LocalCluster) -> None:
    # The API server grants 600 s at least: the kubelet's clock is moved forward instead of waiting.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "token-holder", "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "python",
                    "command": ["python", "-c", "import time; time.sleep(600)"],
                    "volumeMounts": [
                        {"name": "sa", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "sa",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                        ]
                    },
                }
            ],
        },
    }
    kubectl(cp_cluster, "apply", "-f", "-", stdin=json.dumps(pod))
    wait(
        "pod token-holder to run",
        lambda: get(cp_cluster, "pod", "token-holder")["status"].get("phase") == "Running",
    )
    uid = get(cp_cluster, "pod", "token-holder")["metadata"]["uid"]
    assert cp_cluster.kubelet is not None
    worker = cp_cluster.kubelet.workers[uid]
    current = cp_cluster.kubelet.pods[worker.key]
    (issued,) = worker.tokens.values()
    assert issued.expiration_seconds == 600
    token_file = worker.volumes["sa"] / "token"
    kubeconfig = worker.pod_dir / "serviceaccount.kubeconfig"
    first = token_file.read_text()
    assert first == issued.token and first in kubeconfig.read_text()

    # Half-way: nothing to do; the next look is due at 80 %.
    due = cp_cluster.call(worker.refresh_tokens(current, now=issued.issued_at + 300))
    assert due == issued.refresh_at == issued.issued_at + 480
    assert token_file.read_text() == first
    # At 81 %: a new token, in the file and in the container's kubeconfig, and it authenticates.
    cp_cluster.call(worker.refresh_tokens(current, now=issued.issued_at + 486))
    second = token_file.read_text()
    assert second != first and worker.tokens[next(iter(worker.tokens))].token == second
    config = json.loads(kubeconfig.read_text())
    assert config["users"][0]["user"]["token"] == second
    request = urllib.request.Request(
        cp_cluster.url + "/apis/authentication.k8s.io/v1", headers={"Authorization": f"Bearer {second}"}
    )
    assert cp_cluster.control_plane is not None
    with urllib.request.urlopen(request, timeout=30, context=cp_cluster.control_plane.ssl_context()) as resp:
        assert resp.status == 200  # 401 for a token the API server does not take
    kubectl(cp_cluster, "delete", "pod", "token-holder", "--grace-period=1", "--wait=true", "--timeout=60s")


def test_services_reach_their_ready_pods_through_the_service_proxy(
    cp_cluster: LocalCluster,
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "python",
                    "command": ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                }
            ]
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "web", "port": 80, "targetPort": "http"}]},
    }
    kubectl(
        cp_cluster,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod, service]}),
    )
    wait("pod web to get an IP", lambda: get(cp_cluster, "pod", "web")["status"].get("podIP"))
    cluster_ip = get(cp_cluster, "service", "web")["spec"]["clusterIP"]

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://{cluster_ip}:80/", timeout=3) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait(f"http://{cluster_ip}:80 to answer through the service proxy", answers, 30)
    # The controllers that would write our loopback addresses are off where the API server
    # refuses them: no failing writes of Endpoints or EndpointSlices.
    reasons = {e.get("reason") for e in get(cp_cluster, "events")["items"]}
    failed = {"FailedToCreateEndpoint", "FailedToUpdateEndpoint", "FailedToUpdateEndpointSlices"}
    assert not reasons & failed, reasons
    kubectl(cp_cluster, "delete", "service", "web")
    kubectl(cp_cluster, "delete", "pod", "web", "--wait=true", "--timeout=60s")


def test_every_component_stops_with_the_cluster(control_plane_bin: Path, tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, control_plane=control_plane_bin)
    cluster.start()
    assert cluster.control_plane is not None
    pids = cluster.control_plane.pids()
    assert set(pids) >= {"etcd", "kube-apiserver"}
    cluster.stop()
    alive = subprocess.run(
        ["ps", "-o", "pid=", "-p", ",".join(map(str, pids.values()))], capture_output=True, text=True
    )
    assert alive.stdout.strip() == "", f"still running after stop(): {alive.stdout} of {pids}"

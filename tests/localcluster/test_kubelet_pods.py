"""The process kubelet driven by the real kubectl: pods run as local processes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.common.podlogs import pod_log_dir
from kelastic.localcluster.testing import Kubectl, cluster_fixture, kubectl_fixture, process_alive, wait_for  # noqa: F401


def _pod(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("pod", name)


def _phase(kubectl: Kubectl, name: str) -> str:
    return str(_pod(kubectl, name).get("status", {}).get("phase", ""))


def test_kubectl_run_reaches_succeeded_with_logs(kubectl: Kubectl) -> None:
    kubectl(
        "run",
        "hello",
        "--image=python:3.11",
        "--restart=Never",
        "--",
        "python",
        "-c",
        "print('hello from a pod')",
    )
    wait_for(lambda: _phase(kubectl, "hello") == "Succeeded", 30, "pod hello to succeed")
    assert kubectl("logs", "hello").strip() == "hello from a pod"
    assert kubectl("logs", "hello", "-c", "hello", "--tail=1").strip() == "hello from a pod"
    pod = _pod(kubectl, "hello")
    status = pod["status"]
    assert pod["spec"]["nodeName"] == "kelastic-local"
    assert status["podIP"].startswith("127.1.")
    (cs,) = status["containerStatuses"]
    assert cs["state"]["terminated"]["exitCode"] == 0 and cs["state"]["terminated"]["reason"] == "Completed"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "False",
        "Ready": "False",
    }


def test_crashing_container_backs_off_and_keeps_previous_logs(kubectl: Kubectl) -> None:
    kubectl.apply(
        """
apiVersion: v1
kind: Pod
metadata: {name: crasher}
spec:
  restartPolicy: OnFailure
  containers:
  - name: main
    image: python:3.11
    command: [python, -c, "import os, sys; print('crash', os.getpid()); sys.exit(3)"]
"""
    )
    seen_backoff = False

    def restarted_in_backoff() -> bool:
        nonlocal seen_backoff
        (cs,) = _pod(kubectl, "crasher")["status"].get("containerStatuses") or [{}]
        waiting = cs.get("state", {}).get("waiting", {})
        seen_backoff = seen_backoff or waiting.get("reason") == "CrashLoopBackOff"
        return seen_backoff and cs.get("restartCount", 0) >= 2

    wait_for(restarted_in_backoff, 25, "restartCount >= 2 with CrashLoopBackOff")
    cs = _pod(kubectl, "crasher")["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 3
    assert _phase(kubectl, "crasher") == "Running"  # OnFailure: it will be restarted
    assert kubectl("logs", "crasher", "--previous").startswith("crash")
    kubectl("delete", "pod", "crasher", "--grace-period=0", "--force")


def test_init_containers_run_first_in_order(kubectl: Kubectl, tmp_path: Path) -> None:
    record = tmp_path / "order"
    record.mkdir()

    def step(name: str, delay: float = 0.0) -> dict[str, Any]:
        code = f"import time; time.sleep({delay}); open({str(record / 'log')!r}, 'a').write({name!r} + '\\n')"
        return {"name": name, "image": "x", "command": ["python", "-c", code]}

    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "initorder"},
            "spec": {
                "restartPolicy": "Never",
                "initContainers": [step("init-1", delay=0.3), step("init-2")],
                "containers": [step("main")],
            },
        }
    )
    wait_for(lambda: _phase(kubectl, "initorder") == "Succeeded", 30, "pod initorder to succeed")
    assert (record / "log").read_text().split() == ["init-1", "init-2", "main"]
    statuses = _pod(kubectl, "initorder")["status"]["initContainerStatuses"]
    assert [s["state"]["terminated"]["reason"] for s in statuses] == ["Completed", "Completed"]


def test_env_field_refs_pod_ip_configmaps_and_expansion(kubectl: Kubectl) -> None:
    kubectl.apply_object(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"LR": "0.25"}}
    )
    kubectl.apply(
        """
apiVersion: v1
kind: Pod
metadata: {name: envpod, labels: {app: envtest}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: x
    envFrom: [{configMapRef: {name: settings}}]
    env:
    - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
    - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
    - {name: APP, valueFrom: {fieldRef: {fieldPath: "metadata.labels['app']"}}}
    - {name: ENDPOINT, value: "$(POD_IP):29400"}
    command: [python, -c]
    args:
    - "import os, sys; print(sys.executable); [print(k + '=' + os.environ[k]) for k in ('POD_NAME', 'POD_NAMESPACE', 'POD_IP', 'APP', 'ENDPOINT', 'LR')]; print('arg', sys.argv[1])"
    - "$(POD_NAME)"
"""
    )
    wait_for(lambda: _phase(kubectl, "envpod") == "Succeeded", 30, "pod envpod to succeed")
    lines = kubectl("logs", "envpod").splitlines()
    ip = _pod(kubectl, "envpod")["status"]["podIP"]
    assert lines[0] == sys.executable
    env = dict(line.split("=", 1) for line in lines[1:-1])
    assert env == {
        "POD_NAME": "envpod",
        "POD_NAMESPACE": "default",
        "POD_IP": ip,
        "APP": "envtest",
        "ENDPOINT": f"{ip}:29400",
        "LR": "0.25",
    }
    assert lines[-1] == "arg envpod"


TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _start_tree(kubectl: Kubectl, name: str, pidfile: Path) -> tuple[int, int]:
    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "main", "image": "x", "command": ["python", "-c", TREE, str(pidfile)]}
                ],
            },
        }
    )
    text = wait_for(lambda: pidfile.exists() and pidfile.read_text(), 20, f"{name} to start its process tree")
    parent, child = (int(x) for x in text.split())
    assert process_alive(parent) and process_alive(child)
    return parent, child


def test_force_deletion_kills_the_whole_process_tree(kubectl: Kubectl, tmp_path: Path) -> None:
    parent, child = _start_tree(kubectl, "tree", tmp_path / "pids")
    wait_for(lambda: _phase(kubectl, "tree") == "Running", 10, "pod tree to run")
    kubectl("delete", "pod", "tree", "--grace-period=0", "--force")
    wait_for(lambda: not process_alive(parent) and not process_alive(child), 5, "the pod's processes to die")
    assert not kubectl("get", "pod", "tree", "--ignore-not-found").strip()


@pytest.mark.slow
def test_graceful_deletion_honours_the_grace_period(kubectl: Kubectl, tmp_path: Path) -> None:
    marker = tmp_path / "got-term"
    script = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: open('{marker}', 'w').write('TERM'))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "stubborn"},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "main", "image": "x", "command": ["python", "-c", script]}],
            },
        }
    )
    # "ready" is printed once the SIGTERM handler is in place.
    wait_for(lambda: "ready" in kubectl("logs", "stubborn", check=False), 20, "pod stubborn to start")
    pid = int(_pod(kubectl, "stubborn")["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    start = time.monotonic()
    kubectl("delete", "pod", "stubborn", "--wait=false")
    # Terminating: the object stays while the process gets its grace period.
    wait_for(lambda: marker.exists(), 10, "SIGTERM to reach the container")
    assert _pod(kubectl, "stubborn")["metadata"].get("deletionTimestamp")
    assert process_alive(pid)
    wait_for(lambda: not kubectl("get", "pod", "stubborn", "--ignore-not-found").strip(), 10, "pod removal")
    elapsed = time.monotonic() - start
    assert not process_alive(pid)
    assert elapsed >= 1.5, f"the pod was removed after {elapsed:.1f}s, before its 2 s grace period"


def _answer(url: str) -> str | None:
    """The body at ``url``, or None when the connection is refused or closed unanswered."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except (urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected):
        return None


@pytest.mark.slow
def test_cluster_ip_reaches_a_listening_pod_once_it_is_ready(kubectl: Kubectl, tmp_path: Path) -> None:
    ready_flag = tmp_path / "ready"
    kubectl.apply(
        f"""
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  selector: {{app: web}}
  ports: [{{name: http, port: 8080, targetPort: http}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: web-0, labels: {{app: web}}}}
spec:
  containers:
  - name: server
    image: python:3.11
    env: [{{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}]
    command: [python, -m, http.server, "8000", --bind, "$(POD_IP)", --directory, "{tmp_path}"]
    ports: [{{name: http, containerPort: 8000}}]
    readinessProbe:
      exec: {{command: [test, -f, "{ready_flag}"]}}
      periodSeconds: 1
      failureThreshold: 1
"""
    )
    (tmp_path / "index.html").write_text("served by web-0")
    wait_for(lambda: _phase(kubectl, "web-0") == "Running", 20, "web-0 to run")

    cluster_ip = kubectl.json("service", "web")["spec"]["clusterIP"]
    assert cluster_ip.startswith("127.")
    url = f"http://{cluster_ip}:8080/index.html"
    # Running but not ready: the service proxy does not send it connections (closed at once).
    assert _answer(url) is None
    ready_flag.touch()
    wait_for(
        lambda: (
            {c["type"]: c["status"] for c in _pod(kubectl, "web-0")["status"]["conditions"]}["Ready"]
            == "True"
        ),
        10,
        "web-0 to become Ready",
    )
    assert wait_for(lambda: _answer(url), 10, "the ClusterIP to answer") == "served by web-0"
    # Neither Endpoints nor EndpointSlices can hold a loopback pod address (the real API
    # server refuses both too): the proxy found the pod itself.
    assert kubectl("get", "endpoints", "web", check=False).strip() == ""
    slices = kubectl.json("endpointslices", "-l", "kubernetes.io/service-name=web")["items"]
    assert [e for piece in slices for e in piece.get("endpoints") or []] == []

    ready_flag.unlink()
    wait_for(lambda: _answer(url) is None, 10, "web-0 to be left out once unready")
    kubectl("delete", "pod", "web-0", "--grace-period=0", "--force")
    kubectl("delete", "service", "web")


def test_liveness_probe_restarts_the_container(kubectl: Kubectl) -> None:
    kubectl.apply(
        """
apiVersion: v1
kind: Pod
metadata: {name: unhealthy}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: x
    command: [python, -c, "import time; time.sleep(600)"]
    livenessProbe:
      httpGet: {port: 9, path: /healthz}
      periodSeconds: 1
      failureThreshold: 2
"""
    )
    wait_for(
        lambda: (
            (_pod(kubectl, "unhealthy")["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0)
            >= 1
        ),
        20,
        "the failing liveness probe to restart the container",
    )
    kubectl("delete", "pod", "unhealthy", "--grace-period=0", "--force")


def test_a_restarted_cluster_restarts_the_containers_of_persisted_pods(tmp_path: Path) -> None:
    def start() -> tuple[LocalCluster, Kubectl]:
        local = LocalCluster(tmp_path / "data", state_dir=tmp_path / "state", workdir=tmp_path)
        local.start()
        return local, Kubectl(local.kubeconfig)

    local, kubectl = start()
    try:
        kubectl(
            "run",
            "keeper",
            "--image=x",
            "--",
            "python",
            "-c",
            "import time; print('up', flush=True); time.sleep(600)",
        )
        kubectl("run", "once", "--image=x", "--restart=Never", "--", "python", "-c", "print('done')")
        wait_for(
            lambda: _phase(kubectl, "keeper") == "Running" and _phase(kubectl, "once") == "Succeeded",
            20,
            "pods",
        )
        first_pid = int(
            _pod(kubectl, "keeper")["status"]["containerStatuses"][0]["containerID"].split("://")[1]
        )
    finally:
        local.stop()
    assert not process_alive(first_pid)
    local, kubectl = start()
    try:

        def restarted() -> dict[str, Any] | None:
            (cs,) = _pod(kubectl, "keeper")["status"]["containerStatuses"]
            return cs if cs["restartCount"] == 1 and "running" in cs["state"] else None

        cs = wait_for(restarted, 20, "keeper to be restarted by the new kubelet")
        assert cs["lastState"]["terminated"]["reason"] == "ContainerStatusUnknown"
        assert _phase(kubectl, "once") == "Succeeded"  # finished pods are not run again
        assert kubectl("logs", "once").strip() == "done"
    finally:
        local.stop()


def test_logs_follow_a_running_container_to_its_end(kubectl: Kubectl) -> None:
    script = "import time\nfor i in range(4):\n    print('line', i, flush=True)\n    time.sleep(0.3)\n"
    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "talker"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "x", "command": ["python", "-c", script]}],
            },
        }
    )
    wait_for(lambda: _phase(kubectl, "talker") == "Running", 20, "talker to run")
    # -f returns once the container has ended, with everything it printed.
    assert kubectl("logs", "-f", "talker", timeout=20).split("\n")[:4] == [f"line {i}" for i in range(4)]
    wait_for(lambda: _phase(kubectl, "talker") == "Succeeded", 10, "talker to succeed")


def test_many_short_lived_pods_all_reach_succeeded(kubectl: Kubectl) -> None:
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"burst-{i}", "labels": {"burst": "yes"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "x", "command": ["true"]}],
            },
        }
        for i in range(12)
    ]
    kubectl.apply_object({"apiVersion": "v1", "kind": "List", "items": pods})

    def all_succeeded() -> bool:
        items = kubectl.json("pods", "-l", "burst=yes")["items"]
        return len(items) == 12 and all(p["status"].get("phase") == "Succeeded" for p in items)

    wait_for(all_succeeded, 30, "12 short-lived pods to succeed")
    kubectl("delete", "pods", "-l", "burst=yes", "--grace-period=0", "--force")


def test_active_deadline_fails_the_pod_and_stops_it(kubectl: Kubectl) -> None:
    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "deadline"},
            "spec": {
                "restartPolicy": "OnFailure",
                "activeDeadlineSeconds": 1,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": "x",
                        "command": ["python", "-c", "import time; time.sleep(600)"],
                    }
                ],
            },
        }
    )
    wait_for(lambda: _phase(kubectl, "deadline") == "Running", 20, "pod deadline to run")
    pid = int(_pod(kubectl, "deadline")["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    wait_for(lambda: _phase(kubectl, "deadline") == "Failed", 10, "the deadline to fail the pod")
    assert _pod(kubectl, "deadline")["status"]["reason"] == "DeadlineExceeded"
    wait_for(lambda: not process_alive(pid), 5, "the container to be stopped")
    cs = wait_for(
        lambda: (
            "terminated" in _pod(kubectl, "deadline")["status"]["containerStatuses"][0]["state"]
            and _pod(kubectl, "deadline")["status"]["containerStatuses"][0]
        ),
        5,
        "the container's final state",
    )
    assert cs["restartCount"] == 0


def test_an_unknown_executable_is_a_start_error_that_is_retried(kubectl: Kubectl) -> None:
    kubectl("run", "nosuch", "--image=x", "--restart=OnFailure", "--", "kelastic-no-such-binary", "--flag")

    def retried() -> dict[str, Any] | None:
        (cs,) = _pod(kubectl, "nosuch")["status"].get("containerStatuses") or [{}]
        return cs if cs.get("restartCount", 0) >= 2 else None

    cs = wait_for(retried, 20, "the failed start to be retried with back-off")
    last = cs["lastState"]["terminated"]
    assert last["reason"] == "StartError" and last["exitCode"] == 128
    assert "kelastic-no-such-binary" in last["message"]
    kubectl("delete", "pod", "nosuch", "--grace-period=0", "--force")


def test_empty_dir_is_per_pod_behind_a_headless_service(kubectl: Kubectl) -> None:
    script = (
        "import os, pathlib, time\n"
        "d = pathlib.Path(os.environ['KELASTIC_VOLUME_SCRATCH'])\n"
        "(d / 'mine').write_text(os.environ['HOSTNAME'])\n"
        "print(sorted(p.name for p in d.iterdir()), d.name, flush=True)\n"
        "time.sleep(600)\n"
    )

    def pod(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "peers"}},
            "spec": {
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [
                    {
                        "name": "main",
                        "image": "x",
                        "command": ["python", "-c", script],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                    }
                ],
            },
        }

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "peers"},
        "spec": {"clusterIP": "None", "selector": {"app": "peers"}, "ports": [{"port": 7000}]},
    }
    kubectl.apply_object(
        {"apiVersion": "v1", "kind": "List", "items": [service, pod("peer-a"), pod("peer-b")]}
    )
    for name in ("peer-a", "peer-b"):
        wait_for(lambda n=name: kubectl("logs", n, check=False).strip(), 20, f"{name} to report its volume")
        # Each pod sees only its own file: the emptyDir is per pod.
        assert kubectl("logs", name).split("]")[0] == "['mine'"
    assert kubectl.json("service", "peers")["spec"]["clusterIP"] == "None"
    kubectl("delete", "pods", "-l", "app=peers", "--grace-period=0", "--force")
    kubectl("delete", "service", "peers")


def test_a_deleted_pods_logs_and_volumes_are_removed(cluster: LocalCluster, kubectl: Kubectl) -> None:
    cluster.kubelet_config.log_retention = 0.2
    try:
        kubectl("run", "brief", "--image=x", "--restart=Never", "--", "python", "-c", "print('bye')")
        wait_for(lambda: _phase(kubectl, "brief") == "Succeeded", 20, "pod brief to succeed")
        uid = _pod(kubectl, "brief")["metadata"]["uid"]
        pod_dir = pod_log_dir(cluster.data_dir, "default", "brief", uid)
        assert (pod_dir / "brief" / "0.log").read_text() == "bye\n"
        kubectl("delete", "pod", "brief")
        wait_for(lambda: not pod_dir.exists(), 10, "the pod's directory to be removed")
    finally:
        cluster.kubelet_config.log_retention = 60.0


def test_host_network_pods_get_the_node_address(kubectl: Kubectl) -> None:
    kubectl.apply_object(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "hostnet"},
            "spec": {
                "hostNetwork": True,
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "x", "command": ["true"]}],
            },
        }
    )
    wait_for(lambda: _phase(kubectl, "hostnet") == "Succeeded", 20, "pod hostnet to succeed")
    assert _pod(kubectl, "hostnet")["status"]["podIP"] == "127.0.0.1"


ENV_REPORT = (
    "import json, os, sys\n"
    "path = os.environ.get('KUBECONFIG', '')\n"
    "users = json.load(open(path)).get('users') if path and os.path.isfile(path) else None\n"
    "print(json.dumps({'kubeconfig': path, 'users': users,"
    " 'kubernetes': sorted(k for k in os.environ if k.startswith('KUBERNETES_'))}))\n"
)


def test_a_pod_gets_no_credentials_of_the_kelastic_process(tmp_path: Path) -> None:
    # kelastic local started with an admin kubeconfig and inside some cluster: none of it reaches pods.
    parent = tmp_path / "admin.kubeconfig"
    parent.write_text('{"users": [{"name": "admin", "user": {"token": "secret"}}]}')
    local = LocalCluster(tmp_path / "data", workdir=tmp_path)
    local.kubelet_config.base_env = {
        **os.environ,
        "KUBECONFIG": str(parent),
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    with local:
        kubectl = Kubectl(local.kubeconfig)
        for name, env in (("bare", []), ("own", [{"name": "KUBECONFIG", "value": "/etc/own.kubeconfig"}])):
            kubectl.apply_object(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {"name": "c", "image": "x", "command": ["python", "-c", ENV_REPORT], "env": env}
                        ],
                    },
                }
            )
        for name in ("bare", "own"):
            wait_for(lambda n=name: _phase(kubectl, n) == "Succeeded", 30, f"pod {name} to succeed")
        bare = json.loads(kubectl("logs", "bare"))
        own = json.loads(kubectl("logs", "own"))
    assert bare["kubeconfig"] != str(parent) and bare["users"] == [], (
        bare
    )  # empty: no ~/.kube/config fallback
    assert bare["kubernetes"] == [], bare
    assert own["kubeconfig"] == "/etc/own.kubeconfig", own  # what the spec gives is kept


def test_a_volume_mounted_above_the_interpreter_does_not_move_it(kubectl: Kubectl) -> None:
    """The interpreter that plays the image is a host path: an emptyDir mounted above it (the
    chart's emptyDir at /tmp and a venv under /tmp) must not be taken for its directory, while
    the container's own paths under the mount still are."""
    import sys

    top = "/" + Path(sys.executable).parts[1]  # e.g. /tmp for a venv in /tmp, /usr, /root
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "under-a-volume"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11",
                    "command": ["python", "-c", "import sys; print(sys.argv[1])", f"{top}/x"],
                    "volumeMounts": [{"name": "scratch", "mountPath": top}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(pod))
    wait_for(lambda: _phase(kubectl, "under-a-volume") in ("Succeeded", "Failed"), 30, "the pod to finish")
    assert _phase(kubectl, "under-a-volume") == "Succeeded", _pod(kubectl, "under-a-volume")["status"]
    printed = kubectl("logs", "under-a-volume").strip()
    assert printed.endswith("/volumes/scratch/x") and printed != f"{top}/x"  # the argument moved

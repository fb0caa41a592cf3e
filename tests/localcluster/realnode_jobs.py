"""ElasticJobs on the real-node lane, run by the operator the chart installs: the operator
installed in-cluster, a job's progress watched (printed as it changes), and, when a wait
fails, what to look at (the operator pod's log, the namespace's events, the workers' last
lines). Importing this module does not start anything."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kelastic.agent import contract

from .realnode_harness import Lane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kelastic"
OPERATOR_NS, RELEASE = "kelastic-system", "kelastic"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"

#: The training program of the plain PyTorch image's job (``/app/balloon.py``, from a
#: ConfigMap beside examples/train.py): train.py, with a thread that balloons the rank's
#: memory once ``/tmp/kelastic-oom`` appears in its container (``kubectl exec ... touch``),
#: until the kernel kills it.
BALLOON = """
import os, runpy, sys, threading, time
def balloon():
    while not os.path.exists("/tmp/kelastic-oom"):
        time.sleep(0.2)
    os.unlink("/tmp/kelastic-oom")  # once: the rank restarted in its place trains on
    print("allocating until the memory limit is hit", flush=True)
    hog = []
    while True:
        hog.append(b"x" * (64 << 20))  # bytes written, so every page is charged
threading.Thread(target=balloon, daemon=True).start()
sys.argv = ["/app/train.py", *sys.argv[1:]]
runpy.run_path("/app/train.py", run_name="__main__")
"""

#: Connects to every ``[ip, port]`` of its JSON argument at once; prints which accepted.
CONNECT = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def connect(target):
    try:
        socket.create_connection((target[0], target[1]), timeout=3).close()
        return True
    except OSError:
        return False
targets = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(list(pool.map(connect, targets))))
"""


def install_operator(lane: Lane, watch: str, node: str) -> str:
    """The chart, with the real Helm, into :data:`OPERATOR_NS`, watching ``watch``: the
    operator runs as a pod of the kelastic image under the chart's service account and
    RBAC, with the jobs' NetworkPolicies on (the chart's default), on ``node`` (a node that
    is killed takes its pods with it for minutes). Returns its Deployment's name."""
    from kelastic.localcluster.cli.chart import install_chart

    started = time.monotonic()
    release = install_chart(
        lane.control_plane.admin_kubeconfig, CHART, OPERATOR_NS, {"nodeSelector": {"kubernetes.io/hostname": node}},
        release=RELEASE, watch_namespaces=[watch], wait=240, progress=print,
    )  # fmt: skip
    assert release.method == "helm", f"the chart was {release.method}, not installed by Helm's own action"
    print(f"chart installed, operator available after {time.monotonic() - started:.1f} s")
    return str(release.deployment)


def plain_pytorch_job(name: str, namespace: str, image: str, replicas: int, steps: int) -> dict[str, Any]:
    """An ElasticJob of ``replicas`` workers of the plain PyTorch ``image`` (the agent
    injected), restricted-ready, one per node while the nodes are Ready, training
    examples/train.py for ``steps``.

    A rank killed at the container's memory limit (1536Mi) is restarted in place by its
    agent, as after a crash (``maxRestarts: 3``)."""
    worker = {contract.LABEL_JOB_NAME: name, contract.LABEL_ROLE: contract.ROLE_WORKER}
    container = {
        "name": "trainer",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python", "/app/balloon.py"],
        "args": [f"--steps={steps}", "--step-delay=0.1", "--checkpoint-every=10", "--log-every=50"],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1536Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "app", "mountPath": "/app", "readOnly": True}],
    }
    pod_spec = {
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 5,
        # Honor: a node tainted NotReady is no domain to spread over, so that a dead node's
        # replacement worker may join its peer on the node left (with the default, Ignore, it
        # would wait for the dead node: one node holding 2 and the dead one 0 is a skew of 2).
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": worker}, "nodeTaintsPolicy": "Honor",
        }],
        "containers": [container],
        "volumes": [{"name": "app", "configMap": {"name": f"{name}-app"}}],
    }  # fmt: skip
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": replicas,
            "nprocPerNode": 1,
            "maxRestarts": 3,
            "replicaSpecs": {
                "Worker": {"replicas": replicas, "restartPolicy": "ExitCode", "template": {"spec": pod_spec}}
            },
        },
    }


def app_config_map(name: str, namespace: str) -> dict[str, Any]:
    """The ConfigMap :func:`plain_pytorch_job` mounts at /app: examples/train.py and :data:`BALLOON`."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-app", "namespace": namespace},
        "data": {"train.py": (REPO / "examples" / "train.py").read_text(), "balloon.py": BALLOON},
    }


def worker_pods(lane: Lane, namespace: str, job: str) -> list[dict[str, Any]]:
    selector = f"{contract.LABEL_JOB_NAME}={job},{contract.LABEL_ROLE}={contract.ROLE_WORKER}"
    items = json.loads(lane.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]
    return list(items)


def events(lane: Lane, namespace: str, last: int = 30) -> list[str]:
    out = lane.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)
    return out.splitlines()[-last:]


def diagnostics(lane: Lane, namespace: str, job: str) -> str:
    """What to look at when a job did not do what it should: the operator pod's log, the
    job's status, the namespace's events, the workers' last lines."""
    operator = lane.kubectl("logs", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR, "--tail=40", check=False)
    status = lane.kubectl("get", "ej", "-n", namespace, job, "-o", "jsonpath={.status}", check=False)
    workers = lane.kubectl(
        "logs", "-n", namespace, "-l", f"{contract.LABEL_JOB_NAME}={job},{contract.LABEL_ROLE}=worker",
        "-c", "trainer", "--prefix", "--tail=15", check=False,
    )  # fmt: skip
    return (
        f"job {namespace}/{job} status: {status}\noperator pod's log:\n{operator}\n"
        f"events in {namespace}:\n"
        + "\n".join(events(lane, namespace))
        + f"\nthe workers' last lines:\n{workers}"
    )


@dataclass
class JobWatch:
    """Polls one ElasticJob, printing its phase, figures and pods whenever they change."""

    lane: Lane
    namespace: str
    name: str
    #: Every node a worker pod of the job was seen on.
    nodes: set[str] = field(default_factory=set)
    _seen: str = ""

    def status(self) -> dict[str, Any]:
        out = self.lane.kubectl("get", "ej", "-n", self.namespace, self.name, "-o", "json")
        return dict(json.loads(out).get("status") or {})

    def until(
        self, what: str, done: Callable[[dict[str, Any]], bool], timeout: float = 300
    ) -> dict[str, Any]:
        """Wait until ``done(status)``; the status. Fails with :func:`diagnostics` after
        ``timeout`` seconds, or at once when the job ends otherwise."""
        started = time.monotonic()
        status: dict[str, Any] = {}
        while time.monotonic() - started < timeout:
            status = self.status()
            if done(status):
                print(f"{what}: after {time.monotonic() - started:.1f} s")
                return status
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            self._print(status, time.monotonic() - started, what)
            time.sleep(1)
        raise AssertionError(
            f"waited {time.monotonic() - started:.0f} s for {what}; the job is {status.get('phase')}.\n"
            + diagnostics(self.lane, self.namespace, self.name)
        )

    def _print(self, status: dict[str, Any], waited: float, what: str) -> None:
        pods = worker_pods(self.lane, self.namespace, self.name)
        self.nodes.update(p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName"))
        table = ", ".join(
            f"{p['metadata']['name']}@{p['spec'].get('nodeName')}:{p['status'].get('phase')}"
            + (" (terminating)" if p["metadata"].get("deletionTimestamp") else "")
            for p in pods
        )
        now = (
            f"{status.get('phase')} world {status.get('worldSize')} progress {status.get('progress')} "
            f"re-forms {status.get('restarts')}; {table}"
        )
        if now != self._seen:
            print(f"[{waited:5.0f} s, waiting for {what}] {now}")
            self._seen = now


def step_of(status: dict[str, Any]) -> int:
    """The step of ``status.progress`` (``"120/500 (24%)"``), 0 before any."""
    text = str(status.get("progress") or "").replace("step ", "")
    head = text.split("/")[0].strip()
    return int(head) if head.isdigit() else 0


def elastic_job(
    name: str,
    namespace: str,
    image: str,
    replicas: int,
    steps: int,
    *,
    max_replicas: int = 0,
    standby: int = 0,
    queue: str = "",
) -> dict[str, Any]:
    """:func:`plain_pytorch_job`, with room to grow to ``max_replicas``, ``standby`` hot
    standbys beside the members, and queued in Kueue's LocalQueue ``queue`` when given."""
    job = plain_pytorch_job(name, namespace, image, replicas, steps)
    job["spec"]["maxReplicas"] = max(max_replicas, replicas)
    if standby:
        job["spec"]["standbyReplicas"] = standby
    if queue:
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue}
    return job


def trainer_logs(lane: Lane, namespace: str, job: str, tail: int = 400) -> dict[str, str]:
    """Each live worker pod's ``trainer`` log (the agent's lines and its ranks'), by pod name."""
    return {
        pod["metadata"]["name"]: lane.kubectl(
            "logs", "-n", namespace, pod["metadata"]["name"], "-c", "trainer", f"--tail={tail}", check=False
        )
        for pod in worker_pods(lane, namespace, job)
        if not pod["metadata"].get("deletionTimestamp")
    }


#: Rank 0 of examples/train.py, when its group (re)starts from a checkpoint.
RESUMED = re.compile(r"\[train\] world size (\d+), restart (\d+): resumed from the (.+?) at step (\d+)")


@dataclass(frozen=True)
class Resumed:
    """One ``[train] ... resumed from ... at step S`` line of rank 0."""

    world_size: int
    restart: int
    source: str
    step: int


def resumes(logs: dict[str, str]) -> list[Resumed]:
    """Every resume rank 0 printed in ``logs`` (see :func:`trainer_logs`)."""
    return [
        Resumed(int(m[1]), int(m[2]), m[3], int(m[4])) for log in logs.values() for m in RESUMED.finditer(log)
    ]


def event_messages(lane: Lane, namespace: str, job: str, reason: str) -> list[str]:
    """The messages of the Events of ``reason`` about ElasticJob ``job``, oldest first."""
    out = lane.kubectl(
        "get", "events", "-n", namespace, "--field-selector",
        f"involvedObject.kind=ElasticJob,involvedObject.name={job},reason={reason}",
        "--sort-by=.lastTimestamp", "-o", "json", check=False,
    )  # fmt: skip
    return [str(e.get("message")) for e in (json.loads(out).get("items") if out else None) or []]


def kueue_queues(namespace: str, local_queue: str, cpu: str, memory: str) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue of ``cpu`` and ``memory`` and a LocalQueue in
    ``namespace`` that feeds it, as examples/kueue.yaml makes them (memory covered too: the
    plain PyTorch job's workers ask for it, and Kueue admits no request it does not cover)."""
    flavor = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "default-flavor"},
    }
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": "cluster-queue"},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [{
                "coveredResources": ["cpu", "memory"],
                "flavors": [{"name": "default-flavor", "resources": [
                    {"name": "cpu", "nominalQuota": cpu}, {"name": "memory", "nominalQuota": memory},
                ]}],
            }],
        },
    }  # fmt: skip
    local = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": local_queue, "namespace": namespace},
        "spec": {"clusterQueue": "cluster-queue"},
    }
    return [flavor, cluster_queue, local]


def reinstall_operator(lane: Lane, watch: str, node: str, *, kueue: bool) -> str:
    """The chart of :func:`install_operator` upgraded in place with ``kueue.enabled`` set to
    ``kueue`` (the operator's ``--kueue`` and its Kueue RBAC), as ``kelastic local up --kueue``
    installs it; its Deployment's name, once the new operator is available."""
    from kelastic.localcluster.cli.chart import install_chart

    started = time.monotonic()
    release = install_chart(
        lane.control_plane.admin_kubeconfig, CHART, OPERATOR_NS,
        {"nodeSelector": {"kubernetes.io/hostname": node}, "kueue": {"enabled": kueue}},
        release=RELEASE, watch_namespaces=[watch], wait=240, progress=print,
    )  # fmt: skip
    deployment = str(release.deployment)
    lane.kubectl(
        "rollout", "status", "-n", OPERATOR_NS, f"deploy/{deployment}", "--timeout=240s", timeout=260
    )
    print(
        f"chart upgraded (kueue.enabled={kueue}), operator available after {time.monotonic() - started:.1f} s"
    )
    return deployment

"""ElasticJobs queued by the real Kueue, on the real control plane (v1.37 lane).

Real processes throughout: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
(``make control-plane``), Kueue's manager (``make kueue``) with its CRDs and webhooks, the
kelastic operator with ``--kueue``, the process kubelet, kelastic-agent and torch workers
(gloo on CPU). A ClusterQueue of 1.5 CPUs; each worker asks for 500m, so three workers fit.

Skipped, saying how to enable it, where either build is missing; the emulator lane has no
Kueue (Kueue's manager needs kube-apiserver).
"""

from __future__ import annotations

import json
import runpy
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.testing import Kubectl, wait_for

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("lane_harness.py"))))

# Scenarios of several stages, each with its own bounded wait; the backstop covers their sum
# on a loaded two-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUEUE = "team"
FIGURES: dict[str, float] = {}


@pytest.fixture(scope="module")
def kueue_dir() -> Path:
    found: Path | None = harness.kueue_build()
    if found is None:
        pytest.skip(
            "no Kueue build: run `make kueue` (builds sigs.k8s.io/kueue v0.17.0 from the Go module proxy into "
            "~/.cache/kelastic/kueue/<version>) or set KELASTIC_KUEUE to such a directory; this lane also needs "
            "`make control-plane`"
        )
    return found


@pytest.fixture(scope="module")
def lane(
    control_plane_bin: Path, kueue_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, Kubectl]]:
    with harness.real_lane(control_plane_bin, tmp_path_factory.mktemp("kueue-lane"), kueue=kueue_dir) as real:
        real.kubectl.apply(QUOTA)
        try:
            yield real.cluster, real.kubectl
        finally:
            for name, value in FIGURES.items():
                print(f"kueue lane: {name}: {value:.1f}")


QUOTA = f"""
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: default
spec:
  nodeLabels:
    kubernetes.io/hostname: kelastic-local
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata:
  name: cq
spec:
  namespaceSelector: {{}}
  preemption:
    withinClusterQueue: LowerPriority
  resourceGroups:
  - coveredResources: [cpu]
    flavors:
    - name: default
      resources:
      - name: cpu
        nominalQuota: 1500m
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata:
  name: {QUEUE}
  namespace: default
spec:
  clusterQueue: cq
"""


def elastic_job(name: str, minimum: int, replicas: int, steps: int, delay: float = 0.2) -> dict[str, Any]:
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default", "labels": {"kueue.x-k8s.io/queue-name": QUEUE}},
        "spec": {
            "minReplicas": minimum,
            "maxReplicas": 4,
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "kelastic:0.1.0",
                                    "command": ["python", "examples/train.py"],
                                    "args": [
                                        f"--steps={steps}",
                                        f"--step-delay={delay}",
                                        "--checkpoint-every=1",
                                        "--log-every=5",
                                    ],
                                    "resources": {"requests": {"cpu": "500m"}},
                                }
                            ]
                        }
                    },
                }
            },
        },
    }


def get_job(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("elasticjob", name)


def status(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return get_job(kubectl, name).get("status") or {}


def step_of(st: dict[str, Any]) -> int:
    text = str(st.get("progress") or "")
    head = text.split("/")[0].strip()
    return int(head) if head.isdigit() else 0


def worker_pods(kubectl: Kubectl, job: str) -> list[dict[str, Any]]:
    pods = kubectl.json("pods", "-l", f"kelastic.dev/job-name={job},kelastic.dev/role=worker")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def diagnosis(cluster: LocalCluster, kubectl: Kubectl, jobs: tuple[str, ...]) -> str:
    """What a failed wait needs to be understood: the Workloads Kueue decided on, the jobs'
    pods and status, and the operator's log lines of those jobs."""
    lines = ["Workloads:"]
    for w in kubectl.json("workloads.kueue.x-k8s.io")["items"]:
        st = w.get("status") or {}
        conds = [f"{c['type']}={c['status']}({c.get('reason')})" for c in st.get("conditions", [])]
        counts = [a.get("count") for a in (st.get("admission") or {}).get("podSetAssignments", [])]
        lines.append(
            f"  {w['metadata']['name']} created {w['metadata']['creationTimestamp']} admitted {counts} {conds}"
        )
    for job in jobs:
        pods = kubectl.json("pods", "-l", f"kelastic.dev/job-name={job}")["items"]
        lines.append(f"{job}: status {json.dumps(status(kubectl, job))}")
        lines += [f"  pod {p['metadata']['name']}: {(p.get('status') or {}).get('phase')}" for p in pods]
    log = cluster.data_dir.parent / "operator.log"
    if log.is_file():
        mine = [ln for ln in log.read_text(errors="replace").splitlines() if any(f"/{j}" in ln for j in jobs)]
        lines += ["operator log (these jobs, last 40 lines):", *mine[-40:]]
    return "\n".join(lines)


def test_a_queued_job_waits_for_quota_and_grows_when_it_frees(lane: tuple[LocalCluster, Kubectl]) -> None:
    """First waits for second; partial admission at minReplicas; growth when quota frees."""
    cluster, kubectl = lane
    kubectl.apply_object(elastic_job("first", 2, 2, steps=40))
    wait_for(lambda: status(kubectl, "first").get("phase") == "Running" or None, 240, "first to run")
    # second asks for 2..2: 500m are left of 1500m, so Kueue admits nothing yet.
    kubectl.apply_object(elastic_job("second", 2, 2, steps=30))
    queued = wait_for(
        lambda: (
            (s := status(kubectl, "second")).get("phase") == "Queued"
            # Kueue's own reason, not the operator's "waiting for Kueue" before Kueue looked.
            and "insufficient" in str((s.get("queue") or {}).get("message"))
            and s
        ),
        60,
        "second to be Queued with Kueue's reason",
    )
    assert "insufficient" in queued["queue"]["message"], queued
    assert worker_pods(kubectl, "second") == []
    table = kubectl("get", "elasticjobs")
    assert "team: 0 admitted, 2 pending" in table, table
    # Kueue queues in order of creation time, which the API server keeps to the second: third's
    # Workloads (its base and its growth) are made in a later second than second's, or Kueue may
    # take third's growth first when first's quota frees.
    time.sleep(1.05 - time.time() % 1.0)
    # third asks for 1..3: partial admission at its minimum (one worker of 500m).
    # Long enough to be running still when the group reaches 3 however slow the stages before
    # are (the test deletes it then).
    kubectl.apply_object(elastic_job("third", 1, 3, steps=2000, delay=0.1))
    wait_for(
        lambda: (status(kubectl, "third").get("queue") or {}).get("admitted") == 1 or None,
        60,
        "third to be admitted with 1 worker",
    )
    (single,) = worker_pods(kubectl, "third")
    # Placed as its ResourceFlavor says: the flavor's node label is the pod's node selector.
    assert single["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "kelastic-local"}, single["spec"]
    # first ends: its quota is released at once, and second (queued first) starts.
    wait_for(lambda: status(kubectl, "first").get("phase") == "Succeeded" or None, 300, "first to succeed")
    freed = time.monotonic()
    try:
        wait_for(
            lambda: step_of(status(kubectl, "second")) >= 1 or None, 240, "second's first step", interval=0.2
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnosis(cluster, kubectl, ('second', 'third'))}") from None
    FIGURES["quota freed -> waiting job's first step (s)"] = time.monotonic() - freed
    # second ends: third grows to 3 through its growth Workload.
    wait_for(lambda: status(kubectl, "second").get("phase") == "Succeeded" or None, 300, "second to succeed")
    wait_for(
        lambda: (status(kubectl, "third").get("queue") or {}).get("admitted") == 3 or None,
        120,
        "third to grow to 3 admitted workers",
    )
    wait_for(lambda: status(kubectl, "third").get("worldSize") == 3 or None, 240, "third's group at 3")
    final = status(kubectl, "third")
    assert not final.get("backoffCount"), final
    workloads = kubectl.json("workloads.kueue.x-k8s.io")["items"]
    finished = [
        w["metadata"]["name"]
        for w in workloads
        if any(c["type"] == "Finished" and c["status"] == "True" for c in w["status"].get("conditions", []))
    ]
    assert any(n.startswith("first-") for n in finished) and any(n.startswith("second-") for n in finished)
    kubectl("delete", "elasticjob", "third", "--wait=false")
    print(json.dumps({"third": final.get("queue")}))


URGENT = """
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata:
  name: urgent
value: 1000
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: ckpt
  namespace: default
spec:
  accessModes: [ReadWriteMany]
  resources:
    requests:
      storage: 1Gi
"""


def with_checkpoint_files(job: dict[str, Any]) -> dict[str, Any]:
    """The job's script also writes checkpoint files to a claim, which outlive its pods."""
    pod = job["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    container["args"] += ["--checkpoint-dir=/ckpt/{run_id}", "--log-every=1"]
    container["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    pod["volumes"] = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    return job


def urgent(job: dict[str, Any]) -> dict[str, Any]:
    job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = "urgent"
    return job


def history(cluster: LocalCluster) -> list[dict[str, Any]]:
    """The job's training history (examples/train.py writes it to the claim, rank 0 only)."""
    files = sorted((cluster.data_dir / "claims").rglob("history.jsonl"))
    assert files, f"no history.jsonl under {cluster.data_dir / 'claims'}"
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def restarts(events: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """Each restart after the first start: (steps redone, step resumed from, source).

    Steps redone are the checkpoints recorded past the step the group resumed from (every step
    is a checkpoint here), i.e. the steps lost beyond the one in flight."""
    out: list[tuple[int, int, str]] = []
    newest = 0
    started = False
    for event in events:
        if event["event"] == "checkpoint":
            newest = max(newest, int(event["step"]))
        elif event["event"] == "start":
            if started:
                out.append(
                    (max(0, newest - int(event["step"])), int(event["step"]), str(event.get("source")))
                )
            started = True
    return out


def test_preemption_shrinks_then_suspends_and_resumes_without_a_failure(
    lane: tuple[LocalCluster, Kubectl],
) -> None:
    _, kubectl = lane
    kubectl.apply(URGENT)
    # hold takes 2 workers, so low is admitted at its minimum (1) and grows to 3 when hold ends.
    kubectl.apply_object(elastic_job("hold", 2, 2, steps=20))
    wait_for(lambda: status(kubectl, "hold").get("phase") == "Running" or None, 240, "hold to run")
    kubectl.apply_object(with_checkpoint_files(elastic_job("low", 1, 3, steps=3000, delay=0.1)))
    wait_for(lambda: status(kubectl, "hold").get("phase") == "Succeeded" or None, 300, "hold to succeed")
    wait_for(lambda: status(kubectl, "low").get("worldSize") == 3 or None, 300, "low to grow to 3")
    # An urgent job of 2 workers: Kueue preempts low's growth Workload (2 workers), not its base.
    kubectl.apply_object(urgent(elastic_job("high", 2, 2, steps=40)))
    preempted = time.monotonic()
    wait_for(lambda: status(kubectl, "low").get("worldSize") == 1 or None, 120, "low to shrink to 1")
    before = step_of(status(kubectl, "low"))
    wait_for(lambda: step_of(status(kubectl, "low")) > before or None, 120, "low's shrunk group to step")
    FIGURES["preemption -> shrunk group's first step (s)"] = time.monotonic() - preempted
    low = status(kubectl, "low")
    assert low.get("phase") in ("Running", "Scaling"), low
    assert not low.get("backoffCount") and low["queue"]["admitted"] == 1, low
    cluster = lane[0]
    shrink = restarts(history(cluster))
    assert shrink, history(cluster)
    FIGURES["steps lost at the shrink"] = shrink[-1][0]
    wait_for(lambda: status(kubectl, "high").get("phase") == "Succeeded" or None, 300, "high to succeed")
    wait_for(
        lambda: (status(kubectl, "low").get("queue") or {}).get("admitted") == 3 or None,
        120,
        "low to grow back",
    )
    # An urgent job of 3 workers takes the whole queue: low is suspended (Queued), not failed.
    kubectl.apply_object(urgent(elastic_job("all", 3, 3, steps=30)))
    suspended = wait_for(
        lambda: (s := status(kubectl, "low")).get("phase") == "Queued" and s, 120, "low to be suspended"
    )
    last = step_of(suspended)  # the status's progress lags: a lower bound of the step reached
    wait_for(lambda: worker_pods(kubectl, "low") == [] or None, 120, "low's pods to go")
    wait_for(lambda: status(kubectl, "all").get("phase") == "Succeeded" or None, 300, "all to succeed")
    resumed = time.monotonic()
    before = len(restarts(history(cluster)))
    wait_for(lambda: len(restarts(history(cluster))) > before or None, 300, "low to resume")
    wait_for(lambda: status(kubectl, "low").get("phase") == "Running" or None, 300, "low to run again")
    FIGURES["quota freed -> suspended job's first step (s)"] = time.monotonic() - resumed
    lost, start, source = restarts(history(cluster))[-1]
    assert source == "checkpoint file" and start >= last - 1, (lost, start, source, last)
    FIGURES["steps lost at the suspension"] = lost
    final = status(kubectl, "low")
    assert not final.get("backoffCount") and final.get("phase") != "Failed", final
    kubectl("delete", "elasticjob", "low", "--wait=false")

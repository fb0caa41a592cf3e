"""Gang scheduling by the real kube-scheduler, on the real control plane (v1.37 lane).

Real processes throughout: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
with the ``GenericWorkload`` feature gate on (``kelastic local`` turns it on where the
binaries know it as beta), the kelastic operator (which finds ``scheduling.k8s.io/v1beta1``
PodGroups by discovery), the process kubelet with a node of 2 CPUs, kelastic-agent and torch
workers (gloo on CPU).

* A job whose ``minReplicas`` workers cannot all be placed binds none of them, and holds
  nothing: a pod that needs almost the whole node is placed beside it.
* A job whose minimum fits starts at once, and gains its other workers as room appears.
* With Kueue (``make kueue``) and its ``waitForPodsReady``: a queued job admitted on quota
  that the node cannot honour binds nothing (the gang), and after the timeout Kueue evicts
  it, so the quota goes to a job that fits (all-or-nothing admission). The job is requeued,
  never failed.

Skipped, saying how to enable it, where the control plane serves no such PodGroups (v1.20,
or a build without the gate), or, for the Kueue part, where Kueue is not built.
"""

from __future__ import annotations

import runpy
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.localcluster.testing import Kubectl, wait_for

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("lane_harness.py"))))

# Scenarios of several stages, each with its own bounded wait; the backstop covers their sum
# on a loaded two-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODE_CPUS = "2"
QUEUE = "gang-queue"
#: Kueue evicts an admitted Workload whose pods are not all ready after this long (s).
PODS_READY_TIMEOUT = 20.0
FIGURES: dict[str, float] = {}


@pytest.fixture(scope="module")
def lane(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with harness.real_lane(
        control_plane_bin,
        tmp_path_factory.mktemp("gang-lane"),
        kueue=harness.kueue_build(),
        wait_for_pods_ready=PODS_READY_TIMEOUT,
        kueue_optional=True,
        cpus=NODE_CPUS,
    ) as real:
        served = real.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").split()
        if "podgroups.scheduling.k8s.io" not in served:
            pytest.skip(
                f"the control plane in {control_plane_bin} ({real.cluster.control_plane.version}) serves no "
                "scheduling.k8s.io/v1beta1 PodGroups: kube-scheduler's gang scheduling needs Kubernetes 1.37 "
                "or newer (the GenericWorkload gate, beta); run `make control-plane`"
            )
        if real.kueue is not None:
            real.kubectl.apply(QUOTA)
        try:
            yield real
        finally:
            for name, value in FIGURES.items():
                print(f"gang lane: {name}: {value:.1f}")


# Kueue's quota is twice what the node has: Kueue admits what the scheduler cannot place.
QUOTA = f"""
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: gang-flavor
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata:
  name: gang-cq
spec:
  namespaceSelector: {{}}
  resourceGroups:
  - coveredResources: [cpu]
    flavors:
    - name: gang-flavor
      resources:
      - name: cpu
        nominalQuota: "4"
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata:
  name: {QUEUE}
  namespace: default
spec:
  clusterQueue: gang-cq
"""


def elastic_job(
    name: str, minimum: int, replicas: int, cpu: str, steps: int, queued: bool = False
) -> dict[str, Any]:
    labels = {"kueue.x-k8s.io/queue-name": QUEUE} if queued else {}
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {
            "minReplicas": minimum,
            "maxReplicas": replicas,
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
                                    "args": [f"--steps={steps}", "--step-delay=0.1", "--log-every=5"],
                                    "resources": {"requests": {"cpu": cpu}},
                                }
                            ]
                        }
                    },
                }
            },
        },
    }


def plain_pod(name: str, cpu: str) -> dict[str, Any]:
    """A pod outside any gang that asks for ``cpu``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "sleep",
                    "image": "kelastic:0.1.0",
                    "command": ["python", "-c", "import time; time.sleep(3600)"],
                    "resources": {"requests": {"cpu": cpu}},
                }
            ],
        },
    }


def status(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("elasticjob", name).get("status") or {}


def step_of(st: dict[str, Any]) -> int:
    head = str(st.get("progress") or "").split("/")[0].strip()
    return int(head) if head.isdigit() else 0


def workers(kubectl: Kubectl, job: str) -> list[dict[str, Any]]:
    pods = kubectl.json("pods", "-l", f"kelastic.dev/job-name={job},kelastic.dev/role=worker")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def bound(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")]


def pod_group(kubectl: Kubectl, job: str) -> dict[str, Any]:
    return kubectl.json("podgroups.scheduling.k8s.io", job)


def group_condition(group: dict[str, Any]) -> dict[str, Any] | None:
    conditions = (group.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "PodGroupInitiallyScheduled"), None)


def delete(kubectl: Kubectl, *what: str) -> None:
    kubectl("delete", *what, "--wait=false", "--grace-period=0", "--ignore-not-found")


def test_a_gang_that_cannot_fit_binds_nothing_and_holds_nothing(lane: Any) -> None:
    kubectl = lane.kubectl
    # 3 x 700m do not fit in 2 CPUs (the store takes 50m); 2 of them would, one by one.
    kubectl.apply_object(elastic_job("wide", 3, 3, "700m", steps=200))
    group = wait_for(
        lambda: (
            (g := pod_group(kubectl, "wide")) and (c := group_condition(g)) and c["status"] == "False" and g
        ),
        120,
        "kube-scheduler to find wide's gang unschedulable",
    )
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 3, group
    assert group["metadata"]["ownerReferences"][0]["kind"] == "ElasticJob", group
    assert "minCount (3)" in group_condition(group)["message"], group  # type: ignore[index]
    pods = wait_for(lambda: len(p := workers(kubectl, "wide")) == 3 and p, 60, "wide's 3 workers")
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "wide"} for p in pods), pods
    # Several scheduling attempts later, still none is bound.
    for _ in range(10):
        assert bound(workers(kubectl, "wide")) == [], workers(kubectl, "wide")
        time.sleep(0.5)
    # It holds nothing: a pod that needs nearly the whole node is placed at once.
    kubectl.apply_object(plain_pod("probe", "1900m"))
    wait_for(lambda: kubectl.json("pod", "probe")["spec"].get("nodeName"), 60, "the probe pod to be placed")
    assert bound(workers(kubectl, "wide")) == []
    wide = status(kubectl, "wide")
    assert wide.get("phase") != "Failed" and not wide.get("backoffCount"), wide
    delete(kubectl, "pod", "probe")
    delete(kubectl, "elasticjob", "wide")
    wait_for(lambda: workers(kubectl, "wide") == [] or None, 60, "wide's workers to go")


def test_a_gang_whose_minimum_fits_starts_at_once_and_grows_as_room_appears(lane: Any) -> None:
    kubectl = lane.kubectl
    wait_for(lambda: not kubectl.json("pods")["items"] or None, 120, "the node to be empty")
    # 700m held by another pod: 2 x 600m fit beside it, the third only once it is gone.
    kubectl.apply_object(plain_pod("hog", "700m"))
    wait_for(lambda: kubectl.json("pod", "hog")["spec"].get("nodeName"), 60, "the hog to be placed")
    created = time.monotonic()
    kubectl.apply_object(elastic_job("grow", 2, 3, "600m", steps=1500))
    wait_for(lambda: step_of(status(kubectl, "grow")) >= 1 or None, 240, "grow's first step", interval=0.2)
    FIGURES["job created -> first step at its minimum of 2 (s)"] = time.monotonic() - created
    first = status(kubectl, "grow")
    assert first.get("worldSize") == 2, first
    pods = workers(kubectl, "grow")
    assert len(pods) == 3 and len(bound(pods)) == 2, pods
    assert pod_group(kubectl, "grow")["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    delete(kubectl, "pod", "hog")
    freed = time.monotonic()
    wait_for(lambda: status(kubectl, "grow").get("worldSize") == 3 or None, 240, "grow's group at 3")
    before = step_of(status(kubectl, "grow"))
    wait_for(lambda: step_of(status(kubectl, "grow")) > before or None, 120, "grow to step at 3")
    FIGURES["room freed -> the group at 3 stepping (s)"] = time.monotonic() - freed
    final = status(kubectl, "grow")
    assert len(bound(workers(kubectl, "grow"))) == 3
    assert not final.get("backoffCount") and final.get("phase") in ("Running", "Scaling"), final
    delete(kubectl, "elasticjob", "grow")
    wait_for(lambda: workers(kubectl, "grow") == [] or None, 60, "grow's workers to go")


def test_kueue_gives_the_quota_of_a_gang_that_cannot_be_placed_to_one_that_can(lane: Any) -> None:
    if lane.kueue is None:
        pytest.skip(
            "no Kueue build: run `make kueue` (sigs.k8s.io/kueue from the Go module proxy into "
            "~/.cache/kelastic/kueue/<version>) or set KELASTIC_KUEUE"
        )
    kubectl = lane.kubectl
    wait_for(lambda: not kubectl.json("pods")["items"] or None, 120, "the node to be empty")
    # Kueue's 4 CPUs of quota admit 3 x 700m; the node's 2 CPUs cannot place them.
    kubectl.apply_object(elastic_job("wide-q", 3, 3, "700m", steps=200, queued=True))
    wait_for(
        lambda: (status(kubectl, "wide-q").get("queue") or {}).get("admitted") == 3 or None,
        120,
        "Kueue to admit wide-q",
    )
    admitted = time.monotonic()
    # blockAdmission: nothing else is admitted while wide-q's pods are not ready.
    kubectl.apply_object(elastic_job("small-q", 1, 2, "600m", steps=1500, queued=True))
    ever_bound: set[str] = set()
    seen: set[tuple[str, str]] = set()  # wide-q's (phase, status.queue.message)

    def small_steps() -> bool:
        ever_bound.update(bound(workers(kubectl, "wide-q")))
        wide = status(kubectl, "wide-q")
        queue = wide.get("queue") or {}
        seen.add((str(wide.get("phase")), str(queue.get("message"))))
        return step_of(status(kubectl, "small-q")) >= 1

    time.sleep(PODS_READY_TIMEOUT / 2)
    assert (status(kubectl, "small-q").get("queue") or {}).get("admitted", 0) == 0, status(kubectl, "small-q")
    wait_for(lambda: small_steps() or None, PODS_READY_TIMEOUT + 240, "small-q's first step", interval=0.5)
    FIGURES["gang admitted -> the job behind it stepping (s)"] = time.monotonic() - admitted
    assert ever_bound == set(), ever_bound
    workloads = kubectl.json("workloads.kueue.x-k8s.io")["items"]
    evictions = [
        c
        for w in workloads
        if w["metadata"]["name"].startswith("wide-q-")
        for c in (w.get("status") or {}).get("conditions") or []
        if c["type"] in ("Evicted", "Requeued")
        and "PodsReady" in (c.get("reason") or "") + c.get("message", "")
    ]
    assert evictions, workloads
    # Its status said why it waits again: Queued, with Kueue's word on the eviction.
    assert any(phase == "Queued" and "PodsReady timeout" in message for phase, message in seen), seen
    wide = status(kubectl, "wide-q")
    assert wide.get("phase") != "Failed" and not wide.get("backoffCount"), wide
    delete(kubectl, "elasticjob", "wide-q", "small-q")

"""GPUs in ``kelastic local``: ``nvidia.com/gpu`` capacity, one device per container, Pending when short.

The allotment rules are pure (kelastic.localcluster.kubelet.gpus); the rest runs the real
kubelet with a fake device count (``LocalCluster(gpus=2)``, what ``kelastic local up
--gpus 2`` does), against the API server emulator (where the kubelet binds pods
itself) and, when its binaries are there, the real control plane (where
kube-scheduler counts the node's allocatable). No process here touches a GPU: the
pods only print the variables the kubelet gave them.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.localcluster.cli.cli import build_parser
from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.kubelet.gpus import (
    ENV_GPUS,
    GPU_RESOURCE,
    GpuClaim,
    GpuLedger,
    allot,
    container_gpus,
    detect_gpus,
    device_env,
    pod_claim,
)
from kelastic.localcluster.testing import Kubectl, wait_for

# -- the pure rules -----------------------------------------------------------------------------


def test_detection_prefers_the_override_then_the_variable_then_the_driver(tmp_path: Path) -> None:
    proc = tmp_path / "gpus"
    for bus in ("0000:1b:00.0", "0000:3d:00.0", "0000:9a:00.0"):
        (proc / bus).mkdir(parents=True)
    nothing = tmp_path / "absent"
    assert detect_gpus(2, environ={ENV_GPUS: "5"}, proc_dir=proc) == ("0", "1")
    assert detect_gpus(environ={ENV_GPUS: "4"}, proc_dir=proc) == ("0", "1", "2", "3")
    assert detect_gpus(environ={ENV_GPUS: "0"}, proc_dir=proc) == ()  # GPUs turned off
    assert detect_gpus(environ={}, proc_dir=proc) == ("0", "1", "2")
    assert detect_gpus(environ={}, proc_dir=nothing, nvidia_smi=str(nothing / "nvidia-smi")) == ()
    with pytest.raises(ValueError, match=f"{ENV_GPUS} must be a number of GPUs, got 'two'"):
        detect_gpus(environ={ENV_GPUS: "two"}, proc_dir=proc)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, ("0", "1", "2", "3")),
        ("2,3", ("2", "3")),  # kelastic local started on part of the machine's GPUs
        ("3,1", ("3", "1")),
        ("1,7,2", ("1",)),  # CUDA's rule: the list ends at a device the node lacks
        ("1,x", ("1",)),
        ("0,0", ()),  # a repeated ordinal hides every device
        ("", ()),
        ("GPU-0b1c2d3e-0000-1111-2222-333344445555", ("0", "1", "2", "3")),  # by UUID: not narrowed
    ],
)
def test_detected_gpus_are_narrowed_to_kelastics_own_cuda_visible_devices(
    visible: str | None, expected: tuple[str, ...], tmp_path: Path
) -> None:
    proc = tmp_path / "gpus"
    for bus in ("0000:1b:00.0", "0000:3d:00.0", "0000:9a:00.0", "0000:bc:00.0"):
        (proc / bus).mkdir(parents=True)
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert detect_gpus(environ=environ, proc_dir=proc) == expected
    # a count given explicitly is taken as it is
    assert detect_gpus(2, environ=environ, proc_dir=proc) == ("0", "1")


def test_detection_falls_back_to_nvidia_smi(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0b1c2d3e-0000-1111-2222-333344445555)'\n"
        "echo '  MIG 1g.10gb     Device  0: (UUID: MIG-aaaa)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-9f8e7d6c-0000-1111-2222-333344445555)'\n"
    )
    smi.chmod(0o755)
    assert detect_gpus(environ={}, proc_dir=tmp_path / "absent", nvidia_smi=str(smi)) == ("0", "1")


def _container(name: str, gpus: object | None, section: str = "limits") -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "image": "python:3.11"}
    if gpus is not None:
        spec["resources"] = {section: {GPU_RESOURCE: gpus, "cpu": "1"}}
    return spec


def test_a_containers_request_is_its_limit_or_request() -> None:
    assert container_gpus(_container("a", None)) == 0
    assert container_gpus(_container("a", 2)) == 2
    assert container_gpus(_container("a", "3", "requests")) == 3
    assert container_gpus({"resources": {"limits": {"cpu": "2"}}}) == 0


def test_a_pods_claim_is_what_the_scheduler_counts() -> None:
    pod = {
        "spec": {
            "initContainers": [_container("setup", 3)],
            "containers": [_container("a", 1), _container("b", None), _container("c", 1)],
        }
    }
    claim = pod_claim(pod)
    assert claim == GpuClaim(containers=(("a", 1), ("b", 0), ("c", 1)), init=(("setup", 3),))
    assert claim.total == 3  # the init container needs more than the containers together
    assert GpuClaim(containers=(("a", 2), ("b", 2)), init=(("i", 1),)).total == 4
    assert GpuClaim(containers=()).total == 0


@pytest.mark.parametrize(
    ("taken", "claim", "expected"),
    [
        (set(), GpuClaim((("a", 1),)), {"a": ("0",)}),
        ({"0"}, GpuClaim((("a", 1),)), {"a": ("1",)}),
        ({"1"}, GpuClaim((("a", 2),)), {"a": ("0", "2")}),
        (set(), GpuClaim((("a", 1), ("b", 0), ("c", 2))), {"a": ("0",), "c": ("1", "2")}),
        # init containers run before the others: they use the first of the pod's devices
        (set(), GpuClaim((("a", 1), ("b", 1)), (("i", 2),)), {"a": ("0",), "b": ("1",), "i": ("0", "1")}),
        ({"0", "1"}, GpuClaim((("a", 3),)), None),  # too few free: nothing at all
        ({"2"}, GpuClaim((("a", 1), ("b", 1)), (("i", 3),)), None),
        (set(), GpuClaim((("a", 0),)), {}),
    ],
)
def test_allot_gives_disjoint_free_devices_or_none(
    taken: set[str], claim: GpuClaim, expected: dict[str, tuple[str, ...]] | None
) -> None:
    assert allot(("0", "1", "2"), taken, claim) == expected


def test_the_ledger_never_hands_a_device_out_twice_and_frees_it_on_release() -> None:
    ledger = GpuLedger(("0", "1"))
    one = GpuClaim((("main", 1),))
    assert ledger.claim("p1", one) == {"main": ("0",)}
    assert ledger.claim("p1", one) == {"main": ("0",)}  # a restart keeps its device
    assert ledger.claim("p2", one) == {"main": ("1",)}
    assert ledger.claim("p3", one) is None and ledger.free == 0
    assert ledger.release("p1") and not ledger.release("p1")
    assert ledger.claim("p3", one) == {"main": ("0",)}
    assert ledger.held("p2") == {"main": ("1",)} and ledger.held("p1") is None


def test_device_env_names_the_devices_or_hides_them_all() -> None:
    assert device_env(("1", "3")) == {
        "CUDA_VISIBLE_DEVICES": "1,3",
        "NVIDIA_VISIBLE_DEVICES": "1,3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    hidden = device_env(None)
    assert hidden["CUDA_VISIBLE_DEVICES"] == "" and hidden["NVIDIA_VISIBLE_DEVICES"] == "void"


# -- the real kubelet with a fake device count ------------------------------------------------

#: A pod's container: prints the devices it was given, then waits until ``<dir>/<pod>.done`` exists.
WAITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    print("devices=" + repr(os.environ.get("CUDA_VISIBLE_DEVICES")) + " nvidia=" + repr(os.environ.get("NVIDIA_VISIBLE_DEVICES")), flush=True)
    done = Path(sys.argv[1])
    while not done.exists():
        time.sleep(0.1)
    """
)


def _pod(name: str, gpus: int | None, script: Path, done: Path) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "python:3.11",
        "command": ["python", str(script), str(done)],
    }
    if gpus is not None:
        container["resources"] = {"limits": {GPU_RESOURCE: str(gpus)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [container], "terminationGracePeriodSeconds": 1},
    }


def _devices(kubectl: Kubectl, name: str) -> str | None:
    for line in kubectl("logs", name).splitlines():
        if line.startswith("devices="):
            return line
    return None


def _status(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return dict(kubectl.json("pod", name).get("status") or {})


def _exercise_gpu_pods(kubectl: Kubectl, tmp: Path, *, scheduler_message: str) -> None:
    """Two 1-GPU pods run on different devices, a third waits Pending until one finishes."""
    node = kubectl.json("node", "kelastic-local")
    assert node["status"]["capacity"][GPU_RESOURCE] == "2"
    assert node["status"]["allocatable"][GPU_RESOURCE] == "2"
    script = tmp / "waiter.py"
    script.write_text(WAITER)
    done = {n: tmp / f"{n}.done" for n in ("gpu-a", "gpu-b", "gpu-c", "no-gpu")}
    for name in ("gpu-a", "gpu-b"):
        kubectl.apply_object(_pod(name, 1, script, done[name]))
    a = wait_for(lambda: _devices(kubectl, "gpu-a"), 60, "gpu-a to print its devices")
    b = wait_for(lambda: _devices(kubectl, "gpu-b"), 60, "gpu-b to print its devices")
    assert {a, b} == {"devices='0' nvidia='0'", "devices='1' nvidia='1'"}, (a, b)
    # A pod without a GPU request sees none of the node's GPUs, as with the device plugin.
    kubectl.apply_object(_pod("no-gpu", None, script, done["no-gpu"]))
    assert wait_for(lambda: _devices(kubectl, "no-gpu"), 60, "no-gpu to print") == "devices='' nvidia='void'"

    kubectl.apply_object(_pod("gpu-c", 1, script, done["gpu-c"]))

    def unschedulable() -> dict[str, Any] | None:
        status = _status(kubectl, "gpu-c")
        for c in status.get("conditions") or []:
            if c["type"] == "PodScheduled" and c["status"] == "False":
                return c
        return None

    condition = wait_for(unschedulable, 60, "gpu-c to be reported unschedulable")
    assert condition["reason"] == "Unschedulable" and scheduler_message in condition["message"], condition
    status = _status(kubectl, "gpu-c")
    assert status.get("phase") == "Pending" and not status.get("containerStatuses"), status
    assert not kubectl.json("pod", "gpu-c")["spec"].get("nodeName")

    # gpu-a finishes: its device goes to gpu-c, and only once its process is gone.
    freed = a.split("'")[1]
    done["gpu-a"].write_text("")
    wait_for(lambda: _status(kubectl, "gpu-a").get("phase") == "Succeeded", 60, "gpu-a to succeed")
    c = wait_for(lambda: _devices(kubectl, "gpu-c"), 60, "gpu-c to start and print its devices")
    assert c == f"devices='{freed}' nvidia='{freed}'"
    # More than the node has: Pending for good, and deleting it leaves nothing behind.
    kubectl.apply_object(_pod("gpu-too-many", 3, script, tmp / "never"))
    wait_for(lambda: _status(kubectl, "gpu-too-many").get("conditions"), 60, "gpu-too-many to be reported")
    assert _status(kubectl, "gpu-too-many").get("phase") == "Pending"
    kubectl("delete", "pod", "gpu-too-many", "--wait=true", "--timeout=60s")
    for path in done.values():
        path.write_text("")
    for name in ("gpu-b", "gpu-c", "no-gpu"):
        wait_for(lambda n=name: _status(kubectl, n).get("phase") == "Succeeded", 60, f"{name} to succeed")


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("gpu-cluster")
    cluster = LocalCluster(data / "data", workdir=data, gpus=2)
    with cluster:
        yield cluster


def test_two_gpu_node_on_the_emulator_gives_each_pod_its_own_device_and_queues_the_third(
    gpu_cluster: LocalCluster, tmp_path: Path
) -> None:
    _exercise_gpu_pods(
        Kubectl(gpu_cluster.kubeconfig), tmp_path, scheduler_message="Insufficient nvidia.com/gpu"
    )


@pytest.mark.slow
def test_two_gpu_node_on_the_real_scheduler_gives_each_pod_its_own_device_and_queues_the_third(
    control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    cluster = LocalCluster(tmp_path_factory.mktemp("gpu-cp"), control_plane=control_plane_bin, gpus=2)
    with cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        # The API server's TaintNodesByCondition taints a new node not-ready until the node
        # lifecycle controller sees it Ready; the scheduler places nothing before that.
        wait_for(
            lambda: not kubectl.json("node", "kelastic-local")["spec"].get("taints"), 60, "the taint to lift"
        )
        _exercise_gpu_pods(kubectl, tmp_path, scheduler_message="Insufficient nvidia.com/gpu")


def test_kelastic_local_up_and_run_take_a_gpu_count() -> None:
    parser = build_parser()
    assert parser.parse_args(["local", "up", "--gpus", "2"]).gpus == 2
    assert parser.parse_args(["local", "run", "--gpus", "0", "job.yaml"]).gpus == 0
    assert parser.parse_args(["local", "up"]).gpus is None  # detected


def test_preemption_takes_the_fewest_least_important_pods_that_free_enough() -> None:
    from kelastic.localcluster.kubelet.preemption import Holder, choose_victims, unschedulable_message

    low = Holder("u1", "ns", "low", 100, 1)
    lower = Holder("u2", "ns", "lower", 10, 1)
    big = Holder("u3", "ns", "big", 50, 2)
    same = Holder("u4", "ns", "same", 1000, 1)
    # One GPU wanted, none free: the lowest priority one goes, nobody else.
    assert choose_victims(1000, "PreemptLowerPriority", 1, 0, [low, lower, same]) == [lower]
    # Two wanted: the two-GPU pod alone suffices, so the one-GPU pods are spared.
    assert choose_victims(1000, "PreemptLowerPriority", 2, 0, [low, lower, big]) == [big]
    # Pods of equal or higher priority are never taken; not enough below: nothing is.
    assert choose_victims(1000, "PreemptLowerPriority", 2, 0, [low, same]) == []
    assert choose_victims(1000, "Never", 1, 0, [low]) == []
    assert choose_victims(1000, "PreemptLowerPriority", 1, 1, [low]) == []  # it fits already
    assert unschedulable_message("n", 2) == (
        "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: found a potential placement "
        "for pod on node n, preempting 2 victims"
    )

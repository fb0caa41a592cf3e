"""The pod's ``kubectl get pods`` columns (READY, STATUS, RESTARTS) and the status writes behind them.

A kubelet writes the whole ``containerStatuses`` list with a strategic merge patch; the list is
atomic in k8s.io/api, so each write replaces every container's ``state``: a container has one
state at a time. The columns follow kube-apiserver's ``printPod``; ``test_fidelity.py`` compares
them with a real kube-apiserver's for pods of every phase.
"""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.localcluster.apiserver.patch import strategic_merge_patch
from kelastic.localcluster.apiserver.resources import BUILTINS
from kelastic.localcluster.apiserver.table import to_table

PODS = next(t for t in BUILTINS if t.kind == "Pod")
T0 = "2026-01-01T00:00:00Z"


def container(state: dict[str, Any], ready: bool = False, restarts: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "name": "main",
        "image": "python",
        "state": state,
        "ready": ready,
        "restartCount": restarts,
        **extra,
    }


def pod(phase: str, statuses: list[dict[str, Any]], ready: bool = False, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "creationTimestamp": T0, **meta},
        "spec": {"containers": [{"name": "main", "image": "python"}]},
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": statuses,
        },
    }


def columns(obj: dict[str, Any]) -> tuple[str, str, str]:
    cells = to_table(PODS, [obj])["rows"][0]["cells"]
    return cells[1], cells[2], cells[3]


WAITING = {"waiting": {"reason": "ContainerCreating"}}
RUNNING = {"running": {"startedAt": T0}}
COMPLETED = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": T0, "finishedAt": T0}}
ERROR = {"terminated": {"exitCode": 3, "reason": "Error", "startedAt": T0, "finishedAt": T0}}
OOM = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": T0, "finishedAt": T0}}


def test_each_status_write_replaces_the_container_state() -> None:
    current = pod("Pending", [container(WAITING)])
    for phase, state, ready in (("Running", RUNNING, True), ("Succeeded", COMPLETED, False)):
        current = strategic_merge_patch(
            current, {"status": {"phase": phase, "containerStatuses": [container(state, ready)]}}
        )
        assert current["status"]["containerStatuses"][0]["state"] == state
    assert columns(current) == ("0/1", "Completed", "0")


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (pod("Pending", []), ("0/1", "Pending", "0")),
        (pod("Pending", [container(WAITING)]), ("0/1", "ContainerCreating", "0")),
        (pod("Running", [container(RUNNING, True)], ready=True), ("1/1", "Running", "0")),
        (pod("Running", [container(RUNNING, False)]), ("0/1", "Running", "0")),
        (pod("Succeeded", [container(COMPLETED)]), ("0/1", "Completed", "0")),
        (pod("Failed", [container(ERROR)]), ("0/1", "Error", "0")),
        (pod("Failed", [container(OOM)]), ("0/1", "OOMKilled", "0")),
        (
            pod("Running", [container(RUNNING, True)], ready=True, deletionTimestamp=T0),
            ("1/1", "Terminating", "0"),
        ),
        (pod("Succeeded", [container(COMPLETED)], deletionTimestamp=T0), ("0/1", "Completed", "0")),
        (
            pod("Running", [container({"waiting": {"reason": "CrashLoopBackOff"}}, restarts=2)]),
            ("0/1", "CrashLoopBackOff", "2"),
        ),
    ],
)
def test_the_columns_kubectl_prints(obj: dict[str, Any], expected: tuple[str, str, str]) -> None:
    assert columns(obj) == expected


def test_restarts_say_when_the_last_one_was() -> None:
    restarted = container(RUNNING, True, restarts=1, lastState=ERROR)
    ready, status, restarts = columns(pod("Running", [restarted], ready=True))
    assert (ready, status) == ("1/1", "Running")
    assert restarts.startswith("1 (") and restarts.endswith(" ago)"), restarts


def test_init_containers_and_sidecars() -> None:
    obj = pod("Pending", [container(WAITING | {"waiting": {"reason": "PodInitializing"}})])
    obj["spec"]["initContainers"] = [{"name": "setup"}, {"name": "proxy", "restartPolicy": "Always"}]
    obj["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": RUNNING, "restartCount": 0},
        {"name": "proxy", "state": WAITING, "restartCount": 0},
    ]
    assert columns(obj) == ("0/2", "Init:0/2", "0")
    obj["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": COMPLETED, "restartCount": 0},
        {"name": "proxy", "state": RUNNING, "restartCount": 0, "started": True, "ready": True},
    ]
    obj["status"]["conditions"].append({"type": "Initialized", "status": "True"})
    assert columns(obj) == ("1/2", "PodInitializing", "0")
    obj["status"]["initContainerStatuses"][0]["state"] = ERROR
    obj["status"]["conditions"].pop()
    assert columns(obj) == ("0/2", "Init:Error", "0")

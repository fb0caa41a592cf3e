"""Unit tests of a container's state as the kubelet keeps it (localcluster/kubelet/containers.py):
what a kubelet started on an existing pod carries over, and when a container counts as
started and ready. Runs, exits and probes are tested with real processes in
test_kubelet_pods.py and test_kubelet_runtime.py."""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.localcluster.kubelet.containers import Container
from kelastic.localcluster.kubelet.podstatus import ContainerState, Terminated


def restored(prev: dict[str, Any], policy: str, init: bool = False) -> Container:
    c = Container({"name": "main", "image": "python"}, init=init)
    c.restore(prev, policy)
    return c


@pytest.mark.parametrize(
    ("policy", "code", "restarts"),
    [("Always", 0, True), ("OnFailure", 0, False), ("OnFailure", 1, True), ("Never", 1, False)],
)
def test_a_finished_run_is_carried_over_and_restarted_per_the_policy(
    policy: str, code: int, restarts: bool
) -> None:
    c = restored({"restartCount": 2, "state": {"terminated": {"exitCode": code, "reason": "x"}}}, policy)
    assert c.record.state is ContainerState.TERMINATED and c.record.restart_count == 2
    assert c.record.terminated is not None and c.record.terminated.exit_code == code
    assert (c.restart_due is not None) is restarts


def test_a_run_whose_process_died_with_the_previous_kubelet_is_unknown() -> None:
    c = restored({"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}, "Never")
    assert c.record.terminated is not None
    assert (c.record.terminated.exit_code, c.record.terminated.reason) == (137, "ContainerStatusUnknown")
    assert c.restart_due is None
    assert restored({"state": {"running": {}}}, "Always").restart_due is not None


def test_a_container_in_back_off_restarts_now() -> None:
    c = restored(
        {"restartCount": 3, "state": {"waiting": {}}, "lastState": {"terminated": {"exitCode": 2}}}, "Always"
    )
    assert c.record.last_terminated is not None and c.record.last_terminated.exit_code == 2
    assert c.restart_due is not None and c.record.restart_count == 3


def test_started_and_ready() -> None:
    c = Container({"name": "main"}, init=False)
    c.refresh_ready()
    assert not c.record.started and not c.record.ready  # no process
    init = Container({"name": "setup"}, init=True)
    init.record.state = ContainerState.TERMINATED
    init.record.terminated = Terminated(0, "Completed", None, 0.0)
    init.refresh_ready()
    assert init.record.ready  # an init container is ready once it succeeded
    init.record.terminated = Terminated(1, "Error", None, 0.0)
    init.refresh_ready()
    assert not init.record.ready

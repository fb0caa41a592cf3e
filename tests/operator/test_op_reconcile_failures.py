"""Table tests of reconcile's failures policy: failed workers recreated per restartPolicy and
backoffLimit, or the job failed quoting its root cause (operator/reconcile/failures.py).
"""

from __future__ import annotations

import runpy
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile import DeletePod, Emit
from kelastic.operator.spec import parse_time

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


@pytest.mark.parametrize(
    ("policy", "exit_code", "signal", "outcome"),
    [
        ("ExitCode", 137, None, "recreate"),
        ("ExitCode", 143, None, "recreate"),
        ("ExitCode", None, 9, "recreate"),
        ("ExitCode", None, None, "recreate"),  # evicted: no exit code
        ("ExitCode", 1, None, "fail"),
        ("ExitCode", 127, None, "fail"),
        ("OnFailure", 1, None, "recreate"),
        ("OnFailure", 137, None, "recreate"),
        ("Never", 137, None, "fail"),
        ("Never", 1, None, "fail"),
    ],
)
def test_restart_policies(
    kit: SimpleNamespace, policy: str, exit_code: int | None, signal: int | None, outcome: str
) -> None:
    body = kit.job_body(restartPolicy=policy, status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(1, PodPhase.FAILED, exit_code=exit_code, signal=signal, reason="Error")
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2), at=1))
    if outcome == "recreate":
        assert harness.deleted_names(d) == ["demo-worker-1"]
        assert d.status["backoffCount"] == 1 and d.status["countedFailures"] == ["pod-demo-1"]
        assert d.status["phase"] == "Restarting"
        assert d.status["restarts"] == 1
        assert harness.kinds(d, DeletePod)[0].reason == "RecreateWorker"
        assert harness.kinds(d, DeletePod)[0].warning, "a recreated worker is a Warning Event"
    else:
        assert d.status["phase"] == "Failed"
        failed_cond = harness.cond(d, "Failed")
        assert failed_cond["reason"] == "WorkerFailed"
        assert "demo-worker-1 (index 1)" in failed_cond["message"]
        if exit_code is not None:
            assert f"code {exit_code}" in failed_cond["message"]
        emitted = harness.kinds(d, Emit)
        assert emitted and emitted[-1].warning and emitted[-1].reason == "WorkerFailed"
        # cleanPodPolicy Running: the running workers and the store are stopped
        assert set(harness.deleted_names(d)) == {"demo-worker-0", "demo-worker-2", "demo-rendezvous"}


def test_failure_is_counted_once_across_passes(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(1, PodPhase.FAILED, exit_code=137)
    obs = kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2))
    d = harness.run(body, obs)
    body["status"] = d.status
    d2 = harness.run(body, obs)  # the same event again (the delete has not landed yet)
    assert d2.status["backoffCount"] == 1
    # once the pod is gone its uid is forgotten, the replacement is created
    body["status"] = d2.status
    d3 = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(2)))
    assert d3.status["countedFailures"] == [] and d3.status["backoffCount"] == 1
    assert harness.created_names(d3) == ["demo-worker-1"]


def test_backoff_limit_exhausted(kit: SimpleNamespace) -> None:
    body = kit.job_body(backoffLimit=2, status={"phase": "Restarting", "scaledTo": 3, "backoffCount": 2})
    failed = kit.worker(2, PodPhase.FAILED, exit_code=137)
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), failed))
    assert d.status["phase"] == "Failed"
    c = harness.cond(d, "Failed")
    assert c["reason"] == "BackoffLimitExceeded" and "spec.backoffLimit=2" in c["message"]
    assert "demo-worker-2" not in harness.created_names(d)


def test_failure_message_quotes_the_termination_message(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    msg = "noise\nkelastic-agent: rank 3 (local rank 1) exited with code 2\nworker group failed"
    failed = kit.worker(1, PodPhase.FAILED, exit_code=1, message=msg)
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2)))
    text = harness.cond(d, "Failed")["message"]
    assert "rank 3 (local rank 1) exited with code 2" in text and "exited with code 1" in text


def test_failure_message_quotes_the_earliest_failure(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    t = "2026-01-01T00:00:0{}Z"
    peer = "node demo-worker-0: train.py could not harness.run: the rendezvous of the job was closed"
    root = "rank 4 (local rank 0, node demo-worker-2) exited with code 2: ValueError: bad data"
    pods = [
        # index 0 failed later: it only saw the job end
        kit.worker(0, PodPhase.FAILED, exit_code=1, message=peer, finished_at=parse_time(t.format(7))),
        kit.worker(1),
        kit.worker(2, PodPhase.FAILED, exit_code=1, message=root, finished_at=parse_time(t.format(5))),
    ]
    text = harness.cond(harness.run(body, kit.observed(kit.store(), *pods)), "Failed")["message"]
    assert text.startswith("worker pod demo-worker-2 (index 2) exited with code 1: " + root), text
    # within the same second (the API's resolution) the pod naming a failed rank wins
    pods[0] = replace(pods[0], finished_at=parse_time(t.format(5)))
    d = harness.run(body, kit.observed(kit.store(), *pods))
    assert root in harness.cond(d, "Failed")["message"]
    warning = harness.kinds(d, Emit)[-1]
    assert warning.warning and root in warning.message
    # with a known time against an unknown one, the known one is the earlier failure
    pods[2] = replace(pods[2], finished_at=None)
    assert peer in harness.cond(harness.run(body, kit.observed(kit.store(), *pods)), "Failed")["message"]


def test_a_peer_failure_waits_briefly_for_the_root_cause(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 2})
    peer = "node demo-worker-1: train.py could not harness.run: the rendezvous was closed"
    root = "rank 0 (local rank 0, node demo-worker-0) exited with code 2"
    at = timedelta(seconds=1)
    ended = kit.worker(1, PodPhase.FAILED, exit_code=1, message=peer, finished_at=kit.T0 + at)
    # worker 0 still runs: its agent may be about to report why the job closed
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), ended, at=2))
    assert d.status["phase"] == "Running" and harness.cond(d, "Failed") is None
    assert d.requeue_after is not None and 0 < d.requeue_after <= 4
    # it does, a second later: its root cause is the reason, though it ended later
    root_pod = kit.worker(0, PodPhase.FAILED, exit_code=1, message=root, finished_at=kit.T0 + 2 * at)
    d = harness.run(body, kit.observed(kit.store(), root_pod, ended, at=3))
    assert d.status["phase"] == "Failed"
    assert (
        "demo-worker-0 (index 0)" in harness.cond(d, "Failed")["message"]
        and root in harness.cond(d, "Failed")["message"]
    )
    # it never does: after the grace the job fails with what is known
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), ended, at=7))
    assert d.status["phase"] == "Failed" and peer in harness.cond(d, "Failed")["message"]


def test_permanent_failure_names_rank_and_exit_code(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(2, PodPhase.FAILED, exit_code=1, reason="Error", message=harness.AGENT_REPORT)
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), failed))
    message = harness.cond(d, "Failed")["message"]
    assert message.startswith(
        "worker pod demo-worker-2 (index 2) exited with code 1 (Error): rank 3 (local_rank: 1) exitcode 2"
    )


def test_pods_being_removed_decide_nothing(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=2, status={"phase": "Scaling", "scaledTo": 3})
    leaving_ok = kit.worker(2, PodPhase.SUCCEEDED, exit_code=0, terminating=True)
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), leaving_ok))
    assert d.status["phase"] == "Scaling", "a scaled-away pod that exited 0 does not end the job"
    leaving_bad = kit.worker(2, PodPhase.FAILED, exit_code=1)  # not yet marked for deletion
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), leaving_bad))
    assert d.status["phase"] != "Failed" and d.status.get("backoffCount", 0) == 0
    assert harness.deleted_names(d) == ["demo-worker-2"]


@pytest.mark.parametrize("exit_code", [1, 137])
def test_an_oom_killed_worker_is_recreated_saying_so_whatever_its_exit_code(
    kit: SimpleNamespace, exit_code: int
) -> None:
    """The kernel kills a container's largest process at its memory limit: a rank, whose
    agent then exits 1. Under ExitCode that is still the OOM killer's doing, not the program's."""
    body = kit.job_body(restartPolicy="ExitCode", status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(1, PodPhase.FAILED, exit_code=exit_code, reason="OOMKilled")
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2), at=1))
    assert harness.deleted_names(d) == ["demo-worker-1"] and d.status["phase"] == "Restarting"
    message = harness.kinds(d, DeletePod)[0].message
    assert message.startswith(
        f"worker pod demo-worker-1 (index 1) was OOM-killed (it exceeded its memory limit) "
        f"and exited with code {exit_code}; recreating it"
    ), message

"""Table tests of the pure reconcile core (no cluster, no I/O)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.observed import (
    PodPhase,
    PodView,
    RendezvousView,
    ServiceView,
    failure_summary,
    pod_view,
)
from kelastic.operator.reconcile import (
    CreatePod,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteService,
    Emit,
    PublishMembership,
    ReconcileConfig,
    reconcile,
)
from kelastic.operator.spec import parse_job, parse_time

CONFIG = ReconcileConfig(min_replicas_timeout=60.0, success_grace=10.0)


def run(body: dict[str, Any], obs: Any, config: ReconcileConfig = CONFIG) -> Decision:
    return reconcile(parse_job(body), obs, config)


def kinds(decision: Decision, kind: type) -> list[Any]:
    return [a for a in decision.actions if isinstance(a, kind)]


def created_names(decision: Decision) -> list[str]:
    return [a.manifest["metadata"]["name"] for a in kinds(decision, CreatePod)]


def deleted_names(decision: Decision) -> list[str]:
    return [a.name for a in kinds(decision, DeletePod)]


def cond(decision: Decision, kind: str) -> dict[str, Any] | None:
    for c in decision.status.get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def test_fresh_job_creates_service_first_then_store_and_workers(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    first = run(body, kit.observed(services=()))
    assert [type(a) for a in first.actions if not isinstance(a, Emit)] == [CreateService, CreatePod]
    assert created_names(first) == ["demo-rendezvous"]  # workers wait for the Service's cluster IP
    assert first.status["phase"] == "Created"
    assert first.status["selector"] == "kelastic.dev/job-name=demo,kelastic.dev/role=worker"
    assert first.status["startTime"] == "2026-01-01T12:00:00Z"
    assert kinds(first, Emit)[0].reason == "WaitingForWorkers"

    body["status"] = first.status
    second = run(body, kit.observed(kit.store(PodPhase.PENDING), at=1))
    assert created_names(second) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert not kinds(second, Emit), "no new Event while the phase stays the same"
    assert not kinds(second, PublishMembership), "the store is not running yet"
    cmd = kinds(second, CreatePod)[0].manifest["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.2.0.5:29400"
    assert cmd[cmd.index("--rdzv-id") + 1] == "uid-demo"


def test_running_job_is_steady_and_publishes_membership(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "startTime": "2026-01-01T12:00:00Z"})
    obs = kit.observed(kit.store(), *(kit.worker(i, ready=True) for i in range(3)), at=5)
    d = run(body, obs)
    assert not kinds(d, CreatePod) and not kinds(d, DeletePod)
    (pub,) = kinds(d, PublishMembership)
    assert pub.nodes == ("demo-worker-0", "demo-worker-1", "demo-worker-2")
    assert (pub.min_nodes, pub.max_nodes, pub.run_id, pub.store_id) == (2, 4, "uid-demo", "store-1")
    assert d.status["phase"] == "Running"
    assert d.status["replicaStatuses"]["Worker"] == {"active": 3, "ready": 3, "succeeded": 0, "failed": 0}
    # applying the status and reconciling again is a fixed point
    body["status"] = d.status
    again = run(body, obs)
    assert again.status == d.status
    assert not kinds(again, Emit)


def test_lost_pod_is_replaced_and_pending_pods_are_not_members(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        status={"phase": "Running", "scaledTo": 3, "conditions": [], "startTime": "2026-01-01T12:00:00Z"}
    )
    body["status"]["conditions"] = [
        {"type": "Running", "status": "True", "reason": "WorkersRunning", "message": ""}
    ]
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(2), at=5))
    assert created_names(d) == ["demo-worker-1"]
    assert kinds(d, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")
    assert d.status["phase"] == "Restarting"
    # the replacement is Pending: it is not listed, so it cannot block the survivors
    d2 = run(
        body, kit.observed(kit.store(), kit.worker(0), kit.worker(1, PodPhase.PENDING), kit.worker(2), at=6)
    )
    assert not created_names(d2)
    assert kinds(d2, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")


def test_terminating_pod_blocks_its_name_until_gone(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1, terminating=True), kit.worker(2)))
    assert not created_names(d) and not deleted_names(d)
    assert kinds(d, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")


@pytest.mark.parametrize(
    ("replicas", "scaled_to", "present", "create", "delete", "phase"),
    [
        (4, 3, [0, 1, 2], ["demo-worker-3"], [], "Scaling"),
        (2, 3, [0, 1, 2], [], ["demo-worker-2"], "Scaling"),
        (2, 4, [0, 1, 2, 3], [], ["demo-worker-3", "demo-worker-2"], "Scaling"),
        (3, 3, [0, 1, 2], [], [], "Running"),
    ],
    ids=["up", "down", "down-two-highest-first", "steady"],
)
def test_scale(
    kit: SimpleNamespace,
    replicas: int,
    scaled_to: int,
    present: list[int],
    create: list[str],
    delete: list[str],
    phase: str,
) -> None:
    body = kit.job_body(replicas=replicas, status={"phase": "Running", "scaledTo": scaled_to})
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in present)))
    assert created_names(d) == create
    assert deleted_names(d) == delete
    assert d.status["phase"] == phase
    # membership never lists a pod that is being scaled away
    assert all(int(n.rsplit("-", 1)[1]) < replicas for n in kinds(d, PublishMembership)[0].nodes)


def test_scale_down_converges_to_running(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=2, status={"phase": "Scaling", "scaledTo": 3})
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1)))
    assert d.status["phase"] == "Running" and d.status["scaledTo"] == 2


def test_success_when_workers_succeed(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = [kit.worker(i, PodPhase.SUCCEEDED, exit_code=0, finished_at=kit.T0) for i in range(3)]
    d = run(body, kit.observed(kit.store(), *pods, at=2))
    assert d.status["phase"] == "Succeeded"
    assert d.status["completionTime"] == "2026-01-01T12:00:02Z"
    assert cond(d, "Succeeded")["status"] == "True"
    assert cond(d, "Running") is None or cond(d, "Running")["status"] == "False"
    # cleanPodPolicy Running (default): succeeded pods stay for their logs; the store goes
    assert deleted_names(d) == ["demo-rendezvous"]
    assert [a.name for a in kinds(d, DeleteService)] == ["demo-rendezvous"]
    assert not any(a.warning for a in d.actions if not isinstance(a, Emit)), "cleanup is Normal"
    assert not created_names(d)


def test_success_waits_for_stragglers_within_grace(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = [kit.worker(0, PodPhase.SUCCEEDED, exit_code=0, finished_at=kit.T0), kit.worker(1), kit.worker(2)]
    waiting = run(body, kit.observed(kit.store(), *pods, at=3))
    assert waiting.status["phase"] == "Running"
    assert waiting.requeue_after == pytest.approx(7.0)
    assert not created_names(waiting)
    done = run(body, kit.observed(kit.store(), *pods, at=11))
    assert done.status["phase"] == "Succeeded"
    assert deleted_names(done) == ["demo-worker-1", "demo-worker-2", "demo-rendezvous"]


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
    d = run(body, kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2), at=1))
    if outcome == "recreate":
        assert deleted_names(d) == ["demo-worker-1"]
        assert d.status["backoffCount"] == 1 and d.status["countedFailures"] == ["pod-demo-1"]
        assert d.status["phase"] == "Restarting"
        assert d.status["restarts"] == 1
        assert kinds(d, DeletePod)[0].reason == "RecreateWorker"
        assert kinds(d, DeletePod)[0].warning, "a recreated worker is a Warning Event"
    else:
        assert d.status["phase"] == "Failed"
        failed_cond = cond(d, "Failed")
        assert failed_cond["reason"] == "WorkerFailed"
        assert "demo-worker-1 (index 1)" in failed_cond["message"]
        if exit_code is not None:
            assert f"code {exit_code}" in failed_cond["message"]
        emitted = kinds(d, Emit)
        assert emitted and emitted[-1].warning and emitted[-1].reason == "WorkerFailed"
        # cleanPodPolicy Running: the running workers and the store are stopped
        assert set(deleted_names(d)) == {"demo-worker-0", "demo-worker-2", "demo-rendezvous"}


def test_failure_is_counted_once_across_passes(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(1, PodPhase.FAILED, exit_code=137)
    obs = kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2))
    d = run(body, obs)
    body["status"] = d.status
    d2 = run(body, obs)  # the same event again (the delete has not landed yet)
    assert d2.status["backoffCount"] == 1
    # once the pod is gone its uid is forgotten, the replacement is created
    body["status"] = d2.status
    d3 = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(2)))
    assert d3.status["countedFailures"] == [] and d3.status["backoffCount"] == 1
    assert created_names(d3) == ["demo-worker-1"]


def test_backoff_limit_exhausted(kit: SimpleNamespace) -> None:
    body = kit.job_body(backoffLimit=2, status={"phase": "Restarting", "scaledTo": 3, "backoffCount": 2})
    failed = kit.worker(2, PodPhase.FAILED, exit_code=137)
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), failed))
    assert d.status["phase"] == "Failed"
    c = cond(d, "Failed")
    assert c["reason"] == "BackoffLimitExceeded" and "spec.backoffLimit=2" in c["message"]
    assert "demo-worker-2" not in created_names(d)


def test_active_deadline(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        activeDeadlineSeconds=100, status={"phase": "Running", "startTime": "2026-01-01T12:00:00Z"}
    )
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))
    before = run(body, kit.observed(*pods, at=40))
    assert before.status["phase"] == "Running" and before.requeue_after == pytest.approx(60)
    after = run(body, kit.observed(*pods, at=100))
    assert after.status["phase"] == "Failed"
    assert cond(after, "Failed")["reason"] == "DeadlineExceeded"
    assert "spec.activeDeadlineSeconds=100" in cond(after, "Failed")["message"]
    assert len(deleted_names(after)) == 4


def test_too_few_workers_for_too_long(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = (kit.store(), kit.worker(0), kit.worker(1, PodPhase.PENDING), kit.worker(2, PodPhase.PENDING))
    d = run(body, kit.observed(*pods, at=0))
    assert d.status["belowMinSince"] == "2026-01-01T12:00:00Z"
    assert d.requeue_after == pytest.approx(60)
    body["status"] = d.status
    d2 = run(body, kit.observed(*pods, at=61))
    assert d2.status["phase"] == "Failed"
    c = cond(d2, "Failed")
    assert c["reason"] == "NotEnoughWorkers" and "spec.minReplicas=2" in c["message"]
    # recovering in time clears the clock
    d3 = run(
        body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), kit.worker(2, PodPhase.PENDING), at=30)
    )
    assert "belowMinSince" not in d3.status and d3.status["phase"] != "Failed"


def test_annotation_overrides_min_replicas_timeout(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "belowMinSince": "2026-01-01T12:00:00Z"})
    body["metadata"]["annotations"] = {"kelastic.dev/min-replicas-timeout-seconds": "5"}
    d = run(body, kit.observed(kit.store(), kit.worker(0), at=6))
    assert d.status["phase"] == "Failed"


def test_suspend_and_resume(kit: SimpleNamespace) -> None:
    running = [{"type": "Running", "status": "True", "reason": "WorkersRunning", "message": ""}]
    status = {"phase": "Running", "scaledTo": 3, "startTime": "2026-01-01T11:00:00Z", "conditions": running}
    body = kit.job_body(suspend=True, status=status)
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))
    d = run(body, kit.observed(*pods))
    assert d.status["phase"] == "Suspended"
    assert sorted(deleted_names(d)) == ["demo-rendezvous", "demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert "startTime" not in d.status
    assert not created_names(d)
    body["status"] = d.status
    quiet = run(body, kit.observed())
    assert not quiet.actions
    body["spec"]["suspend"] = False
    resumed = run(body, kit.observed(at=50))
    assert sorted(created_names(resumed)) == [
        "demo-rendezvous",
        "demo-worker-0",
        "demo-worker-1",
        "demo-worker-2",
    ]
    assert resumed.status["startTime"] == "2026-01-01T12:00:50Z"
    assert resumed.status["phase"] == "Restarting"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["spec"].update(maxReplicas=1), "spec.maxReplicas"),
        (
            lambda b: b["spec"]["replicaSpecs"]["Worker"].update(replicas=9),
            "spec.replicaSpecs.Worker.replicas",
        ),
        (lambda b: b["spec"]["replicaSpecs"]["Worker"].pop("template"), "spec.replicaSpecs.Worker.template"),
    ],
    ids=["max<min", "replicas-out-of-range", "no-template"],
)
def test_invalid_spec_fails_with_condition_and_event(kit: SimpleNamespace, mutate: Any, field: str) -> None:
    body = kit.job_body()
    mutate(body)
    d = run(body, kit.observed(services=()))
    assert d.status["phase"] == "Failed"
    invalid = cond(d, "Invalid")
    assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec"
    assert field in invalid["message"]
    (event,) = kinds(d, Emit)
    assert event.warning and field in event.message
    assert not created_names(d)
    # the same invalid job again: no second Event (no event storm from the periodic timer)
    body["status"] = d.status
    assert not kinds(run(body, kit.observed(services=(), at=5)), Emit)


def test_fixing_an_invalid_spec_restarts_the_job(kit: SimpleNamespace) -> None:
    body = kit.job_body(max_r=1)
    bad = run(body, kit.observed(services=()))
    body["status"] = bad.status
    body["spec"]["maxReplicas"] = 4
    good = run(body, kit.observed(services=(), at=3))
    assert cond(good, "Invalid")["status"] == "False"
    assert good.status["phase"] == "Created"
    assert "completionTime" not in good.status
    assert kinds(good, CreateService)


def test_finished_job_is_left_alone_then_deleted_after_ttl(kit: SimpleNamespace) -> None:
    status = {"phase": "Succeeded", "completionTime": "2026-01-01T12:00:00Z"}
    body = kit.job_body(ttlSecondsAfterFinished=30, status=status)
    done = [kit.worker(i, PodPhase.SUCCEEDED, exit_code=0) for i in range(3)]
    d = run(body, kit.observed(*done, services=(), at=10))
    assert not d.actions and d.requeue_after == pytest.approx(20)
    d2 = run(body, kit.observed(*done, services=(), at=31))
    assert kinds(d2, DeleteJob)


def test_clean_pod_policy_all_and_none(kit: SimpleNamespace) -> None:
    status = {"phase": "Failed", "completionTime": "2026-01-01T12:00:00Z"}
    pods = (kit.worker(0, PodPhase.FAILED, exit_code=1), kit.worker(1))
    all_ = run(kit.job_body(cleanPodPolicy="All", status=status), kit.observed(*pods, services=()))
    assert deleted_names(all_) == ["demo-worker-0", "demo-worker-1"]
    none = run(kit.job_body(cleanPodPolicy="None", status=status), kit.observed(*pods, services=()))
    assert deleted_names(none) == []


def test_dead_store_is_recreated_and_membership_republished(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    workers = [kit.worker(i) for i in range(3)]
    dead = run(body, kit.observed(kit.store(PodPhase.FAILED), *workers))
    assert deleted_names(dead) == ["demo-rendezvous"]
    assert [a.warning for a in kinds(dead, DeletePod)] == [True]
    assert not kinds(dead, PublishMembership)
    gone = run(body, kit.observed(*workers))
    assert created_names(gone) == ["demo-rendezvous"]
    back = run(body, kit.observed(kit.store(uid="store-2"), *workers))
    assert kinds(back, PublishMembership)[0].store_id == "store-2"


def test_lost_service_is_recreated(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), services=()))
    assert kinds(d, CreateService)


def test_external_endpoint_needs_no_store(kit: SimpleNamespace) -> None:
    body = kit.job_body(rdzvEndpoint="10.0.0.9:29400")
    d = run(body, kit.observed(services=()))
    assert not kinds(d, CreateService)
    assert created_names(d) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]


def test_c10d_backend_publishes_no_membership(kit: SimpleNamespace) -> None:
    body = kit.job_body(rdzvBackend="c10d", status={"phase": "Running"})
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert not kinds(d, PublishMembership)


def test_rendezvous_figures_reach_status(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "backoffCount": 1, "restarts": 1})
    rdzv = RendezvousView(world_size=6, restarts=2, members=("a", "b"), step=120, total=500)
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), rendezvous=rdzv))
    assert d.status["worldSize"] == 6
    assert d.status["progress"] == "120/500 (24%)"
    assert d.status["restarts"] == 3
    # the store unreachable: the last known figures stay
    body["status"] = d.status
    d2 = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert (
        d2.status["worldSize"] == 6
        and d2.status["progress"] == "120/500 (24%)"
        and d2.status["restarts"] == 3
    )


def test_pods_of_another_job_incarnation_are_ignored(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running"})
    stranger = PodView(
        name="demo-worker-7", uid="x", role="worker", index=7, phase=PodPhase.RUNNING, owner_uid="uid-old"
    )
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), stranger))
    assert "demo-worker-7" not in deleted_names(d)


def test_deleting_job_does_nothing(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running"})
    body["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    d = run(body, kit.observed(kit.store(), kit.worker(0)))
    assert not d.actions


class World:
    """Applies decisions to an in-memory set of pods, like the API server plus a kubelet would."""

    def __init__(self, kit: SimpleNamespace, body: dict[str, Any]) -> None:
        self.kit, self.body = kit, body
        self.pods: dict[str, PodView] = {}
        self.services: dict[str, Any] = {}
        self.creates: list[str] = []
        self.t = 0.0

    def step(self, *, run_pods: bool = True) -> Decision:
        self.t += 1
        obs = self.kit.observed(*self.pods.values(), services=tuple(self.services.values()), at=self.t)
        d = run(self.body, obs)
        for a in d.actions:
            if isinstance(a, CreatePod):
                name = a.manifest["metadata"]["name"]
                assert name not in self.pods, f"duplicate create of {name}"
                self.creates.append(name)
                body = {**a.manifest, "metadata": {**a.manifest["metadata"], "uid": f"u-{name}-{self.t}"}}
                self.pods[name] = pod_view(body)
            elif isinstance(a, CreateService):
                self.services[a.manifest["metadata"]["name"]] = self.kit.service()
            elif isinstance(a, DeletePod):
                self.pods.pop(a.name, None)
        if run_pods:
            self.pods = {
                n: PodView(**{**p.__dict__, "phase": PodPhase.RUNNING}) if p.phase is PodPhase.PENDING else p
                for n, p in self.pods.items()
            }
        self.body["status"] = d.status
        return d


def test_converges_from_nothing_and_restart_adopts_without_duplicates(kit: SimpleNamespace) -> None:
    world = World(kit, kit.job_body())
    for _ in range(4):
        world.step()
    assert sorted(world.pods) == ["demo-rendezvous", "demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert world.body["status"]["phase"] == "Running"
    # an operator restarted mid-job has lost nothing it needs: its status is on the job
    created_before = list(world.creates)
    for _ in range(3):
        d = world.step()
        assert not kinds(d, CreatePod) and not kinds(d, DeletePod)
    # even with the status lost entirely it adopts what exists
    world.body["status"] = {}
    d = world.step()
    assert not kinds(d, CreatePod) and not kinds(d, DeletePod)
    assert world.creates == created_before


def test_started_job_scaled_out_of_range_runs_at_the_bound(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=9, status={"phase": "Running", "scaledTo": 3})
    d = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert d.status["phase"] == "Scaling"
    assert created_names(d) == ["demo-worker-3"]  # clamped to maxReplicas=4
    c = cond(d, "ReplicasOutOfRange")
    assert c["status"] == "True" and "spec.replicaSpecs.Worker.replicas=9" in c["message"]
    assert [e.reason for e in kinds(d, Emit)] == ["ReplicasOutOfRange", "Scaling"]
    body["status"] = d.status
    assert "ReplicasOutOfRange" not in [e.reason for e in kinds(run(body, kit.observed(kit.store())), Emit)]
    body["spec"]["replicaSpecs"]["Worker"]["replicas"] = 4
    back = run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(4))))
    assert cond(back, "ReplicasOutOfRange")["status"] == "False"


def test_failure_message_quotes_the_termination_message(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    msg = "noise\nkelastic-agent: rank 3 (local rank 1) exited with code 2\nworker group failed"
    failed = kit.worker(1, PodPhase.FAILED, exit_code=1, message=msg)
    d = run(body, kit.observed(kit.store(), kit.worker(0), failed, kit.worker(2)))
    text = cond(d, "Failed")["message"]
    assert "rank 3 (local rank 1) exited with code 2" in text and "exited with code 1" in text


def test_failure_message_quotes_the_earliest_failure(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    t = "2026-01-01T00:00:0{}Z"
    peer = "node demo-worker-0: train.py could not run: the rendezvous of the job was closed"
    root = "rank 4 (local rank 0, node demo-worker-2) exited with code 2: ValueError: bad data"
    pods = [
        # index 0 failed later: it only saw the job end
        kit.worker(0, PodPhase.FAILED, exit_code=1, message=peer, finished_at=parse_time(t.format(7))),
        kit.worker(1),
        kit.worker(2, PodPhase.FAILED, exit_code=1, message=root, finished_at=parse_time(t.format(5))),
    ]
    text = cond(run(body, kit.observed(kit.store(), *pods)), "Failed")["message"]
    assert text.startswith("worker pod demo-worker-2 (index 2) exited with code 1: " + root), text
    # within the same second (the API's resolution) the pod naming a failed rank wins
    pods[0] = replace(pods[0], finished_at=parse_time(t.format(5)))
    d = run(body, kit.observed(kit.store(), *pods))
    assert root in cond(d, "Failed")["message"]
    warning = kinds(d, Emit)[-1]
    assert warning.warning and root in warning.message
    # with a known time against an unknown one, the known one is the earlier failure
    pods[2] = replace(pods[2], finished_at=None)
    assert peer in cond(run(body, kit.observed(kit.store(), *pods)), "Failed")["message"]


def test_a_peer_failure_waits_briefly_for_the_root_cause(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 2})
    peer = "node demo-worker-1: train.py could not run: the rendezvous was closed"
    root = "rank 0 (local rank 0, node demo-worker-0) exited with code 2"
    at = timedelta(seconds=1)
    ended = kit.worker(1, PodPhase.FAILED, exit_code=1, message=peer, finished_at=kit.T0 + at)
    # worker 0 still runs: its agent may be about to report why the job closed
    d = run(body, kit.observed(kit.store(), kit.worker(0), ended, at=2))
    assert d.status["phase"] == "Running" and cond(d, "Failed") is None
    assert d.requeue_after is not None and 0 < d.requeue_after <= 4
    # it does, a second later: its root cause is the reason, though it ended later
    root_pod = kit.worker(0, PodPhase.FAILED, exit_code=1, message=root, finished_at=kit.T0 + 2 * at)
    d = run(body, kit.observed(kit.store(), root_pod, ended, at=3))
    assert d.status["phase"] == "Failed"
    assert "demo-worker-0 (index 0)" in cond(d, "Failed")["message"] and root in cond(d, "Failed")["message"]
    # it never does: after the grace the job fails with what is known
    d = run(body, kit.observed(kit.store(), kit.worker(0), ended, at=7))
    assert d.status["phase"] == "Failed" and peer in cond(d, "Failed")["message"]


def test_pod_view_reads_exit_code_and_message() -> None:
    body = {
        "metadata": {
            "name": "demo-worker-1",
            "uid": "u1",
            "labels": {"kelastic.dev/role": "worker", "kelastic.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "uid-demo", "controller": True}],
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"containers": [{"name": "trainer"}, {"name": "side"}]},
        "status": {
            "phase": "Failed",
            "podIP": "127.1.0.9",
            "containerStatuses": [
                {"name": "side", "state": {"terminated": {"exitCode": 0}}},
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "OOMKilled",
                            "message": "bye",
                            "finishedAt": "2026-01-01T00:00:05Z",
                        }
                    },
                },
            ],
        },
    }
    view = pod_view(body)
    assert (view.index, view.phase, view.exit_code, view.reason, view.message) == (
        1,
        PodPhase.FAILED,
        137,
        "OOMKilled",
        "bye",
    )
    assert view.terminating and view.owner_uid == "uid-demo" and view.pod_ip == "127.1.0.9"
    assert view.finished_at is not None and view.finished_at.second == 5


AGENT_REPORT = """
[default] worker group failed
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_19:52:28
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : 2 (pid: 28911)
  error_file: /tmp/x/error.json
  traceback : ValueError: bad batch
============================================================
"""


def test_failure_summary() -> None:
    assert (
        failure_summary(AGENT_REPORT)
        == "rank 3 (local_rank: 1) exitcode 2 (pid: 28911): ValueError: bad batch"
    )
    plain = AGENT_REPORT.replace(
        "  traceback : ValueError: bad batch", "  traceback : Process 28911 exited with code 2"
    )
    assert failure_summary(plain) == "rank 3 (local_rank: 1) exitcode 2 (pid: 28911)"
    assert failure_summary("a\n\nb\nc\nd\n") == "b | c | d"
    assert failure_summary("") is None and failure_summary(None) is None


def test_permanent_failure_names_rank_and_exit_code(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    failed = kit.worker(2, PodPhase.FAILED, exit_code=1, reason="Error", message=AGENT_REPORT)
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), failed))
    message = cond(d, "Failed")["message"]
    assert message.startswith(
        "worker pod demo-worker-2 (index 2) exited with code 1 (Error): rank 3 (local_rank: 1) exitcode 2"
    )


def test_pods_being_removed_decide_nothing(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=2, status={"phase": "Scaling", "scaledTo": 3})
    leaving_ok = kit.worker(2, PodPhase.SUCCEEDED, exit_code=0, terminating=True)
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), leaving_ok))
    assert d.status["phase"] == "Scaling", "a scaled-away pod that exited 0 does not end the job"
    leaving_bad = kit.worker(2, PodPhase.FAILED, exit_code=1)  # not yet marked for deletion
    d = run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1), leaving_bad))
    assert d.status["phase"] != "Failed" and d.status.get("backoffCount", 0) == 0
    assert deleted_names(d) == ["demo-worker-2"]


def test_service_of_an_earlier_job_with_the_same_name_is_not_used(kit: SimpleNamespace) -> None:
    old = ServiceView(name="demo-rendezvous", uid="svc-old", cluster_ip="127.2.0.9", owner_uid="uid-previous")
    d = run(kit.job_body(), kit.observed(services=(old,)))
    assert not kinds(d, CreateService), "the name is taken until the old Service is gone"
    assert created_names(d) == ["demo-rendezvous"]  # the store pod; no workers without an endpoint
    assert "rdzvEndpoint" not in d.status


def test_restarts_count_every_group_restart_whatever_its_cause(kit: SimpleNamespace) -> None:
    """A scale and a deleted pod restart the group without any agent failure: every rendezvous
    round after the first counts (the agents' restart counts and recreated pods are a floor)."""
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "restarts": 0})
    workers = [kit.worker(i) for i in range(3)]
    first = RendezvousView(world_size=3, restarts=0, members=("a", "b", "c"), round=1)
    d = run(body, kit.observed(kit.store(), *workers, rendezvous=first))
    assert d.status["restarts"] == 0  # the group's first start
    fourth = replace(first, round=5)  # scaled up, down, and a pod deleted twice
    body["status"] = run(body, kit.observed(kit.store(), *workers, rendezvous=fourth)).status
    assert body["status"]["restarts"] == 4
    # a recreated store counts rounds from 1 again: the count never goes back
    again = run(body, kit.observed(kit.store(), *workers, rendezvous=replace(first, round=2)))
    assert again.status["restarts"] == 4


def test_phase_conditions_that_are_no_longer_true_stop_saying_what_they_said(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    body["status"] = run(body, kit.observed(services=())).status
    created = cond(run(body, kit.observed(kit.store(PodPhase.PENDING), at=1)), "Created")
    assert created is not None and created["status"] == "True"
    old_message = created["message"]
    body["status"]["phase"] = "Running"
    body["status"]["scaledTo"] = 3
    obs = kit.observed(kit.store(), *(kit.worker(i, ready=True) for i in range(3)), at=5)
    d = run(body, obs)
    created = cond(d, "Created")
    running = cond(d, "Running")
    assert created is not None and running is not None and running["status"] == "True"
    assert created["status"] == "False" and created["message"] != old_message
    assert created["message"] == f"the job is Running: {running['message']}"

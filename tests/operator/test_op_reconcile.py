"""Table tests of the pure reconcile core as a whole (operator/reconcile/__init__.py): a job's
first passes, convergence, what a pass ignores.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kelastic.operator.observed import PodPhase, PodView, pod_view
from kelastic.operator.reconcile import CreatePod, CreateService, Decision, DeletePod, Emit, PublishMembership

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_fresh_job_creates_service_first_then_store_and_workers(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    first = harness.run(body, kit.observed(services=()))
    assert [type(a) for a in first.actions if not isinstance(a, Emit)] == [CreateService, CreatePod]
    assert harness.created_names(first) == ["demo-rendezvous"]  # workers wait for the Service's cluster IP
    assert first.status["phase"] == "Created"
    assert first.status["selector"] == "kelastic.dev/job-name=demo,kelastic.dev/role=worker"
    assert first.status["startTime"] == "2026-01-01T12:00:00Z"
    assert harness.kinds(first, Emit)[0].reason == "WaitingForWorkers"

    body["status"] = first.status
    second = harness.run(body, kit.observed(kit.store(PodPhase.PENDING), at=1))
    assert harness.created_names(second) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert not harness.kinds(second, Emit), "no new Event while the phase stays the same"
    assert not harness.kinds(second, PublishMembership), "the store is not running yet"
    cmd = harness.kinds(second, CreatePod)[0].manifest["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.2.0.5:29400"
    assert cmd[cmd.index("--rdzv-id") + 1] == "uid-demo"


def test_pods_of_another_job_incarnation_are_ignored(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running"})
    stranger = PodView(
        name="demo-worker-7", uid="x", role="worker", index=7, phase=PodPhase.RUNNING, owner_uid="uid-old"
    )
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), stranger))
    assert "demo-worker-7" not in harness.deleted_names(d)


def test_deleting_job_does_nothing(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running"})
    body["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0)))
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
        d = harness.run(self.body, obs)
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
        assert not harness.kinds(d, CreatePod) and not harness.kinds(d, DeletePod)
    # even with the status lost entirely it adopts what exists
    world.body["status"] = {}
    d = world.step()
    assert not harness.kinds(d, CreatePod) and not harness.kinds(d, DeletePod)
    assert world.creates == created_before


def test_phase_conditions_that_are_no_longer_true_stop_saying_what_they_said(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    body["status"] = harness.run(body, kit.observed(services=())).status
    created = harness.cond(harness.run(body, kit.observed(kit.store(PodPhase.PENDING), at=1)), "Created")
    assert created is not None and created["status"] == "True"
    old_message = created["message"]
    body["status"]["phase"] = "Running"
    body["status"]["scaledTo"] = 3
    obs = kit.observed(kit.store(), *(kit.worker(i, ready=True) for i in range(3)), at=5)
    d = harness.run(body, obs)
    created = harness.cond(d, "Created")
    running = harness.cond(d, "Running")
    assert created is not None and running is not None and running["status"] == "True"
    assert created["status"] == "False" and created["message"] != old_message
    assert created["message"] == f"the job is Running: {running['message']}"

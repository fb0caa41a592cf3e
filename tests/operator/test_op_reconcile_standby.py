"""Table tests of a job with hot standbys (spec.standbyReplicas): the pods it runs, the membership
it publishes, its phase, the standbys in its status, its PodGroup.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.observed import PodPhase, RendezvousView
from kelastic.operator.podgroup import GangScheduler, min_member, pod_group
from kelastic.operator.reconcile import CreatePod, PublishMembership
from kelastic.operator.spec import parse_job

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))

RUNNING = {"phase": "Running", "scaledTo": 3, "startTime": "2026-01-01T12:00:00Z"}


def test_standbys_are_pods_past_the_replicas_and_every_running_pod_is_listed(kit: SimpleNamespace) -> None:
    body = kit.job_body(standbyReplicas=1, status=dict(RUNNING))
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert harness.created_names(d) == ["demo-worker-3"]
    obs = kit.observed(kit.store(), *(kit.worker(i) for i in range(4)))
    d = harness.run(body, obs)
    assert not harness.kinds(d, CreatePod)
    (pub,) = harness.kinds(d, PublishMembership)
    # All four are listed (a standby must not wait for a new list to take a lost place);
    # the bounds cap the group at replicas, so the rendezvous parks the fourth.
    assert pub.nodes == tuple(f"demo-worker-{i}" for i in range(4))
    assert (pub.min_nodes, pub.max_nodes) == (2, 3)
    assert d.status["phase"] == "Running"
    cond = harness.cond(d, "Running")
    assert cond is not None and cond["message"] == "4 worker pods running (3 in the group, 1 standby)"


def test_the_group_whole_without_its_standby_is_running_not_restarting(kit: SimpleNamespace) -> None:
    """A member lost: the standby took its place; its replacement pod (the new standby) is pending."""
    body = kit.job_body(standbyReplicas=1, status=dict(RUNNING))
    pods = [kit.worker(i) for i in (0, 1, 3)] + [kit.worker(2, PodPhase.PENDING)]
    d = harness.run(body, kit.observed(kit.store(), *pods))
    assert d.status["phase"] == "Running"


def test_scaling_down_deletes_the_pods_past_replicas_and_standbys(kit: SimpleNamespace) -> None:
    body = kit.job_body(standbyReplicas=1, replicas=2, status=dict(RUNNING))
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(4))))
    assert harness.deleted_names(d) == ["demo-worker-3"]
    (pub,) = harness.kinds(d, PublishMembership)
    assert pub.max_nodes == 2
    assert d.status["phase"] == "Scaling"


def test_status_shows_the_standbys_the_store_reports(kit: SimpleNamespace) -> None:
    body = kit.job_body(standbyReplicas=2, status=dict(RUNNING))
    pods = [kit.worker(i) for i in range(5)]
    members = tuple(f"demo-worker-{i}" for i in range(3))
    rdzv = RendezvousView(world_size=3, restarts=0, members=members, round=1, standbys=("demo-worker-4",))
    d = harness.run(body, kit.observed(kit.store(), *pods, rendezvous=rdzv))
    assert d.status["standbys"] == 1
    # A job without standbys keeps the field out of its status.
    none = RendezvousView(world_size=3, restarts=0, members=members, round=1)
    plain = harness.run(
        kit.job_body(status=dict(RUNNING)), kit.observed(kit.store(), *pods[:3], rendezvous=none)
    )
    assert "standbys" not in plain.status


def test_the_gang_is_the_workers_min_and_standby_pods_belong_to_it(kit: SimpleNamespace) -> None:
    body = kit.job_body(standbyReplicas=2, min_r=2, max_r=4, replicas=3)
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] = "volcano"
    job = parse_job(body)
    assert job.spec is not None, job.error
    assert min_member(job.spec) == 2
    group = pod_group(GangScheduler.VOLCANO, name="demo", namespace="ns", spec=job.spec, owner={})
    assert group["spec"]["minMember"] == 2
    standby = worker_pod(job, 4, endpoint="127.2.0.5:29400", config=BuildConfig())
    assert standby["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo"

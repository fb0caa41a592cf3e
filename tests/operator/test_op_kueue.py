"""Admission by Kueue, decided purely (kelastic.operator.kueue) and applied by the reconcile
core (kelastic.operator.reconcile.queue): table tests, no cluster."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest

from kelastic.operator import kueue, nodeloss
from kelastic.operator.kueue import (
    ClearReservation,
    CreateWorkload,
    DeleteWorkload,
    FinishWorkload,
    Inputs,
    Part,
    WorkloadView,
    plan,
    workload_view,
)
from kelastic.operator.observed import Observed, PodPhase, PodView, ServiceView
from kelastic.operator.reconcile import CreatePod, DeletePod, reconcile
from kelastic.operator.spec import parse_job

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
UID = "0123456789abcdef"


def job(replicas: int = 4, minimum: int = 2, *, queue: str | None = "team", **spec: Any) -> Any:
    labels = {kueue.QUEUE_LABEL: queue} if queue else {}
    return parse_job(
        {
            "apiVersion": "kelastic.dev/v1alpha1",
            "kind": "ElasticJob",
            "metadata": {"name": "train", "namespace": "ns", "uid": UID, "labels": labels},
            "spec": {
                "minReplicas": minimum,
                "maxReplicas": 8,
                "replicaSpecs": {
                    "Worker": {
                        "replicas": replicas,
                        "template": {
                            "spec": {
                                "containers": [
                                    {
                                        "name": "trainer",
                                        "image": "img",
                                        "command": ["python", "train.py"],
                                        "resources": {"requests": {"cpu": "1"}},
                                    }
                                ]
                            }
                        },
                    }
                },
                **spec,
            },
        }
    )


def wl(
    part: Part = Part.BASE,
    seq: int = 0,
    count: int = 4,
    *,
    reserved: int | None = None,
    evicted: tuple[str, str] | None = None,
    finished: bool = False,
    pending: tuple[str, str] | None = None,
    min_count: int | None = 2,
    flavors: tuple[str, ...] = (),
) -> WorkloadView:
    return WorkloadView(
        name=f"w{seq}",
        part=part,
        seq=seq,
        count=count,
        min_count=min_count,
        owner_uid=UID,
        resource_version=f"rv{seq}",
        reserved=reserved,
        admitted=reserved is not None,
        evicted=evicted,
        finished=finished,
        cluster_queue="cq" if reserved is not None else None,
        pending=pending,
        flavors=flavors,
    )


def kinds(result: kueue.QueuePlan) -> list[str]:
    return [type(c).__name__ for c in result.changes]


def test_a_job_without_the_queue_label_is_not_managed() -> None:
    assert plan(job(queue=None), [], Inputs(), NOW) is None


def test_a_new_job_asks_for_min_to_replicas_workers_with_the_templates_requests() -> None:
    result = plan(job(4, 2), [], Inputs(priority=("high", 1000)), NOW)
    assert result is not None and result.grant.admitted == 0 and result.grant.pending == 4
    (create,) = result.changes
    assert isinstance(create, CreateWorkload)
    manifest = create.manifest
    assert manifest["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    (pod_set,) = manifest["spec"]["podSets"]
    assert (pod_set["name"], pod_set["count"], pod_set["minCount"]) == ("workers", 4, 2)
    assert pod_set["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert manifest["spec"]["queueName"] == "team"
    assert manifest["spec"]["priority"] == 1000
    assert manifest["spec"]["priorityClassRef"]["name"] == "high"
    owner = manifest["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ElasticJob", UID, True)


def test_no_min_count_when_the_job_asks_for_exactly_its_minimum() -> None:
    result = plan(job(2, 2), [], Inputs(), NOW)
    assert result is not None
    create = result.changes[0]
    assert isinstance(create, CreateWorkload)
    assert "minCount" not in create.manifest["spec"]["podSets"][0]


@pytest.mark.parametrize(
    ("workloads", "admitted", "pending", "changes"),
    [
        # Pending: Kueue's word is the job's.
        ([wl(pending=("Pending", "insufficient unused quota for cpu, 2 more needed"))], 0, 4, []),
        # Partially admitted at 2 of 4: runs 2, asks for the other 2 through a growth Workload.
        ([wl(reserved=2)], 2, 2, ["CreateWorkload"]),
        # The growth request waits: nothing new.
        ([wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=None, min_count=1)], 2, 2, []),
        # Growth admitted in part (1 of 2): runs 3, asks for the last one.
        (
            [wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=1, min_count=1)],
            3,
            1,
            ["CreateWorkload"],
        ),
        # Everything admitted: nothing pending, nothing to do.
        ([wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=2, min_count=1)], 4, 0, []),
        # A growth request of the wrong size (the job was scaled since): asked again.
        ([wl(reserved=2), wl(Part.GROWTH, 1, 5, reserved=None, min_count=1)], 2, 2, ["DeleteWorkload"]),
    ],
)
def test_the_grant_is_what_kueue_admitted_and_the_rest_is_asked_for(
    workloads: list[WorkloadView], admitted: int, pending: int, changes: list[str]
) -> None:
    result = plan(job(4, 2), workloads, Inputs(), NOW)
    assert result is not None
    assert (result.grant.admitted, result.grant.pending) == (admitted, pending)
    assert kinds(result) == changes


def test_a_growth_request_asks_for_what_is_missing_with_min_count_one() -> None:
    result = plan(job(4, 2), [wl(reserved=2)], Inputs(), NOW)
    assert result is not None
    create = result.changes[0]
    assert isinstance(create, CreateWorkload)
    pod_set = create.manifest["spec"]["podSets"][0]
    assert (pod_set["count"], pod_set["minCount"]) == (2, 1)
    assert create.manifest["metadata"]["labels"][kueue.PART_LABEL] == "growth"


def test_kubectl_scale_beyond_the_grant_waits_for_kueue() -> None:
    """Scaled from 4 to 6 with 4 admitted: still 4 run, 2 are asked for."""
    workloads = [wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=2, min_count=1)]
    result = plan(job(6, 2), workloads, Inputs(), NOW)
    assert result is not None and result.grant.admitted == 4 and result.grant.pending == 2
    assert kinds(result) == ["CreateWorkload"]


def test_a_preempted_growth_workload_shrinks_the_job_and_is_released_once_its_pods_are_gone() -> None:
    workloads = [
        wl(reserved=2),
        wl(Part.GROWTH, 1, 2, reserved=2, evicted=("Preempted", "Preempted to accommodate a workload")),
    ]
    running = plan(job(4, 2), workloads, Inputs(worker_indices=(0, 1, 2, 3)), NOW)
    assert running is not None and running.grant.admitted == 2
    assert "ClearReservation" not in kinds(running)  # workers 2 and 3 still exist
    gone = plan(job(4, 2), workloads, Inputs(worker_indices=(0, 1)), NOW)
    assert gone is not None
    clear = next(c for c in gone.changes if isinstance(c, ClearReservation))
    assert clear.name == "w1" and clear.status["admission"] is None
    conditions = {c["type"]: c for c in clear.status["conditions"]}
    assert conditions["QuotaReserved"]["status"] == "False"
    assert conditions["Admitted"]["status"] == "False"
    assert conditions["Requeued"]["status"] == "True"


def test_a_preempted_base_suspends_the_whole_job_until_admitted_again() -> None:
    workloads = [
        wl(reserved=4, evicted=("Preempted", "Preempted to accommodate a workload")),
    ]
    result = plan(job(4, 2), workloads, Inputs(worker_indices=(0, 1, 2, 3)), NOW)
    assert result is not None and result.grant.admitted == 0 and result.grant.evicted
    assert kinds(result) == []
    released = plan(job(4, 2), workloads, Inputs(), NOW)
    assert released is not None and kinds(released) == ["ClearReservation"]


def test_a_finished_job_finishes_every_workload_at_once() -> None:
    workloads = [wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=None, min_count=1)]
    result = plan(job(4, 2), workloads, Inputs(finished=True, succeeded=True), NOW)
    assert result is not None
    assert kinds(result) == ["FinishWorkload", "FinishWorkload"]
    finish = result.changes[0]
    assert isinstance(finish, FinishWorkload)
    (cond,) = finish.status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Finished", "True", "Succeeded")


def test_a_job_scaled_down_gives_back_whole_growth_workloads_it_no_longer_needs() -> None:
    workloads = [wl(reserved=2), wl(Part.GROWTH, 1, 1, reserved=1), wl(Part.GROWTH, 2, 1, reserved=1)]
    result = plan(job(3, 2), workloads, Inputs(), NOW)
    assert result is not None
    assert [(type(c).__name__, getattr(c, "name", "")) for c in result.changes] == [("FinishWorkload", "w2")]


def test_a_pending_base_of_an_old_size_is_asked_for_again() -> None:
    result = plan(job(6, 2), [wl(count=4)], Inputs(), NOW)
    assert result is not None
    assert [type(c) for c in result.changes] == [DeleteWorkload]


def test_workloads_ready_once_every_admitted_worker_is() -> None:
    workloads = [wl(reserved=2), wl(Part.GROWTH, 1, 2, reserved=1, min_count=1)]
    result = plan(job(4, 2), workloads, Inputs(worker_indices=(0, 1, 2), ready_workers=3), NOW)
    assert result is not None
    assert [r.name for r in result.pods_ready] == ["w0", "w1"]
    assert plan(job(4, 2), workloads, Inputs(ready_workers=2), NOW).pods_ready == ()  # type: ignore[union-attr]


def test_workload_view_reads_kueues_status() -> None:
    body = {
        "metadata": {
            "name": "w",
            "resourceVersion": "7",
            "labels": {kueue.PART_LABEL: "base", kueue.SEQ_LABEL: "0"},
            "ownerReferences": [{"uid": UID, "controller": True}],
        },
        "spec": {"podSets": [{"name": "workers", "count": 4, "minCount": 2}]},
        "status": {
            "admission": {
                "clusterQueue": "cq",
                "podSetAssignments": [
                    {"name": "workers", "count": 3, "flavors": {"cpu": "on-demand", "memory": "on-demand"}}
                ],
            },
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": ""},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""},
            ],
        },
    }
    view = workload_view(body)
    assert view is not None
    assert (view.reserved, view.granted, view.count, view.min_count, view.cluster_queue) == (3, 3, 4, 2, "cq")
    assert view.flavors == ("on-demand",)
    assert workload_view({"metadata": {"labels": {}}}) is None


# ------------------------------------------------------------ the reconcile core


def worker(index: int, *, ready: bool = True) -> PodView:
    return PodView(
        name=f"train-worker-{index}",
        uid=f"u{index}",
        role="worker",
        index=index,
        phase=PodPhase.RUNNING,
        ready=ready,
        owner_uid=UID,
    )


def test_a_queued_job_creates_no_pod_and_says_why_it_waits() -> None:
    grant = kueue.Grant("team", 0, 4, reason="Pending", message="insufficient unused quota for cpu")
    decision = reconcile(job(4, 2), Observed(now=NOW, queue=grant))
    assert not [a for a in decision.actions if isinstance(a, CreatePod)]
    assert decision.status["phase"] == "Queued"
    admitted = next(c for c in decision.status["conditions"] if c["type"] == "Admitted")
    assert admitted["status"] == "False" and "insufficient unused quota for cpu" in admitted["message"]
    assert "LocalQueue team" in admitted["message"]
    assert decision.status["queue"]["summary"] == "team: 0 admitted, 4 pending"


def test_an_admitted_job_runs_no_more_workers_than_kueue_granted() -> None:
    grant = kueue.Grant("team", 2, 2, cluster_queue="cq")
    observed = Observed(now=NOW, pods=(worker(0), worker(1), worker(2), worker(3)), queue=grant)
    decision = reconcile(job(4, 2), observed)
    deleted = sorted(a.name for a in decision.actions if isinstance(a, DeletePod))
    assert deleted == ["train-worker-2", "train-worker-3"]
    assert decision.status["queue"]["admitted"] == 2
    # No failure counted: the pods are scaled away, not failed.
    assert not decision.status.get("backoffCount")


def test_an_evicted_job_deletes_its_pods_and_waits_to_be_admitted_again() -> None:
    grant = kueue.Grant("team", 0, 4, reason="Preempted", message="Preempted to accommodate", evicted=True)
    decision = reconcile(job(4, 2), Observed(now=NOW, pods=(worker(0), worker(1)), queue=grant))
    assert sorted(a.name for a in decision.actions if isinstance(a, DeletePod)) == [
        "train-worker-0",
        "train-worker-1",
    ]
    assert decision.status["phase"] == "Queued"
    phase = next(c for c in decision.status["conditions"] if c["type"] == "Queued")
    assert phase["reason"] == "Preempted"


# ------------------------------------------------------------ where the admitted workers run

SPOT = kueue.FlavorView(
    node_labels={"pool": "spot"},
    tolerations=({"key": "spot", "operator": "Exists", "effect": "NoSchedule"},),
)
ON_DEMAND = kueue.FlavorView(node_labels={"pool": "on-demand", "zone": "a"})


def test_each_admitted_share_places_its_workers_on_its_flavors_nodes() -> None:
    """As Kueue's job integrations do: a flavor's nodeLabels and tolerations go to the pods admitted to it."""
    workloads = [
        wl(Part.BASE, 0, 4, reserved=2, flavors=("on-demand",)),
        wl(Part.GROWTH, 1, 2, reserved=1, min_count=1, flavors=("spot",)),
    ]
    flavors = {"on-demand": ON_DEMAND, "spot": SPOT}
    result = plan(job(4, 2), workloads, Inputs(flavors=flavors), NOW)
    assert result is not None
    grant = result.grant
    assert [(pl.count, pl.flavors) for pl in grant.placements] == [(2, ("on-demand",)), (1, ("spot",))]
    assert [grant.placement_of(i).flavors for i in range(3)] == [("on-demand",)] * 2 + [("spot",)]  # type: ignore[union-attr]
    assert grant.placement_of(3) is None
    # The pods: the template's own selector and tolerations kept, the flavor's added (its value wins).
    template = {
        "spec": {
            "nodeSelector": {"pool": "any", "disk": "ssd"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
    spot = kueue.with_placement(template, grant.placement_of(2))
    assert spot["spec"]["nodeSelector"] == {"pool": "spot", "disk": "ssd"}
    assert spot["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert template["spec"]["nodeSelector"]["pool"] == "any"  # not changed in place
    assert kueue.with_placement(template, None) == template


def test_a_flavor_not_read_adds_nothing_and_an_evicted_share_places_no_worker() -> None:
    workloads = [
        wl(Part.BASE, 0, 4, reserved=2, flavors=("gone",)),
        wl(Part.GROWTH, 1, 2, reserved=2, min_count=1, flavors=("spot",), evicted=("Preempted", "")),
    ]
    result = plan(job(4, 2), workloads, Inputs(worker_indices=(0, 1, 2, 3), flavors={"spot": SPOT}), NOW)
    assert result is not None
    (share,) = result.grant.placements
    assert (share.count, dict(share.node_selector), share.tolerations) == (2, {}, ())


def test_the_workers_kueue_admitted_are_created_with_their_placement(kit: Any) -> None:
    grant = kueue.Grant(
        "team",
        3,
        1,
        placements=(
            kueue.Placement(2, {"pool": "on-demand"}, (), ("on-demand",)),
            kueue.Placement(1, {"pool": "spot"}, SPOT.tolerations, ("spot",)),
        ),
    )
    store = replace(kit.store(job="train"), owner_uid=UID)
    service = ServiceView("train-rendezvous", "svc", "127.2.0.5", owner_uid=UID)
    observed = Observed(now=NOW, pods=(store, worker(0)), services=(service,), queue=grant)
    decision = reconcile(job(4, 2), observed)
    created = {
        a.manifest["metadata"]["name"]: a.manifest["spec"]
        for a in decision.actions
        if isinstance(a, CreatePod) and a.manifest["metadata"]["labels"].get("kelastic.dev/role") == "worker"
    }
    assert sorted(created) == ["train-worker-1", "train-worker-2"]
    assert created["train-worker-1"]["nodeSelector"] == {"pool": "on-demand"}
    # Besides the node-loss tolerations every worker gets (kelastic.operator.nodeloss).
    lost = nodeloss.with_node_loss_tolerations([], nodeloss.DEFAULT_TOLERATION_SECONDS)
    assert created["train-worker-1"]["tolerations"] == lost
    assert created["train-worker-2"]["nodeSelector"] == {"pool": "spot"}
    assert created["train-worker-2"]["tolerations"] == lost + list(SPOT.tolerations)

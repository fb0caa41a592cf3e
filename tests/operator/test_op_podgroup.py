"""Gang scheduling: the PodGroups (Volcano, scheduler-plugins) and the worker pods that name them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.builders import BuildConfig, owner_reference, store_pod, worker_pod
from kelastic.operator.podgroup import GangScheduler, gang_scheduler, min_member, pod_group, pod_group_path
from kelastic.operator.reconcile import EnsureObject, reconcile
from kelastic.operator.spec import parse_job


def job_with(kit: SimpleNamespace, scheduler: str | None, **spec: Any) -> Any:
    body = kit.job_body(**spec)
    if scheduler is not None:
        body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] = scheduler
    job = parse_job(body)
    assert job.spec is not None, job.error
    return job


def test_the_template_scheduler_picks_the_podgroup_kind(kit: SimpleNamespace) -> None:
    assert gang_scheduler(job_with(kit, "volcano").spec) is GangScheduler.VOLCANO
    assert gang_scheduler(job_with(kit, "scheduler-plugins-scheduler").spec) is GangScheduler.COSCHEDULING
    assert (
        gang_scheduler(
            job_with(
                kit,
                "my-gang",
            ).spec,
            "my-gang",
        )
        is GangScheduler.COSCHEDULING
    )
    assert gang_scheduler(job_with(kit, None).spec) is None
    assert gang_scheduler(job_with(kit, "default-scheduler").spec) is None


def test_min_member_is_min_replicas_by_default_and_never_above_the_replicas(kit: SimpleNamespace) -> None:
    assert min_member(job_with(kit, "volcano", min_r=2, max_r=4, replicas=3).spec) == 2  # not 3, not 3+store
    policy = {"minAvailable": 4}
    assert (
        min_member(job_with(kit, "volcano", min_r=2, max_r=4, replicas=4, schedulingPolicy=policy).spec) == 4
    )
    assert (
        min_member(job_with(kit, "volcano", min_r=2, max_r=4, replicas=3, schedulingPolicy=policy).spec) == 3
    )
    bad = parse_job(kit.job_body(min_r=1, max_r=2, replicas=2, schedulingPolicy={"minAvailable": 3}))
    assert bad.error is not None and "minAvailable" in str(bad.error)


def test_volcano_podgroup_and_members(kit: SimpleNamespace) -> None:
    policy = {"queue": "research", "priorityClass": "high", "scheduleTimeoutSeconds": 60}
    job = job_with(kit, "volcano", schedulingPolicy=policy)
    group = pod_group(
        GangScheduler.VOLCANO, name="demo", namespace="ns", spec=job.spec, owner=owner_reference(job)
    )
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["kind"] == "PodGroup"
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert group["spec"] == {"minMember": 2, "queue": "research", "priorityClassName": "high"}
    pod = worker_pod(job, 0, endpoint="h:1", config=BuildConfig())
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo"
    assert pod["spec"]["schedulerName"] == "volcano"
    # the store is not a member: default scheduler, no group mark, not counted in minMember
    store = store_pod(job, config=BuildConfig())
    assert "schedulerName" not in store["spec"]
    assert "scheduling.k8s.io/group-name" not in (store["metadata"].get("annotations") or {})


def test_coscheduling_podgroup_and_members(kit: SimpleNamespace) -> None:
    job = job_with(
        kit, "scheduler-plugins-scheduler", schedulingPolicy={"scheduleTimeoutSeconds": 60, "queue": "q"}
    )
    group = pod_group(
        GangScheduler.COSCHEDULING, name="demo", namespace="ns", spec=job.spec, owner=owner_reference(job)
    )
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 60}
    pod = worker_pod(job, 1, endpoint="h:1", config=BuildConfig())
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
    assert (
        pod_group_path(GangScheduler.COSCHEDULING, "ns")
        == "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/ns/podgroups"
    )


def test_reconcile_ensures_the_podgroup_before_creating_pods(kit: SimpleNamespace) -> None:
    decision = reconcile(job_with(kit, "volcano"), kit.observed(kit.store()))
    kinds = [type(a).__name__ for a in decision.actions]
    ensure = next(a for a in decision.actions if isinstance(a, EnsureObject) and a.key.endswith("/podgroup"))
    assert ensure.manifest["spec"]["minMember"] == 2
    assert kinds.index("EnsureObject") < kinds.index("CreatePod")
    plain = reconcile(job_with(kit, None), kit.observed(kit.store()))
    assert not [a for a in plain.actions if isinstance(a, EnsureObject)]


@pytest.mark.parametrize("kind", list(GangScheduler))
def test_podgroup_paths_name_the_right_group(kind: GangScheduler) -> None:
    assert pod_group_path(kind, "ns").endswith("/namespaces/ns/podgroups")

"""Gang scheduling: the PodGroups (Volcano, scheduler-plugins) and the worker pods that name them."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.builders import BuildConfig, owner_reference, store_pod, worker_pod
from kelastic.operator.podgroup import GangScheduler, gang_scheduler, min_member, pod_group, pod_group_path
from kelastic.operator.reconcile import EnsureObject, reconcile
from kelastic.operator.spec import parse_job

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


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


def test_kubernetes_podgroup_where_the_api_server_serves_it(kit: SimpleNamespace) -> None:
    """kube-scheduler's own gang: only where discovery found the API, never over a named gang scheduler."""
    plain = job_with(kit, None, min_r=2, max_r=4, replicas=3)
    assert gang_scheduler(plain.spec, kubernetes=True) is GangScheduler.KUBERNETES
    assert (
        gang_scheduler(job_with(kit, "default-scheduler").spec, kubernetes=True) is GangScheduler.KUBERNETES
    )
    assert gang_scheduler(job_with(kit, "volcano").spec, kubernetes=True) is GangScheduler.VOLCANO
    assert gang_scheduler(job_with(kit, "scheduler-plugins-scheduler").spec, kubernetes=True) is (
        GangScheduler.COSCHEDULING
    )
    group = pod_group(
        GangScheduler.KUBERNETES, name="demo", namespace="ns", spec=plain.spec, owner=owner_reference(plain)
    )
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1" and group["kind"] == "PodGroup"
    # minCount is minReplicas: the third replica is placed when it fits, not with the gang
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 2}}}
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert (
        pod_group_path(GangScheduler.KUBERNETES, "ns")
        == "/apis/scheduling.k8s.io/v1beta1/namespaces/ns/podgroups"
    )
    pod = worker_pod(plain, 2, endpoint="h:1", config=BuildConfig(kubernetes_gang=True))
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "demo"}
    assert "scheduling.x-k8s.io/pod-group" not in pod["metadata"]["labels"]
    assert "scheduling.k8s.io/group-name" not in pod["metadata"].get("annotations", {})
    assert "schedulingGroup" not in worker_pod(plain, 0, endpoint="h:1", config=BuildConfig())["spec"]
    # the store stays outside the gang
    assert "schedulingGroup" not in store_pod(plain, config=BuildConfig(kubernetes_gang=True))["spec"]


def test_kubernetes_podgroup_takes_the_pods_priority_class_not_volcanos(kit: SimpleNamespace) -> None:
    """kube-scheduler refuses a group whose priority differs from its pods': the template's class counts."""
    job = job_with(kit, None, schedulingPolicy={"priorityClass": "volcano-only", "scheduleTimeoutSeconds": 9})
    group = pod_group(GangScheduler.KUBERNETES, name="demo", namespace="ns", spec=job.spec, owner={})
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 2}}}
    body = kit.job_body()
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["priorityClassName"] = "research"
    classed = parse_job(body)
    assert classed.spec is not None
    group = pod_group(GangScheduler.KUBERNETES, name="demo", namespace="ns", spec=classed.spec, owner={})
    assert group["spec"]["priorityClassName"] == "research"


def test_reconcile_ensures_the_kubernetes_podgroup_when_served(kit: SimpleNamespace) -> None:
    from kelastic.operator.reconcile import ReconcileConfig

    served = ReconcileConfig(build=BuildConfig(kubernetes_gang=True))
    decision = reconcile(job_with(kit, None, replicas=3), kit.observed(kit.store()), served)
    ensure = next(a for a in decision.actions if isinstance(a, EnsureObject) and a.key.endswith("/podgroup"))
    assert ensure.path == "/apis/scheduling.k8s.io/v1beta1/namespaces/ns/podgroups"
    assert ensure.manifest["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    assert "minCount 2" in ensure.message
    kinds = [type(a).__name__ for a in decision.actions]
    assert kinds.index("EnsureObject") < kinds.index("CreatePod")
    workers = [
        a.manifest
        for a in decision.actions
        if type(a).__name__ == "CreatePod"
        and a.manifest["metadata"]["labels"].get("kelastic.dev/role") == "worker"
    ]
    assert workers and all(w["spec"]["schedulingGroup"] == {"podGroupName": "demo"} for w in workers)


class GroupKube:
    """Creates pods; answers the PodGroup's create with ``group_status`` (201 when None), its
    patch with ``patch_status`` (200 when None)."""

    def __init__(
        self,
        group_status: int | None = None,
        patch_status: int | None = None,
        existing: dict[str, Any] | None = None,
    ) -> None:
        self.group_status = group_status
        self.patch_status = patch_status
        #: What a GET of the PodGroup answers (after a 409).
        self.existing = existing or {"metadata": {"name": "demo"}}
        self.pods: list[str] = []
        self.requests: list[tuple[str, str]] = []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        from kelastic.operator.kube import ApiError

        self.requests.append((method, path))
        if method == "GET":
            return self.existing
        status = self.group_status if method == "POST" else self.patch_status
        if status is not None:
            raise ApiError(status, "Refused", "no")
        return dict(body or {})

    def create(self, namespace: str, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        if plural == "pods":
            self.pods.append(manifest["metadata"]["name"])
        return {
            **manifest,
            "metadata": {**manifest["metadata"], "uid": f"uid-{manifest['metadata']['name']}"},
        }


def apply_pass(
    kit: SimpleNamespace, kube: GroupKube, executor: Any = None
) -> tuple[Any, list[tuple[str, str]]]:
    from kelastic.operator.reconcile import ReconcileConfig

    job = job_with(kit, None, replicas=3)
    decision = reconcile(
        job, kit.observed(kit.store()), ReconcileConfig(build=BuildConfig(kubernetes_gang=True))
    )
    return harness.apply_decision(kube, job, kit.job_body(replicas=3), decision, executor)


def test_workers_wait_for_a_podgroup_that_cannot_be_made(kit: SimpleNamespace) -> None:
    """A worker naming a missing group would never be scheduled: none is created, the pass retries."""
    refused = GroupKube(group_status=403)
    executor, posted = apply_pass(kit, refused)
    assert executor.failed and refused.pods == []
    (failure,) = [m for r, m in posted if r == "FailedCreate"]
    assert "PodGroup demo for kubernetes" in failure and "worker pods wait for it" in failure
    kube = GroupKube()
    executor, posted = apply_pass(kit, kube)
    assert not executor.failed and kube.pods == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert ("POST", "/apis/scheduling.k8s.io/v1beta1/namespaces/ns/podgroups") in kube.requests


def test_a_podgroup_that_exists_but_cannot_be_patched_keeps_the_workers_coming(kit: SimpleNamespace) -> None:
    kube = GroupKube(group_status=409, patch_status=422)
    _, posted = apply_pass(kit, kube)
    assert kube.pods == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    (failure,) = [m for r, m in posted if r == "FailedCreate"]
    assert "worker pods wait" not in failure


@pytest.mark.parametrize(
    "left",
    [
        {"metadata": {"name": "demo", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
        {"metadata": {"name": "demo", "ownerReferences": [{"uid": "uid-earlier", "controller": True}]}},
    ],
)
def test_a_podgroup_an_earlier_job_of_the_same_name_left_is_waited_for_not_taken_over(
    kit: SimpleNamespace, left: dict[str, Any]
) -> None:
    """Deleted and applied again at once: the earlier job's PodGroup (kept by its protection
    finalizer until its pods are gone) must not count as this job's, or the new workers would
    name a group the garbage collector then removes."""
    import time as clock

    from kelastic.operator import executor as module

    kube = GroupKube(group_status=409, existing=left)
    executor, posted = apply_pass(kit, kube)
    assert kube.pods == [] and executor.failed  # retried soon, by the job's back-off
    assert ("PATCH", "/apis/scheduling.k8s.io/v1beta1/namespaces/ns/podgroups/demo") not in kube.requests
    assert not [r for r, _ in posted if r == "FailedCreate"]  # waiting is not a failure
    # Within the wait nothing is asked again; once the earlier one is gone the create succeeds.
    kube.requests.clear()
    executor.failed.clear()
    apply_pass(kit, kube, executor)
    assert kube.requests == [] and kube.pods == []
    executor._ensure_retry = {k: clock.monotonic() - 1 for k in executor._ensure_retry}
    kube.group_status = None
    apply_pass(kit, kube, executor)
    assert kube.pods == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert module.ENSURE_PREDECESSOR_SECONDS <= 5

"""Policy: the PodGroup of a gang-scheduled job, before its pods."""

from __future__ import annotations

from kelastic.operator import builders, podgroup
from kelastic.operator.reconcile.actions import EnsureObject
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """With a gang scheduler (the template's ``schedulerName``, else kube-scheduler's own where the
    API server serves its PodGroups): the job's PodGroup, before its pods, kept in step with
    ``spec.schedulingPolicy`` and the replicas (``kelastic.operator.podgroup``)."""
    build = p.config.build
    kind = podgroup.gang_scheduler(job.spec, build.coscheduling_scheduler, kubernetes=build.kubernetes_gang)
    if kind is None:
        return Next.CONTINUE
    meta = p.job.meta
    manifest = podgroup.pod_group(
        kind, name=meta.name, namespace=meta.namespace, spec=job.spec, owner=builders.owner_reference(p.job)
    )
    p.actions.append(
        EnsureObject(
            reason="PodGroup",
            message=f"PodGroup {meta.name} for {kind.value}: {podgroup.MIN_FIELD[kind]} {podgroup.min_member(job.spec)}",
            path=podgroup.pod_group_path(kind, meta.namespace),
            manifest=manifest,
            key=f"{meta.uid}/podgroup",
            workers_wait=True,
        )
    )
    return Next.CONTINUE

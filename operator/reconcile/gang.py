"""Policy: the PodGroup of a gang-scheduled job, before its pods."""

from __future__ import annotations

from kelastic.operator import builders, podgroup
from kelastic.operator.reconcile.actions import EnsureObject
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """With a gang scheduler (the template's ``schedulerName``): the job's PodGroup, before its
    pods, kept in step with ``spec.schedulingPolicy`` and the replicas (``kelastic.operator.podgroup``)."""
    kind = podgroup.gang_scheduler(job.spec, p.config.build.coscheduling_scheduler)
    if kind is None:
        return Next.CONTINUE
    meta = p.job.meta
    manifest = podgroup.pod_group(
        kind, name=meta.name, namespace=meta.namespace, spec=job.spec, owner=builders.owner_reference(p.job)
    )
    p.actions.append(
        EnsureObject(
            reason="PodGroup",
            message=f"PodGroup {meta.name} for {kind.value}: minMember {manifest['spec']['minMember']}",
            path=podgroup.pod_group_path(kind, meta.namespace),
            manifest=manifest,
            key=f"{meta.uid}/podgroup",
        )
    )
    return Next.CONTINUE

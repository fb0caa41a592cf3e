"""Policy: the job's Secret exists before the first of its worker pods (kelastic.operator.jobsecret)."""

from __future__ import annotations

from kelastic.operator import builders, jobsecret
from kelastic.operator.reconcile.actions import CreateSecret
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Ask for the job's Secret in a pass that will create worker pods while the job has none.

    Never while a worker pod exists (even one being deleted): a Secret made afresh then would
    give new pods another key than their running peers'.
    """
    if not job.workers and job.endpoint is not None and job.spec.replicas > 0:
        manifest = jobsecret.secret_manifest(p.job, builders.owner_reference(p.job))
        p.actions.append(
            CreateSecret(
                reason="CreateJobSecret",
                message=f"creating Secret {manifest['metadata']['name']}: the key of the job's agents",
                manifest=manifest,
            )
        )
    return Next.CONTINUE

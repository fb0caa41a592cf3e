"""Policy: the job's Secret exists before a worker pod that mounts it (kelastic.operator.jobsecret)."""

from __future__ import annotations

from kelastic.agent import contract
from kelastic.operator import builders, jobsecret
from kelastic.operator.reconcile.actions import CreatePod, CreateSecret
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Ask for the job's Secret in a pass that creates worker pods while no worker pod holds the key.

    Never while one does (even one being deleted): a Secret made afresh then would give new
    pods another key than their running peers'. A create that finds the Secret keeps it, so
    a job whose pods all went (a restart of every pod, a resume) keeps its key too.
    """
    creates = any(
        isinstance(a, CreatePod)
        and a.manifest["metadata"]["labels"].get(contract.LABEL_ROLE) == contract.ROLE_WORKER
        for a in p.actions
    )
    if creates and not any(w.holds_secret for w in job.workers):
        manifest = jobsecret.secret_manifest(p.job, builders.owner_reference(p.job))
        p.actions.append(
            CreateSecret(
                reason="CreateJobSecret",
                message=f"creating Secret {manifest['metadata']['name']}: the key of the job's agents",
                manifest=manifest,
            )
        )
    return Next.CONTINUE

"""Policy: the NetworkPolicy that admits only the job's pods (and the operator) to its store."""

from __future__ import annotations

from kelastic.operator import netpol
from kelastic.operator.reconcile.actions import EnsureObject
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Ensure the NetworkPolicy that admits only the job's pods (and the operator) to its store."""
    config = p.config.network_policy
    if config.enabled and not job.spec.rdzv_endpoint:
        manifest = netpol.store_network_policy(p.job, port=p.config.build.rdzv_port, config=config)
        p.actions.append(
            EnsureObject(
                reason="CreateNetworkPolicy",
                message=f"creating NetworkPolicy {manifest['metadata']['name']}: only the job's pods reach its store",
                path=netpol.network_policy_path(p.job.meta.namespace),
                manifest=manifest,
                key=f"{p.job.meta.uid}/networkpolicy",
            )
        )
    return Next.CONTINUE

"""Policy: the NetworkPolicies that admit only the job's pods (and the operator) to its workers and store."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kelastic.operator import netpol
from kelastic.operator.reconcile.actions import EnsureObject
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Ensure the workers' NetworkPolicy, and the store's where the operator runs the store,
    before the first pod is created. Fail closed: while a policy cannot be made (no
    permission, a quota, an API the cluster does not serve) no worker pod is created, and
    the Event says why; a policy made once (by this run or an earlier one) keeps them coming."""
    config = p.config.network_policy
    if not config.enabled:
        return Next.CONTINUE
    build = p.config.build
    _ensure(p, netpol.workers_network_policy(p.job, health_port=build.health_port, config=config), "workers")
    if not job.spec.rdzv_endpoint:
        _ensure(p, netpol.store_network_policy(p.job, port=build.rdzv_port, config=config), "store")
    return Next.CONTINUE


def _ensure(p: Pass, manifest: Mapping[str, Any], what: str) -> None:
    name = manifest["metadata"]["name"]
    p.actions.append(
        EnsureObject(
            reason="CreateNetworkPolicy",
            message=f"creating NetworkPolicy {name}: only the job's pods reach its {what}",
            path=netpol.network_policy_path(p.job.meta.namespace),
            manifest=manifest,
            key=f"{p.job.meta.uid}/networkpolicy-{what}",
            workers_wait=True,
        )
    )

"""Policy: publish the running workers within range as the rendezvous membership.

Every running worker pod is listed, standbys too: the rendezvous waits for listed
pods, and a standby that takes a lost member's place must not wait for a new list.
The size bounds are ``minReplicas`` and ``replicas`` (not ``maxReplicas``: the group
takes ``replicas`` of the listed pods, and the pods past it park as standbys).
"""

from __future__ import annotations

from kelastic.operator import builders
from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile.actions import PublishMembership
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """The running workers within range are the ones the rendezvous waits for: publish them."""
    spec = job.spec
    job.running = sorted(
        (
            w
            for w in job.workers
            if w.phase is PodPhase.RUNNING
            and not w.terminating
            and w.index is not None
            and w.index < spec.pods
        ),
        key=lambda w: w.index or 0,
    )
    if job.endpoint is not None and builders.uses_control(spec) and job.store_id is not None:
        p.actions.append(
            PublishMembership(
                reason="Membership",
                message=f"expected members: {', '.join(w.name for w in job.running) or 'none'}",
                endpoint=job.endpoint,
                run_id=p.job.meta.uid,
                nodes=tuple(w.name for w in job.running),
                min_nodes=spec.min_replicas,
                max_nodes=spec.replicas,
                store_id=job.store_id,
            )
        )
    return Next.CONTINUE

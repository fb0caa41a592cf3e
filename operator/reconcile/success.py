"""Policy: the first wanted worker to succeed ends the job; the others get ``success_grace``."""

from __future__ import annotations

from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, seconds_since
from kelastic.operator.reconcile.finish import finish
from kelastic.operator.status import Phase


def step(p: Pass, job: ActiveJob) -> Next:
    """The first wanted worker to succeed ends the job; the others get a grace period."""
    succeeded = [w for w in job.wanted if w.phase is PodPhase.SUCCEEDED]
    if not succeeded:
        return Next.CONTINUE
    first = min((w.finished_at or p.now) for w in succeeded)
    still = [w for w in job.workers if w.active]
    waited = seconds_since(p.now, first)
    if not still or waited >= p.config.success_grace:
        names = ", ".join(sorted(w.name for w in succeeded))
        finish(
            p, Phase.SUCCEEDED, "JobSucceeded", f"training finished: {names} succeeded", job.spec, job.workers
        )
    else:
        p.after(p.config.success_grace - waited)
    return Next.STOP

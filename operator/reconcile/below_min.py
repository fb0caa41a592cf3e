"""Policy: fail the job when fewer than minReplicas workers ran for longer than the timeout."""

from __future__ import annotations

from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, seconds_since
from kelastic.operator.reconcile.finish import finish
from kelastic.operator.spec import format_time, parse_time
from kelastic.operator.status import Phase


def step(p: Pass, job: ActiveJob) -> Next:
    """Fail the job when fewer than minReplicas workers ran for longer than the timeout."""
    spec = job.spec
    count = len(job.running)
    if count >= spec.min_replicas:
        p.status.below_min_since = None
        return Next.CONTINUE
    since = parse_time(p.status.below_min_since)
    if since is None:
        since = p.now
        p.status.below_min_since = format_time(p.now)
    timeout = (
        spec.min_replicas_timeout if spec.min_replicas_timeout is not None else p.config.min_replicas_timeout
    )
    waited = seconds_since(p.now, since)
    if waited >= timeout:
        message = (
            f"only {count} of spec.minReplicas={spec.min_replicas} worker pods were running for {waited:.0f}s "
            f"(limit {timeout:.0f}s)"
        )
        finish(p, Phase.FAILED, "NotEnoughWorkers", message, spec, job.workers)
        return Next.STOP
    p.after(timeout - waited)
    return Next.CONTINUE

"""Policy: record the job's start; fail it past ``spec.activeDeadlineSeconds``."""

from __future__ import annotations

from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, seconds_since
from kelastic.operator.reconcile.finish import finish
from kelastic.operator.spec import format_time, parse_time
from kelastic.operator.status import Phase


def step(p: Pass, job: ActiveJob) -> Next:
    """Record the start; fail the job past ``spec.activeDeadlineSeconds``."""
    start = parse_time(p.status.start_time)
    if start is None:
        start = p.now
        p.status.start_time = format_time(p.now)
    limit = job.spec.active_deadline_seconds
    if limit is None:
        return Next.CONTINUE
    left = limit - seconds_since(p.now, start)
    if left <= 0:
        message = f"the job was active longer than spec.activeDeadlineSeconds={limit}"
        finish(p, Phase.FAILED, "DeadlineExceeded", message, job.spec, job.workers)
        return Next.STOP
    p.after(left)
    return Next.CONTINUE

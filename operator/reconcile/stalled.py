"""Policy: the ``Stalled`` condition from the hangs the agents report."""

from __future__ import annotations

from kelastic.operator import stall
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """With ``spec.hangTimeoutSeconds``: the ``Stalled`` condition (and an Event) names the ranks
    of the latest hang the agents reported through the store (``kelastic.operator.stall``)."""
    timeout = job.spec.hang_timeout_seconds
    rdzv = p.observed.rendezvous
    if timeout is None or rdzv is None:
        return Next.CONTINUE  # no figures this pass: the condition stays as it was
    latest = stall.summarize(rdzv.hangs, timeout)
    if latest is not None and p.now.timestamp() - latest.at < stall.remembered_for(timeout):
        p.condition(stall.CONDITION_STALLED, True, "NoProgress", latest.message(timeout), warning=True)
        p.after(stall.remembered_for(timeout) - (p.now.timestamp() - latest.at))
    elif p.was_true(stall.CONDITION_STALLED):
        p.condition(stall.CONDITION_STALLED, False, "ProgressResumed", "no hang reported recently")
    return Next.CONTINUE

"""Policy: evicted or preempted workers shrink the job and are recreated, not counted as
failures.
"""

from __future__ import annotations

from kelastic.operator import disruption
from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Evicted or preempted workers are no failure of the training: the job shrinks, the pod is
    recreated when it can be, ``backoffLimit`` is not touched; a ``Disrupted`` condition and an
    Event name the pod and the reason (``kelastic.operator.disruption``)."""
    disrupted = [w for w in job.workers if w.disruption is not None and (w.terminating or w in job.wanted)]
    for pod in disrupted:
        if pod.terminating:
            continue  # deleted already (the eviction API, the scheduler): its index is recreated when it is gone
        assert pod.disruption is not None
        job.recreating.append(pod)
        p.delete_pod(
            pod, "RecreateEvicted", f"{disruption.describe(pod.name, pod.disruption)}; recreating it"
        )
    job.wanted = [w for w in job.wanted if w.disruption is None]
    if disrupted:
        described = "; ".join(disruption.describe(w.name, w.disruption or "") for w in disrupted)
        p.condition(
            disruption.CONDITION_DISRUPTED,
            True,
            disrupted[0].disruption or "Disrupted",
            f"{described}: the job goes on without it and recreates it when it can; "
            "not counted against spec.backoffLimit",
            warning=True,
        )
    elif (
        p.was_true(disruption.CONDITION_DISRUPTED)
        and all(w.phase is PodPhase.RUNNING for w in job.wanted)
        and len(job.wanted) >= job.spec.pods
    ):
        p.condition(disruption.CONDITION_DISRUPTED, False, "Recovered", "every disrupted worker was replaced")
    return Next.CONTINUE

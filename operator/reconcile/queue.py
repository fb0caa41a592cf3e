"""Policy: a job queued by Kueue runs what Kueue admitted (``kelastic.operator.kueue``).

Before the pass's steps: the ``Admitted`` condition and ``status.queue`` say what Kueue
granted and why the job waits. With nothing admitted the job is ``Queued``: no pod runs
(a preempted job's pods are deleted; its checkpoint's durable copy stays). Admitted, the
job runs ``min(replicas, admitted)`` workers, and the steps see that as its replicas.
"""

from __future__ import annotations

from dataclasses import replace

from kelastic.operator.kueue import Grant
from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.reconcile.context import Pass, store_pods
from kelastic.operator.spec import JobSpec
from kelastic.operator.status import Phase

#: Condition: True while Kueue admits the job (some or all of its workers).
CONDITION_ADMITTED = "Admitted"


def record(p: Pass, grant: Grant) -> None:
    """``status.queue`` and the ``Admitted`` condition from ``grant``."""
    queue: dict[str, object] = {
        "name": grant.queue,
        "admitted": grant.admitted,
        "pending": grant.pending,
        "summary": grant.summary(),
    }
    if grant.cluster_queue:
        queue["clusterQueue"] = grant.cluster_queue
    if grant.message:
        queue["message"] = grant.message
    p.status.queue = queue
    where = f"LocalQueue {grant.queue}" + (
        f" (ClusterQueue {grant.cluster_queue})" if grant.cluster_queue else ""
    )
    if grant.admitted > 0:
        message = f"{where} admitted {grant.admitted} worker(s)"
        if grant.pending:
            message += f"; {grant.pending} more pending: {grant.message or 'waiting for quota'}"
        p.condition(CONDITION_ADMITTED, True, "Admitted", message)
    else:
        reason = grant.reason or "Pending"
        message = f"waiting in {where}: {grant.message or 'not admitted yet'}"
        p.condition(CONDITION_ADMITTED, False, reason, message)


def admitted_spec(spec: JobSpec, grant: Grant) -> JobSpec:
    """The spec the steps act on: at most the admitted workers."""
    if grant.admitted >= spec.replicas:
        return spec
    return replace(spec, replicas=grant.admitted)


def queued(p: Pass, spec: JobSpec, workers: list[PodView], grant: Grant) -> None:
    """Nothing admitted: no pod runs; the phase says why the job waits."""
    for pod in [*workers, *store_pods(p)]:
        if not pod.terminating and pod.phase is not PodPhase.SUCCEEDED:
            p.delete_pod(pod, "Queued", f"deleting pod {pod.name}: Kueue does not admit the job now")
    if grant.evicted:
        reason = grant.reason or "Evicted"
        message = f"evicted by Kueue ({reason}): {grant.message}; waiting to be admitted again in LocalQueue {grant.queue}"
    else:
        reason = "WaitingForQuota"
        message = f"waiting in LocalQueue {grant.queue}: {grant.message or 'not admitted yet'}"
    p.phase(Phase.QUEUED, reason, message)
    # The active deadline and minReplicasTimeout count admitted time only.
    p.status.start_time = p.status.below_min_since = None

"""Policy: replicas outside [minReplicas, maxReplicas] on a started job run at the bound,
under a condition.
"""

from __future__ import annotations

from kelastic.operator.reconcile.context import ActiveJob, Next, Pass
from kelastic.operator.status import find_condition

#: Condition set while a started job's replicas lie outside [minReplicas, maxReplicas].
CONDITION_OUT_OF_RANGE = "ReplicasOutOfRange"


def step(p: Pass, job: ActiveJob) -> Next:
    """Replicas outside [minReplicas, maxReplicas] on a running job: run at the bound, say so once."""
    spec = job.spec
    if spec.replicas_requested is not None:
        message = (
            f"spec.replicaSpecs.Worker.replicas={spec.replicas_requested} is outside [spec.minReplicas, "
            f"spec.maxReplicas] = [{spec.min_replicas}, {spec.max_replicas}]; running {spec.replicas} workers"
        )
        p.condition(CONDITION_OUT_OF_RANGE, True, "ReplicasOutOfRange", message, warning=True)
    elif find_condition(p.conditions(), CONDITION_OUT_OF_RANGE) is not None:
        p.condition(CONDITION_OUT_OF_RANGE, False, "ReplicasInRange", "replicas within bounds")
    return Next.CONTINUE

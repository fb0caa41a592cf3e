"""Policy: the phase of a job that goes on: Created, Running, Scaling or Restarting."""

from __future__ import annotations

from kelastic.operator.reconcile.context import ActiveJob, Next, Pass
from kelastic.operator.status import Phase, find_condition


def step(p: Pass, job: ActiveJob) -> Next:
    """The phase of a job that goes on: Created, Running, Scaling or Restarting."""
    spec = job.spec
    count = len(job.running)
    has_run = find_condition(p.job.status.get("conditions") or [], Phase.RUNNING.value) is not None
    scaled_to = p.status.scaled_to
    if count < spec.min_replicas:
        message = f"{count} of spec.minReplicas={spec.min_replicas} worker pods running"
        if has_run:
            p.phase(Phase.RESTARTING, "NotEnoughWorkers", message)
        else:
            p.phase(Phase.CREATED, "WaitingForWorkers", message)
    elif count >= spec.replicas and not any(w.index >= spec.pods for w in job.workers if w.index is not None):
        # Running pods past ``replicas`` are standbys: the group is whole without them.
        p.status.scaled_to = spec.replicas
        standbys = (
            f" ({spec.replicas} in the group, {count - spec.replicas} standby)"
            if spec.standby_replicas
            else ""
        )
        p.phase(Phase.RUNNING, "WorkersRunning", f"{count} worker pods running{standbys}")
    elif scaled_to is None:
        p.phase(Phase.RUNNING, "WorkersRunning", f"{count} of {spec.replicas} worker pods running")
    elif scaled_to != spec.replicas:
        p.phase(
            Phase.SCALING,
            "Scaling",
            f"scaling from {scaled_to} to {spec.replicas} worker pods ({count} running)",
        )
    else:
        p.phase(
            Phase.RESTARTING,
            "ReplacingWorkers",
            f"{count} of {spec.replicas} worker pods running; replacing the others",
        )
    return Next.CONTINUE

"""The pure reconcile core: ``reconcile(job, observed, config) -> Decision``.

Level-based: the decision depends only on the job (spec and last written status)
and what is observed now, never on which event arrived. Running it twice on the
same input gives the same result; applying its actions and running it again
converges, so a lost or repeated event, or an operator restarted mid-job, changes
nothing. Everything it must remember between passes lives in the status it
returns (``backoffCount``, ``countedFailures``, ``belowMinSince``, ``scaledTo``,
``startTime``, ``checkpoint.restoredTime``), so several operator replicas or restarts agree.

The handlers apply ``Decision.actions`` in order (Service before pods), post an
Event for each, then write ``Decision.status`` when it differs from the old one.

One module per policy: a pass over an active job runs the ``step`` of each in the
order of ``_ACTIVE_STEPS`` (``lost_node``, ``deadline``, ``success``, ``disrupted``, ``failures``,
``replica_range``, ``store``, ``network_policy``, ``gang``, ``scaling``, ``job_secret``, ``membership``,
``stalled``, ``below_min``, ``ongoing_phase``); ``finish`` ends a job, ``figures`` fills
in the counts every pass; ``context`` is what they share, ``actions`` what they decide.
Before any of them, ``external_store`` refuses a job that names a store the operator may
not connect to, as an invalid spec.
"""

from __future__ import annotations

from collections.abc import Callable

from kelastic.operator import builders
from kelastic.operator.observed import Observed, PodView
from kelastic.operator.reconcile import (
    below_min,
    deadline,
    disrupted,
    external_store,
    failures,
    gang,
    job_secret,
    lost_node,
    membership,
    network_policy,
    ongoing_phase,
    queue,
    replica_range,
    scaling,
    stalled,
    store,
    success,
)
from kelastic.operator.reconcile.actions import (
    Action,
    CreatePod,
    CreateSecret,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteService,
    Emit,
    EnsureObject,
    PublishMembership,
    ReconcileConfig,
)
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, worker_pods
from kelastic.operator.reconcile.figures import rendezvous_figures, replica_status
from kelastic.operator.reconcile.finish import fail_invalid, finished, suspend
from kelastic.operator.reconcile.replica_range import CONDITION_OUT_OF_RANGE
from kelastic.operator.spec import Job, JobSpec
from kelastic.operator.status import CONDITION_INVALID, TERMINAL_PHASES, JobStatus, Phase, find_condition

__all__ = [
    "CONDITION_OUT_OF_RANGE",
    "Action",
    "CreatePod",
    "CreateSecret",
    "CreateService",
    "Decision",
    "DeleteJob",
    "DeletePod",
    "DeleteService",
    "Emit",
    "EnsureObject",
    "PublishMembership",
    "ReconcileConfig",
    "reconcile",
]


def reconcile(job: Job, observed: Observed, config: ReconcileConfig | None = None) -> Decision:
    """Decide the actions and the status for ``job`` given ``observed``. Pure; never raises."""
    config = config or ReconcileConfig()
    job = external_store.admitted(job, config)
    prior = dict(job.status or {})
    status = JobStatus.from_dict(prior)
    status.selector = builders.worker_selector(job.meta.name)
    status.observed_generation = job.meta.generation
    p = Pass(job=job, observed=observed, config=config, status=status)

    if job.deleting:
        # The API server's garbage collector removes what the job owns.
        return Decision((), prior)

    workers = worker_pods(p)

    if job.spec is None:
        fail_invalid(p, workers)
    else:
        spec = job.spec
        invalid = find_condition(prior.get("conditions") or [], CONDITION_INVALID)
        if invalid is not None and invalid.get("status") == "True":
            # The spec was fixed: leave the Invalid failure behind and start afresh.
            p.condition(CONDITION_INVALID, False, "SpecValid", "the spec passed validation")
            status.completion_time = status.start_time = status.below_min_since = None
            status.scaled_to = None
            status.phase = Phase.CREATED.value
            p.job = Job(
                job.meta,
                spec,
                None,
                {k: v for k, v in status.to_dict().items() if k != "phase"},
                job.deleting,
            )
        phase = status.phase
        if phase in {ph.value for ph in TERMINAL_PHASES}:
            finished(p, spec, workers)
        elif spec.suspend:
            suspend(p, spec, workers)
        elif observed.queue is not None:
            queue.record(p, observed.queue)
            if observed.queue.admitted == 0:
                queue.queued(p, spec, workers, observed.queue)
            else:
                _active(p, queue.admitted_spec(spec, observed.queue), workers)
        else:
            _active(p, spec, workers)

    status = p.status
    status.replica_statuses = {"Worker": replica_status(workers, status.backoff_count or 0)}
    rendezvous_figures(p)
    requeue = min(p.requeue) if p.requeue else None
    return Decision(tuple(p.actions), status.to_dict(), requeue)


def _active(p: Pass, spec: JobSpec, workers: list[PodView]) -> None:
    """Drive a job that is neither finished nor suspended: each step in order, until one ends the pass."""
    job = ActiveJob(
        spec=spec,
        workers=workers,
        wanted=[w for w in workers if not w.terminating and w.index is not None and w.index < spec.pods],
    )
    for step in _ACTIVE_STEPS:
        if step(p, job) is Next.STOP:
            return


#: The steps of a pass over an active job, in order. A step that finishes the job or must
#: wait returns ``Next.STOP``; the later steps then do not run.
_ACTIVE_STEPS: tuple[Callable[[Pass, ActiveJob], Next], ...] = (
    lost_node.step,
    deadline.step,
    success.step,
    disrupted.step,
    failures.step,
    replica_range.step,
    store.step,
    network_policy.step,
    gang.step,
    scaling.step,
    job_secret.step,
    membership.step,
    stalled.step,
    below_min.step,
    ongoing_phase.step,
)

"""The end of a job: the terminal phase, the cleanup of what it no longer needs (per
``cleanPodPolicy``), the TTL, suspension, and an invalid spec.
"""

from __future__ import annotations

from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.reconcile.actions import DeleteJob, DeleteService
from kelastic.operator.reconcile.context import Pass, seconds_since, store_pods, store_service
from kelastic.operator.spec import CleanPodPolicy, JobSpec, format_time, parse_time
from kelastic.operator.status import CONDITION_INVALID, Phase, set_phase


def fail_invalid(p: Pass, workers: list[PodView]) -> None:
    err = p.job.error
    assert err is not None
    message = f"invalid ElasticJob: {err}"
    p.condition(CONDITION_INVALID, True, "InvalidSpec", message, warning=True)
    p.status.phase = Phase.FAILED.value
    p.status.conditions = set_phase(p.conditions(), Phase.FAILED, "InvalidSpec", message, p.now)
    _completed(p)
    # Without a valid spec there is no policy to follow: stop what still runs.
    cleanup(p, workers, CleanPodPolicy.RUNNING)


def cleanup(p: Pass, workers: list[PodView], policy: CleanPodPolicy) -> None:
    """Delete what a finished job no longer needs: the store always, workers per ``policy``."""
    for pod in sorted(workers, key=lambda w: w.index or 0):
        if pod.terminating or policy is CleanPodPolicy.NONE:
            continue
        if policy is CleanPodPolicy.ALL or pod.active:
            p.delete_pod(pod, "CleanPod", f"deleting worker pod {pod.name} (cleanPodPolicy {policy.value})")
    for pod in store_pods(p):
        if not pod.terminating:
            p.delete_pod(pod, "DeleteStore", f"deleting rendezvous store pod {pod.name}")
    svc = store_service(p)
    if svc is not None and not svc.terminating and svc.owner_uid in (p.job.meta.uid, None):
        p.actions.append(
            DeleteService(
                reason="DeleteStore", message=f"deleting rendezvous Service {svc.name}", name=svc.name
            )
        )


def _completed(p: Pass) -> None:
    """Record the job's completion time, unless an earlier pass did."""
    if p.status.completion_time is None:
        p.status.completion_time = format_time(p.now)


def finish(p: Pass, phase: Phase, reason: str, message: str, spec: JobSpec, workers: list[PodView]) -> None:
    p.phase(phase, reason, message, warning=phase is Phase.FAILED)
    _completed(p)
    p.status.below_min_since = None
    finished(p, spec, workers)


def finished(p: Pass, spec: JobSpec, workers: list[PodView]) -> None:
    cleanup(p, workers, spec.clean_pod_policy)
    done = parse_time(p.status.completion_time)
    if spec.ttl_seconds_after_finished is not None and done is not None:
        left = spec.ttl_seconds_after_finished - seconds_since(p.now, done)
        if left <= 0:
            p.actions.append(
                DeleteJob(
                    reason="TTLExpired",
                    message=f"deleting the job {spec.ttl_seconds_after_finished}s after it finished (spec.ttlSecondsAfterFinished)",
                )
            )
        else:
            p.after(left)


def suspend(p: Pass, spec: JobSpec, workers: list[PodView]) -> None:
    for pod in [*workers, *store_pods(p)]:
        if not pod.terminating and pod.phase is not PodPhase.SUCCEEDED:
            p.delete_pod(pod, "Suspend", f"deleting pod {pod.name}: the job is suspended")
    p.phase(Phase.SUSPENDED, "Suspended", "spec.suspend is true: pods removed, the job is kept")
    # The active deadline counts active time only, as for a batch Job.
    p.status.start_time = p.status.below_min_since = None

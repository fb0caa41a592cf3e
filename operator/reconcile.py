"""The pure reconcile core: ``reconcile(job, observed, config) -> Decision``.

Level-based: the decision depends only on the job (spec and last written status)
and what is observed now, never on which event arrived. Running it twice on the
same input gives the same result; applying its actions and running it again
converges, so a lost or repeated event, or an operator restarted mid-job, changes
nothing. Everything it must remember between passes lives in the status it
returns (``backoffCount``, ``countedFailures``, ``belowMinSince``, ``scaledTo``,
``startTime``), so several operator replicas or restarts agree.

The handlers apply ``Decision.actions`` in order (Service before pods), post an
Event for each, then write ``Decision.status`` when it differs from the old one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

from kelastic.agent import contract
from kelastic.operator import builders, disruption, netpol, podgroup, stall
from kelastic.operator.observed import (
    Observed,
    PodPhase,
    PodView,
    ServiceView,
    failure_order,
    failure_summary,
    names_failed_rank,
)
from kelastic.operator.spec import CleanPodPolicy, Job, JobSpec, RestartPolicy, format_time, parse_time
from kelastic.operator.status import (
    CONDITION_INVALID,
    TERMINAL_PHASES,
    Phase,
    find_condition,
    progress_text,
    set_condition,
    set_phase,
)

#: Condition set while a started job's replicas lie outside [minReplicas, maxReplicas].
CONDITION_OUT_OF_RANGE = "ReplicasOutOfRange"

__all__ = [
    "CONDITION_OUT_OF_RANGE",
    "Action",
    "CreatePod",
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

# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Action:
    """Something the handlers do to the cluster. ``reason``/``message`` become its Event,
    of type Warning when ``warning`` (something went wrong), else Normal."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class CreateService(Action):
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CreatePod(Action):
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeletePod(Action):
    name: str = ""
    uid: str = ""


@dataclass(frozen=True)
class DeleteService(Action):
    name: str = ""


@dataclass(frozen=True)
class DeleteJob(Action):
    pass


@dataclass(frozen=True)
class PublishMembership(Action):
    """Tell the rendezvous which worker pods are alive and runnable now."""

    endpoint: str = ""
    run_id: str = ""
    nodes: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    #: Changes when the store restarts, so the handler republishes to the new one.
    store_id: str = ""


@dataclass(frozen=True)
class EnsureObject(Action):
    """Create ``manifest`` at the collection URL ``path`` unless it exists (409 is success).

    Returned on every pass; the controller creates each ``key`` once per operator run,
    so a pass costs no API call for an object already ensured.
    """

    path: str = ""
    manifest: Mapping[str, Any] = field(default_factory=dict)
    key: str = ""


@dataclass(frozen=True)
class Emit(Action):
    """An Event without a cluster change (a state transition or a failure)."""


@dataclass(frozen=True)
class ReconcileConfig:
    #: Fail the job when fewer than minReplicas workers ran for this long (seconds).
    min_replicas_timeout: float = 300.0
    #: After the first worker succeeded, how long the others get to finish (seconds).
    success_grace: float = 30.0
    #: A worker whose failure ends the job without naming a failed rank (its agent only
    #: saw the job closed by a peer) waits this long for a still-active peer to report
    #: the root cause, so the job's reason quotes it (seconds after the failure).
    root_cause_grace: float = 5.0
    build: builders.BuildConfig = field(default_factory=builders.BuildConfig)
    #: The store's NetworkPolicy (kelastic.operator.netpol); off unless enabled.
    network_policy: netpol.NetworkPolicyConfig = field(default_factory=netpol.NetworkPolicyConfig)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    #: Reconcile again after this many seconds at the latest (deadlines, TTL, grace).
    requeue_after: float | None = None


# ---------------------------------------------------------------------------- helpers


@dataclass
class _Pass:
    """Mutable scratch state of one reconcile pass."""

    job: Job
    observed: Observed
    config: ReconcileConfig
    status: dict[str, Any]
    actions: list[Action] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)

    @property
    def now(self) -> datetime:
        return self.observed.now

    def conditions(self) -> list[dict[str, Any]]:
        return list(self.status.get("conditions") or [])

    def _was_true(self, kind: str, **same: str) -> bool:
        """Whether condition ``kind`` was True in the job's last written status, with these
        field values (``reason=...``, ``message=...``)."""
        prior = find_condition(self.job.status.get("conditions") or [], kind)
        return (
            prior is not None
            and prior.get("status") == "True"
            and all(prior.get(k) == v for k, v in same.items())
        )

    def condition(self, kind: str, true: bool, reason: str, message: str, *, warning: bool = False) -> None:
        """Set condition ``kind``. Becoming True, or a new message while True, posts an Event;
        becoming False is only recorded (a phase or another condition says what happened)."""
        news = true and not self._was_true(kind, message=message)
        self.status["conditions"] = set_condition(self.conditions(), kind, true, reason, message, self.now)
        if news:
            self.actions.append(Emit(reason=reason, message=message, warning=warning))

    def phase(self, phase: Phase, reason: str, message: str, *, warning: bool = False) -> None:
        """Enter ``phase``. A new phase, or a new reason for it, posts an Event; a new message
        alone (a count that moved) does not."""
        news = self.job.status.get("phase") != phase.value or not self._was_true(phase.value, reason=reason)
        self.status["phase"] = phase.value
        self.status["conditions"] = set_phase(self.conditions(), phase, reason, message, self.now)
        if news:
            self.actions.append(Emit(reason=reason, message=message, warning=warning))

    def after(self, seconds: float) -> None:
        self.requeue.append(max(0.0, seconds))


def _workers(p: _Pass) -> list[PodView]:
    uid = p.job.meta.uid
    return [
        pod
        for pod in p.observed.pods
        if pod.role == contract.ROLE_WORKER and pod.index is not None and pod.owner_uid in (uid, None)
    ]


def _stores(p: _Pass) -> list[PodView]:
    uid = p.job.meta.uid
    return [
        pod
        for pod in p.observed.pods
        if pod.role == contract.ROLE_RENDEZVOUS and pod.owner_uid in (uid, None)
    ]


def _service(p: _Pass) -> ServiceView | None:
    name = builders.store_service_name(p.job.meta.name)
    for svc in p.observed.services:
        if svc.name == name:
            return svc
    return None


def _seconds_since(now: datetime, then: datetime | None) -> float:
    return (now - then).total_seconds() if then else 0.0


def _retryable(pod: PodView, policy: RestartPolicy) -> bool:
    """Whether a failed worker pod is recreated (True) or fails the job (False)."""
    if policy is RestartPolicy.NEVER:
        return False
    if policy is RestartPolicy.ON_FAILURE:
        return True
    # ExitCode: no exit code (evicted, node lost) or a signal is infrastructure, not the program.
    if pod.exit_code is None or pod.signal:
        return True
    return pod.exit_code >= 128 or pod.exit_code < 0


def _describe_failure(pod: PodView) -> str:
    parts = [f"worker pod {pod.name} (index {pod.index})"]
    if pod.signal:
        parts.append(f"was killed by signal {pod.signal}")
    elif pod.exit_code is not None:
        parts.append(f"exited with code {pod.exit_code}")
    else:
        parts.append("failed")
    if pod.reason:
        parts.append(f"({pod.reason})")
    gist = failure_summary(pod.message)
    text = " ".join(parts)
    return f"{text}: {gist}" if gist else text


def _root_cause(pod: PodView, failed: Sequence[PodView], grace: float) -> PodView:
    """The failure to quote when ``pod`` ends the job: ``pod``, unless it does not name a
    failed rank and another failure that does ended within ``grace`` seconds of it (the
    peer whose crash closed the job; its pod status may land a second later)."""
    if names_failed_rank(pod.message) or pod.finished_at is None:
        return pod
    near = [
        f
        for f in failed
        if names_failed_rank(f.message)
        and f.finished_at is not None
        and abs((f.finished_at - pod.finished_at).total_seconds()) <= grace
    ]
    return min(near, key=failure_order) if near else pod


def _awaiting_root_cause(p: _Pass, pod: PodView, wanted: Sequence[PodView]) -> bool:
    """Whether to hold off failing the job because of ``pod`` (and reconcile again soon).

    True while ``pod`` ended without naming a failed rank, another wanted worker is
    still active (its agent may be about to report the root cause) and ``pod`` ended
    less than ``root_cause_grace`` seconds ago. Bounded: a pod with no end time never
    waits.
    """
    if names_failed_rank(pod.message) or pod.finished_at is None:
        return False
    if not any(w.active and w.uid != pod.uid for w in wanted):
        return False
    left = p.config.root_cause_grace - _seconds_since(p.now, pod.finished_at)
    if left <= 0:
        return False
    p.after(left)
    return True


def _replica_status(workers: Sequence[PodView], backoff_count: int) -> dict[str, int]:
    permanent_failed = sum(1 for w in workers if w.phase is PodPhase.FAILED)
    return {
        "active": sum(1 for w in workers if w.active),
        "ready": sum(1 for w in workers if w.active and w.ready),
        "succeeded": sum(1 for w in workers if w.phase is PodPhase.SUCCEEDED),
        "failed": backoff_count + permanent_failed,
    }


# ---------------------------------------------------------------------------- the core


def reconcile(job: Job, observed: Observed, config: ReconcileConfig | None = None) -> Decision:
    """Decide the actions and the status for ``job`` given ``observed``. Pure; never raises."""
    config = config or ReconcileConfig()
    prior = dict(job.status or {})
    status: dict[str, Any] = dict(prior)
    status["selector"] = builders.worker_selector(job.meta.name)
    status["observedGeneration"] = job.meta.generation
    p = _Pass(job=job, observed=observed, config=config, status=status)

    if job.deleting:
        # The API server's garbage collector removes what the job owns.
        return Decision((), prior)

    workers = _workers(p)

    if job.spec is None:
        _invalid(p, workers)
    else:
        spec = job.spec
        invalid = find_condition(prior.get("conditions") or [], CONDITION_INVALID)
        if invalid is not None and invalid.get("status") == "True":
            # The spec was fixed: leave the Invalid failure behind and start afresh.
            p.condition(CONDITION_INVALID, False, "SpecValid", "the spec passed validation")
            for key in ("completionTime", "startTime", "belowMinSince", "scaledTo"):
                status.pop(key, None)
            status["phase"] = Phase.CREATED.value
            p.job = Job(job.meta, spec, None, {k: v for k, v in status.items() if k != "phase"}, job.deleting)
        phase = status.get("phase")
        if phase in {ph.value for ph in TERMINAL_PHASES}:
            _finished(p, spec, workers)
        elif spec.suspend:
            _suspend(p, spec, workers)
        else:
            _active(p, spec, workers)

    status = p.status
    status["replicaStatuses"] = {"Worker": _replica_status(workers, int(status.get("backoffCount") or 0))}
    _rendezvous_figures(p)
    requeue = min(p.requeue) if p.requeue else None
    return Decision(tuple(p.actions), status, requeue)


def _rendezvous_figures(p: _Pass) -> None:
    status = p.status
    rdzv = p.observed.rendezvous
    running = status.get("phase") in (Phase.RUNNING.value, Phase.SCALING.value, Phase.RESTARTING.value)
    if rdzv is not None:
        status["worldSize"] = rdzv.world_size if running else 0
        text = progress_text(rdzv.step, rdzv.total)
        if text is not None:
            status["progress"] = text
    elif not running:
        status["worldSize"] = 0
    status.setdefault("worldSize", 0)
    # RESTARTS counts restarts of the worker group whatever their cause (a failure, a scale, a
    # lost or added pod): every rendezvous round after the first. The agents' failure restarts
    # and the recreated pods are a floor for when the store's rounds are unknown (or it restarted).
    agent_restarts = rdzv.restarts if rdzv is not None else 0
    rounds = rdzv.round - 1 if rdzv is not None else 0
    status["restarts"] = max(
        int(status.get("restarts") or 0), int(status.get("backoffCount") or 0) + agent_restarts, rounds
    )


def _invalid(p: _Pass, workers: list[PodView]) -> None:
    err = p.job.error
    assert err is not None
    message = f"invalid ElasticJob: {err}"
    p.condition(CONDITION_INVALID, True, "InvalidSpec", message, warning=True)
    p.status["phase"] = Phase.FAILED.value
    p.status["conditions"] = set_phase(p.conditions(), Phase.FAILED, "InvalidSpec", message, p.now)
    p.status.setdefault("completionTime", format_time(p.now))
    # Without a valid spec there is no policy to follow: stop what still runs.
    _cleanup(p, workers, CleanPodPolicy.RUNNING)


def _cleanup(p: _Pass, workers: list[PodView], policy: CleanPodPolicy) -> None:
    """Delete what a finished job no longer needs: the store always, workers per ``policy``."""
    for pod in sorted(workers, key=lambda w: w.index or 0):
        if pod.terminating or policy is CleanPodPolicy.NONE:
            continue
        if policy is CleanPodPolicy.ALL or pod.active:
            p.actions.append(
                DeletePod(
                    reason="CleanPod",
                    message=f"deleting worker pod {pod.name} (cleanPodPolicy {policy.value})",
                    name=pod.name,
                    uid=pod.uid,
                )
            )
    for pod in _stores(p):
        if not pod.terminating:
            p.actions.append(
                DeletePod(
                    reason="DeleteStore",
                    message=f"deleting rendezvous store pod {pod.name}",
                    name=pod.name,
                    uid=pod.uid,
                )
            )
    svc = _service(p)
    if svc is not None and not svc.terminating and svc.owner_uid in (p.job.meta.uid, None):
        p.actions.append(
            DeleteService(
                reason="DeleteStore", message=f"deleting rendezvous Service {svc.name}", name=svc.name
            )
        )


def _finish(p: _Pass, phase: Phase, reason: str, message: str, spec: JobSpec, workers: list[PodView]) -> None:
    p.phase(phase, reason, message, warning=phase is Phase.FAILED)
    p.status.setdefault("completionTime", format_time(p.now))
    p.status.pop("belowMinSince", None)
    _finished(p, spec, workers)


def _finished(p: _Pass, spec: JobSpec, workers: list[PodView]) -> None:
    _cleanup(p, workers, spec.clean_pod_policy)
    done = parse_time(p.status.get("completionTime"))
    if spec.ttl_seconds_after_finished is not None and done is not None:
        left = spec.ttl_seconds_after_finished - _seconds_since(p.now, done)
        if left <= 0:
            p.actions.append(
                DeleteJob(
                    reason="TTLExpired",
                    message=f"deleting the job {spec.ttl_seconds_after_finished}s after it finished (spec.ttlSecondsAfterFinished)",
                )
            )
        else:
            p.after(left)


def _suspend(p: _Pass, spec: JobSpec, workers: list[PodView]) -> None:
    for pod in [*workers, *_stores(p)]:
        if not pod.terminating and pod.phase is not PodPhase.SUCCEEDED:
            p.actions.append(
                DeletePod(
                    reason="Suspend",
                    message=f"deleting pod {pod.name}: the job is suspended",
                    name=pod.name,
                    uid=pod.uid,
                )
            )
    p.phase(Phase.SUSPENDED, "Suspended", "spec.suspend is true: pods removed, the job is kept")
    # The active deadline counts active time only, as for a batch Job.
    for key in ("startTime", "belowMinSince"):
        p.status.pop(key, None)


class _Next(Enum):
    """Whether an active job's pass goes on to its next step or ends here."""

    CONTINUE = "continue"
    STOP = "stop"  # the job finished, or waits for something (a grace period, a root cause)


@dataclass
class _ActiveJob:
    """What the steps of one pass over an active job share."""

    spec: JobSpec
    workers: list[PodView]
    #: The workers the job still wants: not being deleted, index within ``spec.replicas``.
    #: Only these decide success or failure: a pod being deleted (scaled away, replaced)
    #: may end with any exit code, and that says nothing about the training.
    wanted: list[PodView]
    #: Failed workers deleted this pass to be recreated (set by the failures step).
    recreating: list[PodView] = field(default_factory=list)
    #: The rendezvous endpoint and the store's identity, once known (set by the store step).
    endpoint: str | None = None
    store_id: str | None = None
    #: Running workers within range, by index (set by the membership step).
    running: list[PodView] = field(default_factory=list)


def _active(p: _Pass, spec: JobSpec, workers: list[PodView]) -> None:
    """Drive a job that is neither finished nor suspended: each step in order, until one ends the pass."""
    job = _ActiveJob(
        spec=spec,
        workers=workers,
        wanted=[w for w in workers if not w.terminating and w.index is not None and w.index < spec.replicas],
    )
    for step in _ACTIVE_STEPS:
        if step(p, job) is _Next.STOP:
            return


def _deadline_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Record the start; fail the job past ``spec.activeDeadlineSeconds``."""
    start = parse_time(p.status.get("startTime"))
    if start is None:
        start = p.now
        p.status["startTime"] = format_time(p.now)
    limit = job.spec.active_deadline_seconds
    if limit is None:
        return _Next.CONTINUE
    left = limit - _seconds_since(p.now, start)
    if left <= 0:
        message = f"the job was active longer than spec.activeDeadlineSeconds={limit}"
        _finish(p, Phase.FAILED, "DeadlineExceeded", message, job.spec, job.workers)
        return _Next.STOP
    p.after(left)
    return _Next.CONTINUE


def _success_step(p: _Pass, job: _ActiveJob) -> _Next:
    """The first wanted worker to succeed ends the job; the others get a grace period."""
    succeeded = [w for w in job.wanted if w.phase is PodPhase.SUCCEEDED]
    if not succeeded:
        return _Next.CONTINUE
    first = min((w.finished_at or p.now) for w in succeeded)
    still = [w for w in job.workers if w.active]
    waited = _seconds_since(p.now, first)
    if not still or waited >= p.config.success_grace:
        names = ", ".join(sorted(w.name for w in succeeded))
        _finish(
            p, Phase.SUCCEEDED, "JobSucceeded", f"training finished: {names} succeeded", job.spec, job.workers
        )
    else:
        p.after(p.config.success_grace - waited)
    return _Next.STOP


def _disruption_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Evicted or preempted workers are no failure of the training: the job shrinks, the pod is
    recreated when it can be, ``backoffLimit`` is not touched; a ``Disrupted`` condition and an
    Event name the pod and the reason (``kelastic.operator.disruption``)."""
    disrupted = [w for w in job.workers if w.disruption is not None and (w.terminating or w in job.wanted)]
    for pod in disrupted:
        if pod.terminating:
            continue  # deleted already (the eviction API, the scheduler): its index is recreated when it is gone
        assert pod.disruption is not None
        job.recreating.append(pod)
        p.actions.append(
            DeletePod(
                reason="RecreateEvicted",
                message=f"{disruption.describe(pod.name, pod.disruption)}; recreating it",
                name=pod.name,
                uid=pod.uid,
            )
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
        p._was_true(disruption.CONDITION_DISRUPTED)
        and all(w.phase is PodPhase.RUNNING for w in job.wanted)
        and len(job.wanted) >= job.spec.replicas
    ):
        p.condition(disruption.CONDITION_DISRUPTED, False, "Recovered", "every disrupted worker was replaced")
    return _Next.CONTINUE


def _failures_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Recreate failed workers while the restart policy and ``backoffLimit`` allow, else fail the job.

    Each failed pod counts against ``backoffLimit`` once (its uid is kept in
    ``countedFailures`` while the pod exists). Earliest failure first: when the job fails,
    its reason quotes the root cause, not a peer that merely stopped because of it.
    """
    spec = job.spec
    backoff = int(p.status.get("backoffCount") or 0)
    present_uids = {w.uid for w in job.workers}
    counted = [u for u in p.status.get("countedFailures") or [] if u in present_uids]
    failed = sorted((w for w in job.wanted if w.phase is PodPhase.FAILED), key=failure_order)
    ending: tuple[PodView, str, str] | None = None  # the pod that ends the job, reason, message
    for pod in failed:
        what = _describe_failure(_root_cause(pod, failed, p.config.root_cause_grace))
        if not _retryable(pod, spec.restart_policy):
            why = (
                "restartPolicy ExitCode treats exit codes 1-127 as permanent"
                if spec.restart_policy is RestartPolicy.EXIT_CODE
                else f"restartPolicy {spec.restart_policy.value} does not recreate failed workers"
            )
            ending = (pod, "WorkerFailed", f"{what}; {why}")
            break
        if pod.uid not in counted:
            if backoff >= spec.backoff_limit:
                ending = (
                    pod,
                    "BackoffLimitExceeded",
                    f"{what}; the job already recreated failed workers {backoff} times (spec.backoffLimit={spec.backoff_limit})",
                )
                break
            backoff += 1
            counted.append(pod.uid)
        job.recreating.append(pod)
        p.actions.append(
            DeletePod(
                reason="RecreateWorker",
                message=f"{what}; recreating it ({backoff}/{spec.backoff_limit} of spec.backoffLimit used)",
                warning=True,
                name=pod.name,
                uid=pod.uid,
            )
        )
    p.status["countedFailures"] = counted
    p.status["backoffCount"] = backoff
    if ending is None:
        return _Next.CONTINUE
    pod, reason, message = ending
    if not _awaiting_root_cause(p, pod, job.wanted):
        _finish(p, Phase.FAILED, reason, message, spec, job.workers)
    return _Next.STOP


def _range_step(p: _Pass, job: _ActiveJob) -> _Next:
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
    return _Next.CONTINUE


def _store_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Create or repair the rendezvous store; learn its endpoint and identity."""
    job.endpoint, job.store_id = _ensure_store(p, job.spec)
    return _Next.CONTINUE


def _network_policy_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Ensure the NetworkPolicy that admits only the job's pods (and the operator) to its store."""
    config = p.config.network_policy
    if config.enabled and not job.spec.rdzv_endpoint:
        manifest = netpol.store_network_policy(p.job, port=p.config.build.rdzv_port, config=config)
        p.actions.append(
            EnsureObject(
                reason="CreateNetworkPolicy",
                message=f"creating NetworkPolicy {manifest['metadata']['name']}: only the job's pods reach its store",
                path=netpol.network_policy_path(p.job.meta.namespace),
                manifest=manifest,
                key=f"{p.job.meta.uid}/networkpolicy",
            )
        )
    return _Next.CONTINUE


def _gang_step(p: _Pass, job: _ActiveJob) -> _Next:
    """With a gang scheduler (the template's ``schedulerName``): the job's PodGroup, before its
    pods, kept in step with ``spec.schedulingPolicy`` and the replicas (``kelastic.operator.podgroup``)."""
    kind = podgroup.gang_scheduler(job.spec, p.config.build.coscheduling_scheduler)
    if kind is None:
        return _Next.CONTINUE
    meta = p.job.meta
    manifest = podgroup.pod_group(
        kind, name=meta.name, namespace=meta.namespace, spec=job.spec, owner=builders.owner_reference(p.job)
    )
    p.actions.append(
        EnsureObject(
            reason="PodGroup",
            message=f"PodGroup {meta.name} for {kind.value}: minMember {manifest['spec']['minMember']}",
            path=podgroup.pod_group_path(kind, meta.namespace),
            manifest=manifest,
            key=f"{meta.uid}/podgroup",
        )
    )
    return _Next.CONTINUE


def _scaling_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Worker pods for indices [0, replicas); those above go. A name still taken (terminating,
    failed) waits for the next pass."""
    spec = job.spec
    by_index: dict[int, list[PodView]] = {}
    for pod in job.workers:
        assert pod.index is not None
        by_index.setdefault(pod.index, []).append(pod)
    for index in range(spec.replicas):
        if index in by_index:
            continue
        if job.endpoint is None:
            break  # the Service has no cluster IP yet; the next pass creates the workers
        manifest = builders.worker_pod(p.job, index, endpoint=job.endpoint, config=p.config.build)
        p.actions.append(
            CreatePod(
                reason="CreateWorker",
                message=f"creating worker pod {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    for pod in sorted(job.workers, key=lambda w: -(w.index or 0)):
        if (
            pod.index is not None
            and pod.index >= spec.replicas
            and not pod.terminating
            and pod not in job.recreating
        ):
            p.actions.append(
                DeletePod(
                    reason="ScaleDown",
                    message=f"deleting worker pod {pod.name}: spec.replicaSpecs.Worker.replicas is {spec.replicas}",
                    name=pod.name,
                    uid=pod.uid,
                )
            )
    return _Next.CONTINUE


def _membership_step(p: _Pass, job: _ActiveJob) -> _Next:
    """The running workers within range are the ones the rendezvous waits for: publish them."""
    spec = job.spec
    job.running = sorted(
        (
            w
            for w in job.workers
            if w.phase is PodPhase.RUNNING
            and not w.terminating
            and w.index is not None
            and w.index < spec.replicas
        ),
        key=lambda w: w.index or 0,
    )
    if job.endpoint is not None and builders.uses_control(spec) and job.store_id is not None:
        p.actions.append(
            PublishMembership(
                reason="Membership",
                message=f"expected members: {', '.join(w.name for w in job.running) or 'none'}",
                endpoint=job.endpoint,
                run_id=p.job.meta.uid,
                nodes=tuple(w.name for w in job.running),
                min_nodes=spec.min_replicas,
                max_nodes=spec.max_replicas,
                store_id=job.store_id,
            )
        )
    return _Next.CONTINUE


def _stall_step(p: _Pass, job: _ActiveJob) -> _Next:
    """With ``spec.hangTimeoutSeconds``: the ``Stalled`` condition (and an Event) names the ranks
    of the latest hang the agents reported through the store (``kelastic.operator.stall``)."""
    timeout = job.spec.hang_timeout_seconds
    rdzv = p.observed.rendezvous
    if timeout is None or rdzv is None:
        return _Next.CONTINUE  # no figures this pass: the condition stays as it was
    latest = stall.summarize(rdzv.hangs, timeout)
    if latest is not None and p.now.timestamp() - latest.at < stall.remembered_for(timeout):
        p.condition(stall.CONDITION_STALLED, True, "NoProgress", latest.message(timeout), warning=True)
        p.after(stall.remembered_for(timeout) - (p.now.timestamp() - latest.at))
    elif p._was_true(stall.CONDITION_STALLED):
        p.condition(stall.CONDITION_STALLED, False, "ProgressResumed", "no hang reported recently")
    return _Next.CONTINUE


def _below_min_step(p: _Pass, job: _ActiveJob) -> _Next:
    """Fail the job when fewer than minReplicas workers ran for longer than the timeout."""
    spec = job.spec
    count = len(job.running)
    if count >= spec.min_replicas:
        p.status.pop("belowMinSince", None)
        return _Next.CONTINUE
    since = parse_time(p.status.get("belowMinSince"))
    if since is None:
        since = p.now
        p.status["belowMinSince"] = format_time(p.now)
    timeout = (
        spec.min_replicas_timeout if spec.min_replicas_timeout is not None else p.config.min_replicas_timeout
    )
    waited = _seconds_since(p.now, since)
    if waited >= timeout:
        message = (
            f"only {count} of spec.minReplicas={spec.min_replicas} worker pods were running for {waited:.0f}s "
            f"(limit {timeout:.0f}s)"
        )
        _finish(p, Phase.FAILED, "NotEnoughWorkers", message, spec, job.workers)
        return _Next.STOP
    p.after(timeout - waited)
    return _Next.CONTINUE


def _phase_step(p: _Pass, job: _ActiveJob) -> _Next:
    """The phase of a job that goes on: Created, Running, Scaling or Restarting."""
    spec = job.spec
    count = len(job.running)
    has_run = find_condition(p.job.status.get("conditions") or [], Phase.RUNNING.value) is not None
    scaled_to = p.status.get("scaledTo")
    if count < spec.min_replicas:
        message = f"{count} of spec.minReplicas={spec.min_replicas} worker pods running"
        if has_run:
            p.phase(Phase.RESTARTING, "NotEnoughWorkers", message)
        else:
            p.phase(Phase.CREATED, "WaitingForWorkers", message)
    elif count == spec.replicas and not any(
        w.index >= spec.replicas for w in job.workers if w.index is not None
    ):
        p.status["scaledTo"] = spec.replicas
        p.phase(Phase.RUNNING, "WorkersRunning", f"{count} worker pods running")
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
    return _Next.CONTINUE


#: The steps of a pass over an active job, in order. A step that finishes the job or must
#: wait returns ``_Next.STOP``; the later steps then do not run.
_ACTIVE_STEPS: tuple[Callable[[_Pass, _ActiveJob], _Next], ...] = (
    _deadline_step,
    _success_step,
    _disruption_step,
    _failures_step,
    _range_step,
    _store_step,
    _network_policy_step,
    _gang_step,
    _scaling_step,
    _membership_step,
    _stall_step,
    _below_min_step,
    _phase_step,
)


def _ensure_store(p: _Pass, spec: JobSpec) -> tuple[str | None, str | None]:
    """Create or repair the store pod and Service. Returns (endpoint, store identity) or Nones."""
    if spec.rdzv_endpoint:
        p.status["rdzvEndpoint"] = spec.rdzv_endpoint
        return spec.rdzv_endpoint, spec.rdzv_endpoint
    build = p.config.build
    endpoint: str | None = None
    svc = _service(p)
    if svc is None:
        manifest = builders.store_service(p.job, config=build)
        p.actions.append(
            CreateService(
                reason="CreateStoreService",
                message=f"creating rendezvous Service {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    elif svc.cluster_ip and not svc.terminating and svc.owner_uid in (p.job.meta.uid, None):
        endpoint = contract.format_endpoint(svc.cluster_ip, build.rdzv_port)  # [v6]:port
        p.status["rdzvEndpoint"] = endpoint
    # else: the name is still held (being deleted, or left by an earlier job of the same
    # name that the garbage collector has not removed yet): wait for it to go.

    store_id: str | None = None
    alive = False
    for pod in _stores(p):
        if pod.terminating:
            alive = True  # wait until it is gone; its name is still taken
            continue
        if pod.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED):
            p.actions.append(
                DeletePod(
                    reason="StoreDied",
                    message=f"rendezvous store pod {pod.name} ended ({pod.phase.value}); recreating it",
                    warning=True,
                    name=pod.name,
                    uid=pod.uid,
                )
            )
            alive = True
            continue
        alive = True
        if pod.phase is PodPhase.RUNNING:
            store_id = pod.uid
    if not alive:
        manifest = builders.store_pod(p.job, config=build)
        p.actions.append(
            CreatePod(
                reason="CreateStore",
                message=f"creating rendezvous store pod {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    return endpoint, store_id

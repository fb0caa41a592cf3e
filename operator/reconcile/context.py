"""What the policies of one pass share: the pass's scratch state (:class:`Pass`), the
active job's (:class:`ActiveJob`), and the views of the job's own pods and Service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

from kelastic.agent import contract
from kelastic.operator import builders
from kelastic.operator.observed import Observed, PodView, ServiceView
from kelastic.operator.reconcile.actions import Action, DeletePod, Emit, ReconcileConfig
from kelastic.operator.spec import Job, JobSpec
from kelastic.operator.status import JobStatus, Phase, find_condition, set_condition, set_phase


@dataclass
class Pass:
    """Mutable scratch state of one reconcile pass."""

    job: Job
    observed: Observed
    config: ReconcileConfig
    status: JobStatus
    actions: list[Action] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)

    @property
    def now(self) -> datetime:
        return self.observed.now

    def conditions(self) -> list[dict[str, Any]]:
        return list(self.status.conditions or [])

    def was_true(self, kind: str, **same: str) -> bool:
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
        news = true and not self.was_true(kind, message=message)
        self.status.conditions = set_condition(self.conditions(), kind, true, reason, message, self.now)
        if news:
            self.actions.append(Emit(reason=reason, message=message, warning=warning))

    def phase(self, phase: Phase, reason: str, message: str, *, warning: bool = False) -> None:
        """Enter ``phase``. A new phase, or a new reason for it, posts an Event; a new message
        alone (a count that moved) does not."""
        news = self.job.status.get("phase") != phase.value or not self.was_true(phase.value, reason=reason)
        self.status.phase = phase.value
        self.status.conditions = set_phase(self.conditions(), phase, reason, message, self.now)
        if news:
            self.actions.append(Emit(reason=reason, message=message, warning=warning))

    def after(self, seconds: float) -> None:
        self.requeue.append(max(0.0, seconds))

    def delete_pod(self, pod: PodView, reason: str, message: str, *, warning: bool = False) -> None:
        """Delete ``pod`` (this incarnation of it: its uid is the precondition), with an Event."""
        self.actions.append(
            DeletePod(reason=reason, message=message, warning=warning, name=pod.name, uid=pod.uid)
        )


def worker_pods(p: Pass) -> list[PodView]:
    uid = p.job.meta.uid
    return [
        pod
        for pod in p.observed.pods
        if pod.role == contract.ROLE_WORKER and pod.index is not None and pod.owner_uid in (uid, None)
    ]


def store_pods(p: Pass) -> list[PodView]:
    uid = p.job.meta.uid
    return [
        pod
        for pod in p.observed.pods
        if pod.role == contract.ROLE_RENDEZVOUS and pod.owner_uid in (uid, None)
    ]


def store_service(p: Pass) -> ServiceView | None:
    name = builders.store_service_name(p.job.meta.name)
    for svc in p.observed.services:
        if svc.name == name:
            return svc
    return None


def seconds_since(now: datetime, then: datetime | None) -> float:
    return (now - then).total_seconds() if then else 0.0


class Next(Enum):
    """Whether an active job's pass goes on to its next step or ends here."""

    CONTINUE = "continue"
    STOP = "stop"  # the job finished, or waits for something (a grace period, a root cause)


@dataclass
class ActiveJob:
    """What the steps of one pass over an active job share."""

    spec: JobSpec
    workers: list[PodView]
    #: The workers the job still wants: not being deleted, index within ``spec.pods``.
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

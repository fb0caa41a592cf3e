"""What the operator observes about one ElasticJob, as plain immutable values.

The handlers turn API objects into these views (``pod_view``, ``service_view``) and
the rendezvous store's answer into a :class:`RendezvousView`; the reconcile core
only ever sees these, which keeps it pure and table-testable.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kelastic.agent import contract
from kelastic.operator.checkpoint import CheckpointReport
from kelastic.operator.disruption import disruption_reason
from kelastic.operator.goodput import GoodputReport
from kelastic.operator.kueue import Grant
from kelastic.operator.spec import JOB_SECRET_VOLUME, parse_time

__all__ = [
    "Observed",
    "PodPhase",
    "PodView",
    "RendezvousView",
    "ServiceView",
    "failure_order",
    "failure_summary",
    "names_failed_rank",
    "pod_view",
    "service_view",
]


class PodPhase(str, enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class PodView:
    """A pod labelled as part of a job.

    ``exit_code``/``signal``/``reason`` describe how the worker container ended
    (None while it runs); ``finished_at`` is when it ended. ``owner_uid`` is the
    uid of the controlling ElasticJob (a pod of an earlier job of the same name has
    another one).
    """

    name: str
    uid: str
    role: str | None
    index: int | None
    phase: PodPhase
    ready: bool = False
    terminating: bool = False
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    finished_at: datetime | None = None
    owner_uid: str | None = None
    pod_ip: str | None = None
    #: The container's termination message (the agent's last words on a real kubelet).
    message: str | None = None
    #: Name of the container whose end counts (the worker container).
    container: str | None = None
    #: Why the pod was evicted or preempted (kelastic.operator.disruption), None if it was not.
    disruption: str | None = None
    #: The pod mounts the job's secret (kelastic.operator.jobsecret): its agent holds the job's key.
    holds_secret: bool = False
    #: The node the pod is bound to (``spec.nodeName``), None before it is scheduled.
    node: str | None = None

    @property
    def active(self) -> bool:
        """Pending or Running and not being deleted."""
        return not self.terminating and self.phase in (PodPhase.PENDING, PodPhase.RUNNING, PodPhase.UNKNOWN)


@dataclass(frozen=True)
class ServiceView:
    name: str
    uid: str
    cluster_ip: str | None
    terminating: bool = False
    owner_uid: str | None = None


@dataclass(frozen=True)
class RendezvousView:
    """The store's view of the job (from ``kelastic.agent.rendezvous.control.read_status``)."""

    world_size: int
    restarts: int
    members: tuple[str, ...] = ()
    step: int | None = None
    total: int | None = None
    #: The current members' latest recoveries as reported by their agents: (node, seconds, ended).
    recoveries: tuple[tuple[str, float, float], ...] = ()
    #: The current members' latest restarts after a failure as reported by their agents:
    #: (node, the agent's reason, when the group re-formed after it).
    failures: tuple[tuple[str, str, float], ...] = ()
    #: The current members' latest hang verdicts: (node, global ranks, seconds without progress, when).
    hangs: tuple[tuple[str, tuple[int, ...], float, float], ...] = ()
    #: The current members' views of the memory checkpoint (members without a record left out).
    checkpoints: tuple[CheckpointReport, ...] = ()
    #: The latest closed rendezvous round (1 for the group's first start, 0 before it): every
    #: later round is a restart of the group, whatever its cause.
    round: int = 0
    #: Running pods that wait in the rendezvous as standbys, without a rank.
    standbys: tuple[str, ...] = ()
    #: The current members' goodput records (members without one left out).
    goodputs: tuple[GoodputReport, ...] = ()
    #: The agents' straggler verdict as published (``kelastic.operator.straggler``), None without one.
    straggler: Mapping[str, object] | None = None


@dataclass(frozen=True)
class Observed:
    now: datetime
    pods: Sequence[PodView] = ()
    services: Sequence[ServiceView] = ()
    #: None when the store was not asked or could not be reached.
    rendezvous: RendezvousView | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: What Kueue admits of a queued job (kelastic.operator.kueue); None when Kueue does not manage it.
    queue: Grant | None = None
    #: The nodes of the job's pods that the control plane gave up, with why
    #: (``kelastic.operator.nodeloss.node_lost``): read only for the pods the taint manager deleted.
    lost_nodes: Mapping[str, str] = field(default_factory=dict)


def _owner_uid(metadata: Mapping[str, Any]) -> str | None:
    for ref in metadata.get("ownerReferences") or []:
        if ref.get("controller"):
            uid = ref.get("uid")
            return None if uid is None else str(uid)
    return None


def pod_view(body: Mapping[str, Any], worker_container: str | None = None) -> PodView:
    """Summarise a pod object; ``worker_container`` names the container whose end counts."""
    metadata = body.get("metadata") or {}
    labels = metadata.get("labels") or {}
    status = body.get("status") or {}
    index_label = labels.get(contract.LABEL_REPLICA_INDEX)
    index = int(index_label) if isinstance(index_label, str) and index_label.isdigit() else None
    try:
        phase = PodPhase(status.get("phase") or "Pending")
    except ValueError:
        phase = PodPhase.UNKNOWN
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    exit_code = signal = None
    reason = status.get("reason")
    finished_at = None
    message = None
    statuses = list(status.get("containerStatuses") or [])
    volumes = (body.get("spec") or {}).get("volumes") or []
    holds_secret = any(isinstance(v, Mapping) and v.get("name") == JOB_SECRET_VOLUME for v in volumes)
    if worker_container is None:
        containers = (body.get("spec") or {}).get("containers") or []
        worker_container = containers[0].get("name") if containers else None
    statuses.sort(key=lambda s: s.get("name") != worker_container)
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if not term:
            continue
        exit_code = term.get("exitCode")
        signal = term.get("signal")
        reason = term.get("reason") or reason
        finished_at = parse_time(term.get("finishedAt"))
        message = (term.get("message") or "").strip() or None
        break
    return PodView(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        role=labels.get(contract.LABEL_ROLE),
        index=index,
        phase=phase,
        ready=ready,
        terminating=bool(metadata.get("deletionTimestamp")),
        exit_code=exit_code,
        signal=signal,
        reason=reason,
        finished_at=finished_at,
        owner_uid=_owner_uid(metadata),
        holds_secret=holds_secret,
        pod_ip=status.get("podIP"),
        message=message,
        container=worker_container,
        disruption=disruption_reason(status),
        node=(body.get("spec") or {}).get("nodeName") or None,
    )


def service_view(body: Mapping[str, Any]) -> ServiceView:
    metadata = body.get("metadata") or {}
    cluster_ip = (body.get("spec") or {}).get("clusterIP")
    return ServiceView(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        cluster_ip=cluster_ip if cluster_ip and cluster_ip != "None" else None,
        terminating=bool(metadata.get("deletionTimestamp")),
        owner_uid=_owner_uid(metadata),
    )


_ROOT_CAUSE = "Root Cause (first observed failure):"
#: How a kelastic agent's termination message (or failure summary) names a failed rank.
_NAMES_RANK = re.compile(r"^\s*rank\s*:?\s*\d+", re.MULTILINE)
_NEVER = datetime.max.replace(tzinfo=timezone.utc)


def names_failed_rank(message: str | None) -> bool:
    """Whether ``message`` is an agent's root cause (it names the failed rank)."""
    return bool(_NAMES_RANK.search(message or ""))


def failure_order(pod: PodView) -> tuple[datetime, bool, int]:
    """Sort key putting the root cause of a job's failure first: the earliest failure.

    Pods are ordered by ``finished_at`` (unknown: last). Times have a resolution of
    a second, and an agent whose workers crashed stops its peers within the same
    second, so among equal times a pod whose message names a failed rank (the
    agent's own root cause) comes before one that does not (a peer that only saw the
    job end); then the lower replica index.
    """
    finished = pod.finished_at or _NEVER
    if finished.tzinfo is None:
        finished = finished.replace(tzinfo=timezone.utc)
    return (
        finished,
        not _NAMES_RANK.search(pod.message or ""),
        pod.index if pod.index is not None else 1 << 30,
    )


#: How the failure report's traceback line starts when the worker left no error file.
_NO_TRACEBACK = ("To enable traceback see:", "Process ")


def failure_summary(text: str | None, max_len: int = 300) -> str | None:
    """The gist of a failed agent's last output (its log tail or termination message).

    The agent ends a failed run with torchrun's failure report; from its root-cause
    section this returns ``"rank 3 (local_rank: 1) exitcode 2 (pid: 41): <traceback
    line>"``. Other output gives its last non-empty lines. None for no text.
    """
    if not text or not text.strip():
        return None
    lines = [line.rstrip() for line in text.splitlines()]
    if _ROOT_CAUSE in text:
        block = lines[max(i for i, line in enumerate(lines) if line.strip() == _ROOT_CAUSE) + 1 :]
        fields: dict[str, str] = {}
        for line in block:
            key, sep, value = line.strip().partition(":")
            if sep and key.strip() in ("rank", "exitcode", "traceback") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
        if "rank" in fields:
            parts = [f"rank {fields['rank']}"]
            if "exitcode" in fields:
                parts.append(f"exitcode {fields['exitcode']}")
            summary = " ".join(parts)
            traceback = fields.get("traceback", "")
            # Left out when the worker recorded no traceback: what the report then shows is
            # torch's pointer to @record (or, from older agents, the exit code again).
            if traceback and not traceback.startswith(_NO_TRACEBACK) and traceback != "<N/A>":
                summary += f": {traceback}"
            return summary[:max_len]
    tail = [line.strip() for line in lines if line.strip()][-3:]
    return " | ".join(tail)[:max_len]

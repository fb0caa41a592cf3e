"""Pod status the way a kubelet reports it, computed from container records.

Pure functions and dataclasses: the kubelet keeps one :class:`ContainerRecord`
per container (init containers included), updates it as processes start and
exit, and calls :func:`pod_status` to get the ``status`` object it writes to the
API server. The rules follow the real kubelet:

- phase: ``Pending`` until the init containers have succeeded and no container
  is waiting for its first start; ``Running`` while a container runs or will be
  restarted; ``Succeeded`` when every container exited 0 and none restarts;
  ``Failed`` when every container stopped, one failed, and none restarts (or an
  init container failed under ``restartPolicy: Never``).
- conditions ``PodScheduled``, ``Initialized``, ``ContainersReady``, ``Ready``,
  each with a ``lastTransitionTime`` that moves only when its status changes.
- ``containerStatuses``/``initContainerStatuses`` with ``state``, ``lastState``,
  ``ready``, ``started`` and ``restartCount``.

It also holds :class:`CrashBackoff`, the exponential restart back-off.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ContainerRecord",
    "ContainerState",
    "CrashBackoff",
    "PodFacts",
    "PodPhase",
    "Terminated",
    "exit_reason",
    "parse_rfc3339",
    "pod_phase",
    "pod_status",
    "rfc3339",
    "should_restart",
]


def rfc3339(ts: float) -> str:
    """Kubernetes time format (seconds precision, UTC)."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float | None:
    """Seconds since the epoch of a Kubernetes timestamp (None if unparsable)."""
    try:
        return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


class PodPhase(str, enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ContainerState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TERMINATED = "terminated"


@dataclass
class Terminated:
    """One finished run of a container."""

    exit_code: int
    reason: str
    started_at: float | None
    finished_at: float
    message: str = ""
    signal: int | None = None
    container_id: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "finishedAt": rfc3339(self.finished_at),
        }
        if self.started_at is not None:
            out["startedAt"] = rfc3339(self.started_at)
        if self.message:
            out["message"] = self.message
        if self.signal is not None:
            out["signal"] = self.signal
        if self.container_id:
            out["containerID"] = self.container_id
        return out


def exit_reason(exit_code: int) -> str:
    """The ``terminated.reason`` a kubelet reports for an exit code."""
    return "Completed" if exit_code == 0 else "Error"


def should_restart(restart_policy: str, exit_code: int, init: bool = False) -> bool:
    """Whether a container that exited with ``exit_code`` is started again.

    Init containers restart on failure unless the policy is ``Never`` (``Always``
    behaves as ``OnFailure`` for them: a succeeded init container is done).
    """
    if restart_policy == "Never":
        return False
    if restart_policy == "Always" and not init:
        return True
    return exit_code != 0


@dataclass
class ContainerRecord:
    """The kubelet's view of one container; mutated by the kubelet only."""

    name: str
    image: str
    init: bool = False
    state: ContainerState = ContainerState.WAITING
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    started_at: float | None = None
    container_id: str = ""
    terminated: Terminated | None = None
    last_terminated: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any]
        if self.state is ContainerState.RUNNING:
            state = {"running": {"startedAt": rfc3339(self.started_at or 0.0)}}
        elif self.state is ContainerState.TERMINATED and self.terminated is not None:
            state = {"terminated": self.terminated.to_json()}
        else:
            waiting: dict[str, Any] = {"reason": self.waiting_reason}
            if self.waiting_message:
                waiting["message"] = self.waiting_message
            state = {"waiting": waiting}
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "state": state,
            "lastState": {"terminated": self.last_terminated.to_json()} if self.last_terminated else {},
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": self.started,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


def _init_done(init: Sequence[ContainerRecord]) -> bool:
    return all(
        r.state is ContainerState.TERMINATED and r.terminated is not None and r.terminated.exit_code == 0
        for r in init
    )


def _init_failed_for_good(init: Sequence[ContainerRecord], restart_policy: str) -> bool:
    return restart_policy == "Never" and any(
        r.state is ContainerState.TERMINATED and r.terminated is not None and r.terminated.exit_code != 0
        for r in init
    )


def pod_phase(
    restart_policy: str, init: Sequence[ContainerRecord], containers: Sequence[ContainerRecord]
) -> PodPhase:
    """The pod phase from its containers' records (the real kubelet's rule)."""
    if _init_failed_for_good(init, restart_policy):
        return PodPhase.FAILED
    if not _init_done(init):
        return PodPhase.PENDING
    running = waiting = stopped = succeeded = 0
    for r in containers:
        if r.state is ContainerState.RUNNING:
            running += 1
        elif r.state is ContainerState.TERMINATED:
            stopped += 1
            if r.terminated is not None and r.terminated.exit_code == 0:
                succeeded += 1
        elif r.last_terminated is not None:
            # Waiting to be restarted (back-off): it has run, so it counts as stopped.
            stopped += 1
        else:
            waiting += 1
    if waiting > 0:
        return PodPhase.PENDING
    if running > 0:
        return PodPhase.RUNNING
    if stopped > 0:
        if restart_policy == "Always":
            return PodPhase.RUNNING
        if stopped == succeeded:
            return PodPhase.SUCCEEDED
        if restart_policy == "Never":
            return PodPhase.FAILED
        return PodPhase.RUNNING
    return PodPhase.PENDING


def _condition(
    ctype: str,
    ok: bool,
    now: float,
    previous: Mapping[str, Mapping[str, Any]],
    reason: str = "",
    message: str = "",
) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = previous.get(ctype)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": since or rfc3339(now),
    }
    if not ok and reason:
        cond["reason"] = reason
    if not ok and message:
        cond["message"] = message
    return cond


@dataclass
class PodFacts:
    """Pod-level inputs to :func:`pod_status` besides the container records."""

    restart_policy: str
    pod_ip: str | None
    host_ip: str
    start_time: float | None
    previous_conditions: list[Mapping[str, Any]] = field(default_factory=list)
    #: Set when the pod cannot start at all (e.g. no pod address left).
    message: str = ""
    reason: str = ""
    #: The kubelet ended the pod (``activeDeadlineSeconds``): Failed whatever the containers say.
    failed: bool = False


def pod_status(
    facts: PodFacts,
    init: Sequence[ContainerRecord],
    containers: Sequence[ContainerRecord],
    now: float,
) -> dict[str, Any]:
    """The ``status`` object of the pod (what the kubelet writes to the API)."""
    phase = PodPhase.FAILED if facts.failed else pod_phase(facts.restart_policy, init, containers)
    previous = {c.get("type", ""): c for c in facts.previous_conditions}
    terminal = phase in (PodPhase.SUCCEEDED, PodPhase.FAILED)
    initialized = _init_done(init)
    pending_init = [r.name for r in init if not (r.terminated and r.terminated.exit_code == 0)]
    unready = [r.name for r in containers if not r.ready]
    ready = initialized and not unready and not terminal
    if terminal:
        ready_reason, ready_message = "PodCompleted", ""
    else:
        ready_reason = "ContainersNotReady"
        ready_message = f"containers with unready status: [{' '.join(unready)}]" if unready else ""
    conditions = [
        _condition(
            "Initialized",
            initialized,
            now,
            previous,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(pending_init)}]",
        ),
        _condition("Ready", ready, now, previous, ready_reason, ready_message),
        _condition("ContainersReady", ready, now, previous, ready_reason, ready_message),
        _condition("PodScheduled", True, now, previous),
    ]
    # No qosClass: the API server sets it from the spec at creation and a current one refuses
    # a status write that changes it, so the merge patch leaves the server's value alone.
    status: dict[str, Any] = {
        "phase": phase.value,
        "conditions": conditions,
        "hostIP": facts.host_ip,
        "hostIPs": [{"ip": facts.host_ip}],
        "containerStatuses": [r.to_json() for r in containers],
    }
    if init:
        status["initContainerStatuses"] = [r.to_json() for r in init]
    if facts.pod_ip:
        status["podIP"] = facts.pod_ip
        status["podIPs"] = [{"ip": facts.pod_ip}]
    if facts.start_time is not None:
        status["startTime"] = rfc3339(facts.start_time)
    if facts.reason:
        status["reason"] = facts.reason
    if facts.message:
        status["message"] = facts.message
    return status


class CrashBackoff:
    """Exponential restart back-off per container, like the kubelet's CrashLoopBackOff.

    The first restart after a crash is immediate; each further one waits twice as
    long as the previous, from ``base`` up to ``cap`` seconds. A container that
    ran for ``2 * cap`` seconds before exiting starts over from no delay.
    """

    def __init__(self, base: float = 10.0, cap: float = 300.0) -> None:
        if base < 0 or cap < base:
            raise ValueError(f"back-off needs 0 <= base <= cap, got base={base} cap={cap}")
        self.base = base
        self.cap = cap
        self._delay: dict[str, float] = {}

    def delay_after_exit(self, key: str, ran_for: float) -> float:
        """Seconds to wait before restarting ``key``, which just exited after ``ran_for`` s."""
        if ran_for >= 2 * self.cap:
            self._delay.pop(key, None)
        current = self._delay.get(key)
        if current is None:
            self._delay[key] = self.base
            return 0.0
        self._delay[key] = min(self.cap, max(current * 2, self.base))
        return current

    def forget(self, key: str) -> None:
        self._delay.pop(key, None)

"""The ElasticJob status: phases, conditions, progress text, and the patch to write.

Conditions follow the Kubernetes conventions: one entry per type with
``status`` True/False, a CamelCase ``reason``, a human ``message``, and a
``lastTransitionTime`` that only moves when ``status`` changes. The condition of
the current phase is True; the other phase conditions that were ever set are False.
``Invalid`` is separate: True while the spec fails validation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from kelastic.operator.spec import format_time

__all__ = [
    "CONDITION_INVALID",
    "TERMINAL_PHASES",
    "JobStatus",
    "Phase",
    "find_condition",
    "merge_patch",
    "progress_text",
    "set_condition",
    "set_phase",
]


class Phase(str, enum.Enum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SCALING = "Scaling"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    #: Waiting for Kueue to admit the job (kelastic.operator.kueue): no pod runs.
    QUEUED = "Queued"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
CONDITION_INVALID = "Invalid"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


@dataclass
class JobStatus:
    """An ElasticJob's status, typed: what a reconcile pass reads and writes.

    Each field is the stored key of its name in camelCase (``below_min_since`` is
    ``belowMinSince``). A field is None where the stored status has no such key (or a null one), and
    :meth:`to_dict` leaves it out; ``extra`` keeps, as stored, the keys this class
    does not name. ``to_dict(from_dict(d)) == d`` for any status without nulls.
    Times are kept as stored (RFC 3339 strings, see ``spec.format_time``), so a
    status read and written back is unchanged to the character.
    """

    phase: str | None = None
    conditions: list[dict[str, Any]] | None = None
    selector: str | None = None
    observed_generation: int | None = None
    replica_statuses: dict[str, Any] | None = None
    world_size: int | None = None
    #: Worker pods waiting in the rendezvous as hot standbys (set for jobs with ``standbyReplicas``).
    standbys: int | None = None
    restarts: int | None = None
    progress: str | None = None
    rdzv_endpoint: str | None = None
    #: Failed workers recreated so far, against spec.backoffLimit; each pod counted once
    #: (its uid stays in ``counted_failures`` while the pod exists).
    backoff_count: int | None = None
    counted_failures: list[str] | None = None
    #: Since when fewer than minReplicas workers run (for minReplicasTimeout).
    below_min_since: str | None = None
    #: The replicas the job last ran at in full; set once it ran, so a later change is Scaling.
    scaled_to: int | None = None
    last_recovery_time: str | None = None
    #: The latest restart of the group after a failure, as its agent said it (node, reason, time).
    last_failure: dict[str, Any] | None = None
    #: The members' memory checkpoints (``kelastic.operator.checkpoint``).
    checkpoint: dict[str, Any] | None = None
    #: What Kueue admits of a queued job (``kelastic.operator.reconcile.queue``).
    queue: dict[str, Any] | None = None
    #: The job's goodput and where the rest of its time went (``kelastic.operator.goodput``).
    goodput: dict[str, Any] | None = None
    #: The agents' straggler verdict (``kelastic.operator.straggler``).
    straggler: dict[str, Any] | None = None
    start_time: str | None = None
    completion_time: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, status: Mapping[str, Any]) -> JobStatus:
        """The typed view of ``status`` (a shallow copy: setting a field leaves ``status`` as it was)."""
        known = _KEYS
        typed = {known[k]: v for k, v in status.items() if k in known}
        return cls(**typed, extra={k: v for k, v in status.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The status as stored: the keys of ``extra``, then each field that is not None."""
        out = dict(self.extra)
        for key, name in _KEYS.items():
            value = getattr(self, name)
            if value is not None:
                out[key] = value
        return out


#: The stored key of each field of :class:`JobStatus` (its name in camelCase) → the field.
_KEYS = {_camel(f.name): f.name for f in fields(JobStatus) if f.name != "extra"}


def find_condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    for cond in conditions:
        if cond.get("type") == kind:
            return cond
    return None


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """Return ``conditions`` with ``kind`` set; its transition time moves only if its status flips."""
    text = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != kind:
            out.append(dict(cond))
            continue
        found = True
        moved = cond.get("status") != text
        out.append(
            {
                "type": kind,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": format_time(now)
                if moved
                else cond.get("lastTransitionTime", format_time(now)),
            }
        )
    if not found:
        out.append(
            {
                "type": kind,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": format_time(now),
            }
        )
    return out


def set_phase(
    conditions: Sequence[Mapping[str, Any]], phase: Phase, reason: str, message: str, now: datetime
) -> list[dict[str, Any]]:
    """Make ``phase``'s condition True and every other phase condition already present False.

    The other phase conditions take the current phase's reason and a message that names it:
    what they said while they were True (e.g. Created's "1 of spec.minReplicas=2 worker pods
    running") is no longer true. Their transition time moves only when their status flips."""
    out = set_condition(conditions, phase.value, True, reason, message, now)
    phase_names = {p.value for p in Phase} - {phase.value}
    result: list[dict[str, Any]] = []
    for cond in out:
        if cond.get("type") in phase_names:
            moved = cond.get("status") == "True"
            cond = {
                **cond,
                "status": "False",
                "reason": reason,
                "message": f"the job is {phase.value}: {message}",
                "lastTransitionTime": format_time(now)
                if moved
                else cond.get("lastTransitionTime", format_time(now)),
            }
        result.append(cond)
    return result


def progress_text(step: int | None, total: int | None) -> str | None:
    """``"120/500 (24%)"`` with a known total, ``"step 120"`` without, None before any report."""
    if step is None:
        return None
    if total:
        pct = min(100, max(0, int(100 * step / total)))
        return f"{step}/{total} ({pct}%)"
    return f"step {step}"


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) turning ``old`` into ``new``; empty when they are equal."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch

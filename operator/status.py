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
from datetime import datetime
from typing import Any

from kelastic.operator.spec import format_time

__all__ = [
    "CONDITION_INVALID",
    "TERMINAL_PHASES",
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


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
CONDITION_INVALID = "Invalid"


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

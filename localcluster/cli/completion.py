"""When is a workload finished? Pluggable rules for ``kelastic local run``.

A rule maps an object (as served by the API) to an :class:`Outcome` plus a
one-line detail. Rules are looked up by ``(apiVersion, kind)``; a kind without
its own rule gets :func:`generic_outcome`, which understands the usual
conventions: ``status.phase`` (Succeeded/Completed/Complete vs Failed/Error)
and conditions (``Succeeded``/``Complete``/``Completed`` vs ``Failed`` with
status True). Kinds that never finish (Services, ConfigMaps, ...) are simply not
waited for: see :func:`waitable`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "Outcome",
    "generic_outcome",
    "outcome_of",
    "pod_outcome",
    "register_rule",
    "waitable",
]


class Outcome(str, enum.Enum):
    PENDING = "Pending"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


Rule = Callable[[Mapping[str, Any]], tuple[Outcome, str]]

_SUCCESS_PHASES = {"Succeeded", "Completed", "Complete"}
_FAILURE_PHASES = {"Failed", "Error"}
#: Kinds of the core API that never "finish": applied, not waited for.
_NOT_WAITABLE = {
    "ConfigMap",
    "Secret",
    "Service",
    "Endpoints",
    "Namespace",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolumeClaim",
    "Lease",
}

_rules: dict[tuple[str, str], Rule] = {}


def register_rule(api_version: str, kind: str, rule: Rule) -> None:
    """Use ``rule`` for objects of ``kind`` in ``api_version`` (``"*"`` matches any version)."""
    _rules[(api_version, kind)] = rule


def _container_detail(pod: Mapping[str, Any]) -> str:
    parts = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            desc = f"exit {state['terminated'].get('exitCode')}"
        elif "waiting" in state:
            desc = str(state["waiting"].get("reason", "waiting"))
        elif "running" in state:
            desc = "running"
        else:
            desc = "unknown"
        restarts = int(cs.get("restartCount", 0))
        parts.append(f"{cs.get('name')}: {desc}" + (f", {restarts} restarts" if restarts else ""))
    return "; ".join(parts)


def pod_outcome(pod: Mapping[str, Any]) -> tuple[Outcome, str]:
    """A pod is done when its phase is Succeeded or Failed."""
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    detail = _container_detail(pod) or phase
    if phase == "Succeeded":
        return Outcome.SUCCEEDED, detail
    if phase == "Failed":
        return Outcome.FAILED, detail
    return Outcome.PENDING, f"{phase}" + (f" ({detail})" if detail != phase else "")


def generic_outcome(obj: Mapping[str, Any]) -> tuple[Outcome, str]:
    """``status.phase`` first, then conditions; anything else is still pending."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    true_conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]

    def explain(kind: str) -> str:
        # The condition named like the phase says why; else any message the status has.
        for cond in true_conditions:
            if cond.get("type") == kind and (cond.get("message") or cond.get("reason")):
                return f"{kind}: {cond.get('message') or cond.get('reason')}"
        return f"{kind}: {status['message']}" if status.get("message") else kind

    if phase in _SUCCESS_PHASES:
        return Outcome.SUCCEEDED, explain(str(phase))
    if phase in _FAILURE_PHASES:
        return Outcome.FAILED, explain(str(phase))
    for cond in true_conditions:
        if cond.get("type") in _SUCCESS_PHASES:
            return Outcome.SUCCEEDED, explain(str(cond["type"]))
        if cond.get("type") == "Failed":
            return Outcome.FAILED, explain("Failed")
    detail = str(phase or "no status yet")
    if isinstance(status.get("progress"), str) and status["progress"]:
        detail += f", progress {status['progress']}"
    return Outcome.PENDING, detail


register_rule("v1", "Pod", pod_outcome)


def outcome_of(obj: Mapping[str, Any]) -> tuple[Outcome, str]:
    """Apply the rule registered for the object's kind (or the generic one)."""
    key = (str(obj.get("apiVersion", "")), str(obj.get("kind", "")))
    rule = _rules.get(key) or _rules.get(("*", key[1])) or generic_outcome
    return rule(obj)


def waitable(obj: Mapping[str, Any]) -> bool:
    """Whether ``kelastic local run`` waits for this object to finish."""
    return str(obj.get("kind", "")) not in _NOT_WAITABLE

"""The pods/eviction subresource, as the API server (v1.26+) serves it.

``POST /api/v1/namespaces/NS/pods/NAME/eviction`` with a ``policy/v1`` (or
``v1beta1``) ``Eviction`` whose ``metadata.name`` is the pod's name:

* a pod already being deleted: nothing more happens, the answer is Success;
* a pod that has not ended (not Succeeded or Failed) first gets the condition
  ``DisruptionTarget=True`` (reason ``EvictionByEvictionAPI``, message ``Eviction
  API: evicting``), so its controller can tell an eviction from other deletions;
* then the pod is deleted with the Eviction's ``deleteOptions`` (grace period,
  propagation) and the answer is a ``Status`` Success with code 201.

PodDisruptionBudgets are honoured as the API server does, before anything is
changed: a pod that has not started (``Pending``) or has ended is evicted
regardless; otherwise the budgets of the pod's namespace whose (non-empty)
selector matches its labels are consulted:

* none: the pod is evicted;
* more than one: 500 InternalError (the API server does not support that either);
* one that allows no disruption: 429 TooManyRequests, "Cannot evict pod as it would
  violate the pod's disruption budget.", with a ``DisruptionBudget`` cause naming
  how many healthy pods the budget needs and has. A pod that is not Ready may
  still go when the budget is met anyway (or with ``unhealthyPodEvictionPolicy:
  AlwaysAllow``), as on v1.26+.

A real cluster's disruption controller keeps each budget's status, and so does the
emulator's (:mod:`.disruption`), with :func:`budget_of`; the eviction works the same
figures out from the pods at its moment (so it never waits for a status write): the
expected pods are the matching ones (the controller reads their controllers' scale for
``maxUnavailable`` and percentages), ``currentHealthy`` the Ready ones not being
deleted, ``desiredHealthy`` from ``minAvailable`` or ``maxUnavailable`` (percentages
rounded up). An eviction does not record itself in the budget's ``disruptedPods``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, status_object
from .registry import DeleteOptions, PatchType, Registry, now_rfc3339
from .resources import ResourceType
from .selectors import parse_label_selector, selector_string

__all__ = ["DISRUPTION_CONDITION", "Budget", "budget_of", "evict", "pdb_verdict"]

#: The condition the API server adds to a pod it evicts.
DISRUPTION_CONDITION = {
    "type": "DisruptionTarget",
    "status": "True",
    "reason": "EvictionByEvictionAPI",
    "message": "Eviction API: evicting",
}


#: The message of a 429 answer to an eviction that a budget forbids.
VIOLATION = "Cannot evict pod as it would violate the pod's disruption budget."


@dataclass(frozen=True)
class Budget:
    """A PodDisruptionBudget's figures, as its status would hold them."""

    name: str
    expected_pods: int
    desired_healthy: int
    current_healthy: int

    @property
    def disruptions_allowed(self) -> int:
        return max(0, self.current_healthy - self.desired_healthy)


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _scaled(value: Any, total: int) -> int:
    """An IntOrString of the budget: an int, or a percentage of ``total`` rounded up."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def _selects(pdb: dict[str, Any], pod: dict[str, Any]) -> bool:
    # An empty or missing selector selects nothing here, as in the API server's eviction.
    selector = selector_string((pdb.get("spec") or {}).get("selector"))
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(r.matches(labels) for r in parse_label_selector(selector))


def budget_of(pdb: dict[str, Any], pods: Sequence[dict[str, Any]]) -> Budget:
    """The figures of ``pdb`` over the pods of its namespace (see the module docstring)."""
    spec = pdb.get("spec") or {}
    covered = [p for p in pods if _selects(pdb, p)]
    expected = len(covered)
    healthy = sum(1 for p in covered if _ready(p) and not p["metadata"].get("deletionTimestamp"))
    if spec.get("maxUnavailable") is not None:
        desired = max(0, expected - _scaled(spec["maxUnavailable"], expected))
    else:
        desired = _scaled(spec.get("minAvailable", 1), expected)
    return Budget(str(pdb["metadata"]["name"]), expected, desired, healthy)


def pdb_verdict(
    pod: dict[str, Any], pdbs: Sequence[dict[str, Any]], pods: Sequence[dict[str, Any]]
) -> ApiError | None:
    """Why evicting ``pod`` is refused given its namespace's budgets and pods, or None to go ahead."""
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Pending", "Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp"):
        return None  # not running: evicting it disrupts nothing
    if not pod["metadata"].get("labels"):
        return None
    matching = [b for b in pdbs if _selects(b, pod)]
    if not matching:
        return None
    if len(matching) > 1:
        why = (
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
        )
        return ApiError(
            500, "InternalError", f"Internal error occurred: {why}", {"causes": [{"message": why}]}
        )
    pdb = matching[0]
    budget = budget_of(pdb, pods)
    if not _ready(pod):
        policy = (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy")
        met = budget.current_healthy >= budget.desired_healthy and budget.desired_healthy > 0
        if policy == "AlwaysAllow" or met:
            return None  # an unhealthy pod of a met budget disrupts nothing more
    if budget.disruptions_allowed > 0:
        return None
    cause = (
        f"The disruption budget {budget.name} needs {budget.desired_healthy} healthy pods "
        f"and has {budget.current_healthy} currently"
    )
    return ApiError(
        429, "TooManyRequests", VIOLATION, {"causes": [{"reason": "DisruptionBudget", "message": cause}]}
    )


def evict(reg: Registry, rt: ResourceType, namespace: str, name: str, body: Any) -> dict[str, Any]:
    """Evict pod ``name`` (see the module docstring). Returns the Status to answer."""
    eviction = body if isinstance(body, dict) else {}
    given = (eviction.get("metadata") or {}).get("name")
    if given and given != name:
        raise ApiError.bad_request("name in URL does not match name in Eviction object")
    pod = reg.get(rt, namespace, name)
    if not pod["metadata"].get("deletionTimestamp"):
        budgets = reg.types.by_group_kind("policy", "PodDisruptionBudget")
        if budgets is not None:
            pdbs = reg.list(budgets, namespace).items
            refusal = pdb_verdict(pod, pdbs, reg.list(rt, namespace).items if pdbs else [])
            if refusal is not None:
                raise refusal
        status = pod.get("status") or {}
        if status.get("phase") not in ("Succeeded", "Failed"):
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"]
            conditions.append(
                {**DISRUPTION_CONDITION, "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            )
            reg.patch(
                rt,
                namespace,
                name,
                PatchType.MERGE,
                {"status": {"conditions": conditions}},
                subresource="status",
            )
        options = eviction.get("deleteOptions") or {}
        opts = DeleteOptions()
        opts.grace_period = options.get("gracePeriodSeconds")
        opts.propagation = options.get("propagationPolicy")
        reg.delete(rt, namespace, name, opts)
    return status_object("Success", 201, "", "")

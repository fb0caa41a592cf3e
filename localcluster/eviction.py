"""The pods/eviction subresource, as the API server (v1.26+) serves it.

``POST /api/v1/namespaces/NS/pods/NAME/eviction`` with a ``policy/v1`` (or
``v1beta1``) ``Eviction`` whose ``metadata.name`` is the pod's name:

* a pod already being deleted: nothing more happens, the answer is Success;
* a pod that has not ended (not Succeeded or Failed) first gets the condition
  ``DisruptionTarget=True`` (reason ``EvictionByEvictionAPI``, message ``Eviction
  API: evicting``), so its controller can tell an eviction from other deletions;
* then the pod is deleted with the Eviction's ``deleteOptions`` (grace period,
  propagation) and the answer is a ``Status`` Success with code 201.

The local cluster has no PodDisruptionBudget controller, so budgets are not
consulted: an eviction is never refused with 429 here.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError, status_object
from .registry import DeleteOptions, PatchType, Registry, now_rfc3339
from .resources import ResourceType

__all__ = ["DISRUPTION_CONDITION", "evict"]

#: The condition the API server adds to a pod it evicts.
DISRUPTION_CONDITION = {
    "type": "DisruptionTarget",
    "status": "True",
    "reason": "EvictionByEvictionAPI",
    "message": "Eviction API: evicting",
}


def evict(reg: Registry, rt: ResourceType, namespace: str, name: str, body: Any) -> dict[str, Any]:
    """Evict pod ``name`` (see the module docstring). Returns the Status to answer."""
    eviction = body if isinstance(body, dict) else {}
    given = (eviction.get("metadata") or {}).get("name")
    if given and given != name:
        raise ApiError.bad_request("name in URL does not match name in Eviction object")
    pod = reg.get(rt, namespace, name)
    if not pod["metadata"].get("deletionTimestamp"):
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

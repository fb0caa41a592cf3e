"""Disruptions: a worker pod evicted or preempted, which is not a failure of the training (pure).

Kubernetes says a pod was disrupted in two ways:

* the ``DisruptionTarget`` condition (Kubernetes v1.26 and later), with a reason
  naming who did it: ``EvictionByEvictionAPI`` (``kubectl drain``, the eviction
  API), ``PreemptionByScheduler`` (a higher-priority pod needed the room),
  ``TerminationByKubelet`` (node pressure, node shutdown), ``DeletionByTaintManager``,
  ``DeletionByPodGC``;
* the pod's ``status.reason`` set by the kubelet when it ends the pod for the node's
  sake: ``Evicted`` (node pressure), ``Terminated``/``Shutdown``/``NodeShutdown``
  (graceful node shutdown), ``Preempting`` (kubelet admission preemption).

On Kubernetes v1.20-v1.25 an eviction through the API carries no condition: the pod
is just deleted, which the operator treats like any lost pod (the job shrinks, a new
pod is created), only without a named reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CONDITION_DISRUPTED", "DISRUPTION_POD_REASONS", "describe", "disruption_reason"]

#: The ElasticJob condition set while workers are being replaced after a disruption.
CONDITION_DISRUPTED = "Disrupted"

#: ``status.reason`` values a kubelet gives a pod it ended for the node's sake.
DISRUPTION_POD_REASONS = frozenset({"Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown"})

_WORDS = {
    "EvictionByEvictionAPI": "evicted",
    "PreemptionByScheduler": "preempted",
    "PreemptionByKubeScheduler": "preempted",
    "Preempting": "preempted",
    "TerminationByKubelet": "ended by its node",
    "Evicted": "evicted by its node",
    "Terminated": "ended by its node's shutdown",
    "Shutdown": "ended by its node's shutdown",
    "NodeShutdown": "ended by its node's shutdown",
    "DeletionByTaintManager": "deleted by the taint manager",
    "DeletionByPodGC": "deleted by the pod garbage collector",
}


def disruption_reason(status: Mapping[str, Any]) -> str | None:
    """Why the pod with this ``status`` was disrupted, or None when it was not."""
    conditions: Sequence[Mapping[str, Any]] = status.get("conditions") or ()
    for c in conditions:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return str(c.get("reason") or "DisruptionTarget")
    reason = status.get("reason")
    return str(reason) if reason in DISRUPTION_POD_REASONS else None


def describe(pod_name: str, reason: str) -> str:
    """``worker pod x was evicted (EvictionByEvictionAPI)``."""
    return f"worker pod {pod_name} was {_WORDS.get(reason, 'disrupted')} ({reason})"

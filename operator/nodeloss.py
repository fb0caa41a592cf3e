"""A node lost under a job: how long its pods stay bound to it, and whether the control plane
gave it up (pure).

When a node stops reporting (its kubelet dead, its network cut), the node lifecycle
controller marks it ``Ready=Unknown`` (``False`` for a kubelet that reports it is not
ready) and taints it ``node.kubernetes.io/unreachable`` (``not-ready``) with effect
``NoExecute``. The taint eviction controller then deletes every pod that does not tolerate
the taint, once its ``tolerationSeconds`` ran out (the API server gives every pod 300 s
unless its spec says otherwise), with a ``DisruptionTarget`` condition of reason
``DeletionByTaintManager``. Such a deletion never completes: only the node's kubelet
could confirm that the containers stopped, and it is gone. The pod stays ``Terminating``
and its name stays taken, so the job's replacement for it cannot be created.

So the operator gives its worker and store pods a short toleration of both taints
(:func:`with_node_loss_tolerations`), and force-deletes a pod that the taint manager
deleted from a node the control plane gave up (:func:`node_lost`;
``kelastic.operator.reconcile.lost_node``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULT_TOLERATION_SECONDS",
    "NODE_LOSS_TAINTS",
    "TAINT_MANAGER_REASON",
    "node_lost",
    "with_node_loss_tolerations",
]

#: The taints the node lifecycle controller puts on a node that stopped reporting or is not ready.
NODE_LOSS_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
#: The ``DisruptionTarget`` reason of a pod the taint eviction controller deleted
#: (``pkg/controller/tainteviction``, Kubernetes v1.26 and later).
TAINT_MANAGER_REASON = "DeletionByTaintManager"
#: How long the operator's pods stay bound to a lost node by default (seconds): long
#: enough that a node missing one status update keeps its pods (the control plane marks
#: it NotReady only after ``--node-monitor-grace-period`` of silence, 50 s by default).
DEFAULT_TOLERATION_SECONDS = 5


def with_node_loss_tolerations(
    tolerations: Sequence[Mapping[str, Any]], seconds: int
) -> list[dict[str, Any]]:
    """``tolerations`` plus a ``NoExecute`` toleration of each of :data:`NODE_LOSS_TAINTS` for
    ``seconds``, for each taint that ``tolerations`` do not already name (the user's own
    setting for a key wins, whatever its effect and seconds; so does a toleration of every
    taint: no key and ``operator: Exists``)."""
    result = [dict(t) for t in tolerations]
    if any(not t.get("key") and t.get("operator") == "Exists" for t in result):
        return result
    named = {t.get("key") for t in result}
    for key in NODE_LOSS_TAINTS:
        if key not in named:
            result.append(
                {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            )
    return result


def node_lost(node: Mapping[str, Any] | None) -> str | None:
    """Why the control plane gave up the node ``node`` (a Node object; None: it does not exist),
    or None while it holds it: ``"NotReady"`` or ``"unreachable"`` (its ``Ready`` condition
    False or Unknown, or one of :data:`NODE_LOSS_TAINTS` as ``NoExecute``), ``"gone"``."""
    if node is None:
        return "gone"
    for taint in (node.get("spec") or {}).get("taints") or ():
        if taint.get("effect") == "NoExecute" and taint.get("key") in NODE_LOSS_TAINTS:
            return "unreachable" if taint["key"] == NODE_LOSS_TAINTS[0] else "NotReady"
    for condition in (node.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            status = condition.get("status")
            return None if status == "True" else ("NotReady" if status == "False" else "unreachable")
    return None

"""Policy: a worker or store pod that the control plane evicted from a lost node is
force-deleted, so that its replacement can start (``kelastic.operator.nodeloss``).

Such a pod stays ``Terminating`` for as long as its node is away: only its kubelet could
say its containers stopped. Its name stays taken meanwhile, and the scaling and store
policies create a pod only under a free name. The operator removes it (grace period 0,
this incarnation only) when both hold:

* the taint manager deleted it (its ``DisruptionTarget`` reason is ``DeletionByTaintManager``):
  the control plane itself gave the pod up, after its toleration of the node-loss taints;
* its node reads lost now (``Observed.lost_nodes``: NotReady, unreachable or gone).

A pod that is slow to stop on a node that still reports is left to its kubelet; so is a
pod that someone else deleted, whatever its node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kelastic.agent import contract
from kelastic.operator import nodeloss
from kelastic.operator.observed import PodView
from kelastic.operator.reconcile.actions import DeletePod
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, store_pods

#: The reason of the Event and of the action.
REASON = "ForceDeleted"


def step(p: Pass, job: ActiveJob) -> Next:
    """Force-delete each worker and store pod of the job that :func:`abandoned` says the control
    plane gave up with its node."""
    for pod in [*job.workers, *store_pods(p)]:
        why = abandoned(pod, p.observed.lost_nodes)
        if why is None:
            continue
        what = "rendezvous store pod" if pod.role == contract.ROLE_RENDEZVOUS else "worker pod"
        p.actions.append(
            DeletePod(
                reason=REASON,
                message=(
                    f"{what} {pod.name} was on node {pod.node}, which is {why}; its containers cannot be "
                    "stopped there: deleted so that its replacement can start"
                ),
                warning=True,
                name=pod.name,
                uid=pod.uid,
                grace_seconds=0,
            )
        )
    return Next.CONTINUE


def _evicted_from(pod: PodView) -> str | None:
    """The node the taint manager deleted ``pod`` from, or None (not deleted by it, or unbound)."""
    if pod.node and pod.terminating and pod.disruption == nodeloss.TAINT_MANAGER_REASON:
        return pod.node
    return None


def abandoned(pod: PodView, lost_nodes: Mapping[str, str]) -> str | None:
    """Why ``pod`` may be force-deleted (its node's state, from ``lost_nodes``), or None."""
    node = _evicted_from(pod)
    return None if node is None else lost_nodes.get(node)


def nodes_to_read(pods: Iterable[PodView]) -> set[str]:
    """The nodes whose state decides about ``pods``: those of the pods the taint manager
    deleted (the controller reads them into ``Observed.lost_nodes``)."""
    return {node for node in map(_evicted_from, pods) if node is not None}

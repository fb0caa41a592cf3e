"""Preemption, where the kubelet places pods itself (the emulator has no kube-scheduler).

A pod that waits for GPUs takes them from pods of lower priority, as kube-scheduler's
preemption does: :func:`choose_victims` picks them (only pods of lower priority, all of
them first, then as many as can be spared given back, highest priority first, so the
fewest and the least important go), and :func:`preempt` does what the scheduler does to
them and to the pod:

- each victim gets the condition ``DisruptionTarget=True`` (reason
  ``PreemptionByScheduler``, message ``default-scheduler: preempting to accommodate a
  higher priority pod``) and the Event ``Preempted`` (``Preempted by pod <uid> on node
  <node>``), then is deleted with its own grace period;
- the waiting pod is marked ``PodScheduled=False`` (``Unschedulable``, saying it found a
  placement and how many victims it preempts), gets ``status.nominatedNodeName`` and the
  Event ``FailedScheduling``; it is bound once their GPUs are free.

A pod whose ``preemptionPolicy`` is ``Never`` preempts nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..common.client import ApiRequestError
from .gpus import GPU_RESOURCE
from .nodeview import KubeletView
from .podstatus import rfc3339

__all__ = ["Holder", "choose_victims", "preempt", "unschedulable_message"]

log = logging.getLogger(__name__)

SCHEDULER = "default-scheduler"
DISRUPTION = {
    "type": "DisruptionTarget",
    "status": "True",
    "reason": "PreemptionByScheduler",
    "message": f"{SCHEDULER}: preempting to accommodate a higher priority pod",
}


@dataclass(frozen=True)
class Holder:
    """A pod that holds GPUs of the node."""

    uid: str
    namespace: str
    name: str
    priority: int
    gpus: int


def choose_victims(
    priority: int, policy: str, wanted: int, free: int, holders: Iterable[Holder]
) -> list[Holder]:
    """The pods to preempt so that a pod of ``priority`` gets ``wanted`` GPUs with ``free`` free
    now; empty when it may not preempt or preempting every lower pod would not do."""
    if policy == "Never":
        return []
    lower = [h for h in holders if h.priority < priority and h.gpus > 0]
    if free >= wanted or free + sum(h.gpus for h in lower) < wanted:
        return []
    victims = sorted(lower, key=lambda h: (h.priority, h.name))
    for spared in sorted(lower, key=lambda h: (-h.priority, h.name)):
        if free + sum(v.gpus for v in victims if v is not spared) >= wanted:
            victims.remove(spared)
    return victims


def unschedulable_message(node: str, victims: int | None) -> str:
    """What kube-scheduler says of a pod that does not fit for want of GPUs (and, with
    ``victims``, that it preempts that many pods to make room)."""
    message = f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE}."
    if victims:
        message += (
            f" preemption: found a potential placement for pod on node {node}, preempting {victims} victims"
        )
    return message


def holders(kubelet: KubeletView, held: Iterable[str]) -> list[Holder]:
    """The pods of ``held`` (uids holding GPUs) as :class:`Holder` s."""
    by_uid = {str(p["metadata"].get("uid")): p for p in kubelet.pods.values()}
    out = []
    for uid in held:
        pod = by_uid.get(uid)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            continue
        devices = kubelet.gpus.held(uid) or {}
        out.append(
            Holder(
                uid,
                str(pod["metadata"].get("namespace", "default")),
                str(pod["metadata"]["name"]),
                int((pod.get("spec") or {}).get("priority") or 0),
                len({d for ds in devices.values() for d in ds}),
            )
        )
    return out


async def preempt(kubelet: KubeletView, pod: Mapping[str, Any], victims: list[Holder]) -> None:
    """Mark and delete ``victims``, and say so on ``pod`` (see the module docstring)."""
    node = kubelet.config.node_name
    meta = pod["metadata"]
    now = rfc3339(time.time())
    for victim in victims:
        path = f"/api/v1/namespaces/{victim.namespace}/pods/{victim.name}"
        target = kubelet.pods.get(f"{victim.namespace}/{victim.name}") or {"metadata": {}}
        generation = target["metadata"].get("generation", 1)
        condition = {
            **DISRUPTION,
            "observedGeneration": generation,
            "lastProbeTime": None,
            "lastTransitionTime": now,
        }
        try:
            await kubelet.client.strategic_patch(path + "/status", {"status": {"conditions": [condition]}})
            kubelet.event(
                target, "Preempted", f"Preempted by pod {meta.get('uid')} on node {node}", component=SCHEDULER
            )
            await kubelet.client.delete(path)
        except ApiRequestError as exc:  # gone meanwhile: its GPUs are free anyway
            log.debug("could not preempt pod %s/%s: %s", victim.namespace, victim.name, exc)
    message = unschedulable_message(node, len(victims))
    condition = {
        "type": "PodScheduled",
        "observedGeneration": meta.get("generation", 1),
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
        "lastProbeTime": None,
        "lastTransitionTime": now,
    }
    path = f"/api/v1/namespaces/{meta.get('namespace', 'default')}/pods/{meta['name']}/status"
    try:
        await kubelet.client.strategic_patch(
            path, {"status": {"phase": "Pending", "nominatedNodeName": node, "conditions": [condition]}}
        )
    except ApiRequestError as exc:
        log.debug("could not nominate pod %s for node %s: %s", meta.get("name"), node, exc)
    kubelet.event(pod, "FailedScheduling", message, warning=True, component=SCHEDULER)

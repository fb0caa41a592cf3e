"""Gang scheduling: the PodGroup of a job for Volcano or the scheduler-plugins coscheduling plugin (pure).

Which gang scheduler a job uses follows its worker template's ``schedulerName``:

* ``volcano`` → a ``scheduling.volcano.sh/v1beta1`` PodGroup; worker pods carry the
  annotation ``scheduling.k8s.io/group-name``;
* the coscheduling scheduler's name (``kelastic-operator --coscheduling-scheduler-name``,
  default ``scheduler-plugins-scheduler``, the name the scheduler-plugins chart gives
  its second scheduler) → a ``scheduling.x-k8s.io/v1alpha1`` PodGroup; worker pods
  carry the label ``scheduling.x-k8s.io/pod-group``;
* any other scheduler: no PodGroup.

The PodGroup is named after the job, owned by it (removed with it) and built from
``spec.schedulingPolicy``: ``minMember`` is ``minAvailable``, by default
``spec.minReplicas`` (not the number of replicas, so an elastic job starts as soon
as its minimum fits), and never more than the replicas the job runs now (it is
updated on scale). Only workers count: the rendezvous store pod is scheduled by the
default scheduler, outside the gang (it is tiny, and the workers cannot start
without it anyway). ``queue`` and ``priorityClass`` go to Volcano's ``queue`` and
``priorityClassName`` (a coscheduling PodGroup has neither: give the pods a
``priorityClassName`` in the template); ``scheduleTimeoutSeconds`` goes to the
coscheduling PodGroup's ``scheduleTimeoutSeconds`` (Volcano's PodGroup has none).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kelastic.agent import contract
from kelastic.operator.spec import JobSpec

__all__ = [
    "DEFAULT_COSCHEDULING_SCHEDULER",
    "GangScheduler",
    "PodGroupRef",
    "gang_scheduler",
    "member_marks",
    "min_member",
    "pod_group",
    "pod_group_path",
]

#: The scheduler name of scheduler-plugins' second scheduler (its Helm chart's default).
DEFAULT_COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"


class GangScheduler(str, enum.Enum):
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"


@dataclass(frozen=True)
class PodGroupRef:
    """Where a scheduler's PodGroups live and how a pod names its group."""

    api_version: str
    plural: str
    #: The pod label (coscheduling) or annotation (Volcano) naming the group.
    member_key: str
    member_is_label: bool


REFS: Mapping[GangScheduler, PodGroupRef] = {
    GangScheduler.VOLCANO: PodGroupRef(
        "scheduling.volcano.sh/v1beta1", "podgroups", "scheduling.k8s.io/group-name", False
    ),
    GangScheduler.COSCHEDULING: PodGroupRef(
        "scheduling.x-k8s.io/v1alpha1", "podgroups", "scheduling.x-k8s.io/pod-group", True
    ),
}


def gang_scheduler(
    spec: JobSpec, coscheduling_scheduler: str = DEFAULT_COSCHEDULING_SCHEDULER
) -> GangScheduler | None:
    """The gang scheduler the job's worker template names, or None."""
    name = (spec.template.get("spec") or {}).get("schedulerName")
    if name == "volcano":
        return GangScheduler.VOLCANO
    if name and name == coscheduling_scheduler:
        return GangScheduler.COSCHEDULING
    return None


def min_member(spec: JobSpec) -> int:
    """Workers that must be placed together: ``minAvailable`` (default ``minReplicas``), at most ``replicas``."""
    policy = spec.scheduling_policy
    wanted = (
        policy.min_available if policy is not None and policy.min_available is not None else spec.min_replicas
    )
    return max(1, min(wanted, spec.replicas))


def member_marks(kind: GangScheduler, group: str) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) a worker pod of ``group`` carries for ``kind``."""
    ref = REFS[kind]
    return ({ref.member_key: group}, {}) if ref.member_is_label else ({}, {ref.member_key: group})


def pod_group_path(kind: GangScheduler, namespace: str) -> str:
    """The collection URL of ``kind``'s PodGroups in ``namespace``."""
    return f"/apis/{REFS[kind].api_version}/namespaces/{quote(namespace)}/{REFS[kind].plural}"


def pod_group(
    kind: GangScheduler, *, name: str, namespace: str, spec: JobSpec, owner: Mapping[str, Any]
) -> dict[str, Any]:
    """The PodGroup ``name`` of a job with ``spec`` (see the module docstring)."""
    policy = spec.scheduling_policy
    group_spec: dict[str, Any] = {"minMember": min_member(spec)}
    if kind is GangScheduler.VOLCANO:
        if policy is not None and policy.queue:
            group_spec["queue"] = policy.queue
        if policy is not None and policy.priority_class:
            group_spec["priorityClassName"] = policy.priority_class
    elif policy is not None and policy.schedule_timeout_seconds is not None:
        group_spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
    return {
        "apiVersion": REFS[kind].api_version,
        "kind": "PodGroup",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {contract.LABEL_JOB_NAME: name},
            "ownerReferences": [dict(owner)],
        },
        "spec": group_spec,
    }

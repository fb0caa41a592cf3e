"""Gang scheduling: the PodGroup of a job for kube-scheduler, Volcano or the coscheduling plugin (pure).

Which gang scheduler a job uses follows its worker template's ``schedulerName``:

* ``volcano`` → a ``scheduling.volcano.sh/v1beta1`` PodGroup; worker pods carry the
  annotation ``scheduling.k8s.io/group-name``;
* the coscheduling scheduler's name (``kelastic-operator --coscheduling-scheduler-name``,
  default ``scheduler-plugins-scheduler``, the name the scheduler-plugins chart gives
  its second scheduler) → a ``scheduling.x-k8s.io/v1alpha1`` PodGroup; worker pods
  carry the label ``scheduling.x-k8s.io/pod-group``;
* any other scheduler, where the API server serves ``scheduling.k8s.io/v1beta1``
  PodGroups (Kubernetes' own workload-aware scheduling, the ``GenericWorkload`` feature;
  the operator learns it from discovery: ``kubernetes`` below) → such a PodGroup with a
  gang policy (``schedulingPolicy.gang.minCount``); worker pods name it in
  ``spec.schedulingGroup.podGroupName``. kube-scheduler then binds none of the group's
  pods until ``minCount`` of them can be placed together; pods beyond ``minCount`` (the
  replicas above the minimum, standbys) are placed one by one as room appears;
* otherwise: no PodGroup.

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
kube-scheduler requires a PodGroup's priority to equal its pods': its PodGroup takes the
template's ``priorityClassName`` (``schedulingPolicy.priorityClass`` is Volcano's only),
and it has no timeout (kube-scheduler retries an unplaceable gang with its usual back-off;
the job's ``minReplicasTimeout`` bounds the wait).
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
    "KUBERNETES_API_VERSION",
    "MIN_FIELD",
    "GangScheduler",
    "MemberMark",
    "MemberMarks",
    "PodGroupRef",
    "gang_scheduler",
    "member_marks",
    "min_member",
    "pod_group",
    "pod_group_path",
]

#: The scheduler name of scheduler-plugins' second scheduler (its Helm chart's default).
DEFAULT_COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"
#: The API version of Kubernetes' own PodGroups (served with the ``GenericWorkload`` feature).
KUBERNETES_API_VERSION = "scheduling.k8s.io/v1beta1"


class GangScheduler(str, enum.Enum):
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"
    #: kube-scheduler's own gang scheduling (``scheduling.k8s.io/v1beta1`` PodGroups).
    KUBERNETES = "kubernetes"


class MemberMark(str, enum.Enum):
    """How a pod names its group."""

    LABEL = "label"
    ANNOTATION = "annotation"
    #: ``spec.schedulingGroup.podGroupName`` (a field of the pod, immutable).
    SCHEDULING_GROUP = "schedulingGroup"


@dataclass(frozen=True)
class PodGroupRef:
    """Where a scheduler's PodGroups live and how a pod names its group."""

    api_version: str
    plural: str
    #: The pod label (coscheduling) or annotation (Volcano) naming the group ("" for a pod field).
    member_key: str
    mark: MemberMark


@dataclass(frozen=True)
class MemberMarks:
    """What a worker pod of a group carries: labels, annotations, and the pod's
    ``schedulingGroup`` (None when the scheduler reads a label or an annotation)."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    scheduling_group: Mapping[str, str] | None = None


REFS: Mapping[GangScheduler, PodGroupRef] = {
    GangScheduler.VOLCANO: PodGroupRef(
        "scheduling.volcano.sh/v1beta1", "podgroups", "scheduling.k8s.io/group-name", MemberMark.ANNOTATION
    ),
    GangScheduler.COSCHEDULING: PodGroupRef(
        "scheduling.x-k8s.io/v1alpha1", "podgroups", "scheduling.x-k8s.io/pod-group", MemberMark.LABEL
    ),
    GangScheduler.KUBERNETES: PodGroupRef(
        KUBERNETES_API_VERSION, "podgroups", "", MemberMark.SCHEDULING_GROUP
    ),
}


#: The name of the PodGroup's minimum, for messages.
MIN_FIELD: Mapping[GangScheduler, str] = {
    GangScheduler.VOLCANO: "minMember",
    GangScheduler.COSCHEDULING: "minMember",
    GangScheduler.KUBERNETES: "minCount",
}


def gang_scheduler(
    spec: JobSpec, coscheduling_scheduler: str = DEFAULT_COSCHEDULING_SCHEDULER, *, kubernetes: bool = False
) -> GangScheduler | None:
    """The gang scheduler of the job's workers: the one the template names, else Kubernetes' own
    where ``kubernetes`` (the API server serves its PodGroups), else None."""
    name = (spec.template.get("spec") or {}).get("schedulerName")
    if name == "volcano":
        return GangScheduler.VOLCANO
    if name and name == coscheduling_scheduler:
        return GangScheduler.COSCHEDULING
    return GangScheduler.KUBERNETES if kubernetes else None


def min_member(spec: JobSpec) -> int:
    """Workers that must be placed together: ``minAvailable`` (default ``minReplicas``), at most ``replicas``."""
    policy = spec.scheduling_policy
    wanted = (
        policy.min_available if policy is not None and policy.min_available is not None else spec.min_replicas
    )
    return max(1, min(wanted, spec.replicas))


def member_marks(kind: GangScheduler, group: str) -> MemberMarks:
    """What a worker pod of ``group`` carries for ``kind``."""
    ref = REFS[kind]
    if ref.mark is MemberMark.LABEL:
        return MemberMarks({ref.member_key: group}, {})
    if ref.mark is MemberMark.ANNOTATION:
        return MemberMarks({}, {ref.member_key: group})
    return MemberMarks({}, {}, {"podGroupName": group})


def pod_group_path(kind: GangScheduler, namespace: str) -> str:
    """The collection URL of ``kind``'s PodGroups in ``namespace``."""
    return f"/apis/{REFS[kind].api_version}/namespaces/{quote(namespace)}/{REFS[kind].plural}"


def pod_group(
    kind: GangScheduler, *, name: str, namespace: str, spec: JobSpec, owner: Mapping[str, Any]
) -> dict[str, Any]:
    """The PodGroup ``name`` of a job with ``spec`` (see the module docstring)."""
    policy = spec.scheduling_policy
    if kind is GangScheduler.KUBERNETES:
        group_spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": min_member(spec)}}}
        priority_class = (spec.template.get("spec") or {}).get("priorityClassName")
        if priority_class:
            group_spec["priorityClassName"] = priority_class
    else:
        group_spec = {"minMember": min_member(spec)}
    if kind is GangScheduler.VOLCANO:
        if policy is not None and policy.queue:
            group_spec["queue"] = policy.queue
        if policy is not None and policy.priority_class:
            group_spec["priorityClassName"] = policy.priority_class
    elif (
        kind is GangScheduler.COSCHEDULING
        and policy is not None
        and policy.schedule_timeout_seconds is not None
    ):
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

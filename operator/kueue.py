"""Admission by Kueue, decided purely: which Workloads a queued ElasticJob has, and what
Kueue's grant means for its workers.

A job labelled ``kueue.x-k8s.io/queue-name: <LocalQueue>`` asks Kueue for its workers
through Workloads (``kueue.x-k8s.io/v1beta2``) that the operator owns, the way Kueue's
own job integrations do (the ElasticJob kind is one of Kueue's
``integrations.externalFrameworks``):

* the **base** Workload: one pod set ``workers`` of ``replicas`` pods with the worker
  template's requests and ``minCount: minReplicas``, so Kueue may admit any count in
  ``[minReplicas, replicas]`` that fits the ClusterQueue (partial admission);
* while the base is admitted below ``replicas``, one pending **growth** Workload for the
  rest (``minCount: 1``): Kueue admits it, or part of it, when quota frees up. Each
  admitted growth Workload adds its count to the grant; the next one asks for what is
  still missing.

The **grant** is the sum of the admitted counts of the base and the growth Workloads
that are neither evicted nor finished; it is 0 until the base is admitted. The job runs
``min(replicas, grant)`` workers, never more. When Kueue evicts (preempts) a Workload,
the grant drops at once, so the workers above it are deleted (the group shrinks and
restores its memory checkpoint); once they are gone the operator clears the Workload's
quota reservation, which is what Kueue waits for before it admits the preemptor (as
Kueue's job reconciler does after stopping a job). An evicted growth Workload is then
pending again: the growth request. An evicted base stops the whole job (its growth
Workloads are deleted once their pods are gone) until Kueue admits the base again.

Each admitted Workload places its workers as Kueue's own job integrations place a job's
pods: the ResourceFlavors it was admitted to (``podSetAssignments[].flavors``) add their
``nodeLabels`` to the pods' ``nodeSelector`` and their ``tolerations`` to the pods'
(:class:`Placement`). Workers are counted against the granted Workloads in the order they
were made (the base first): worker ``i`` gets the placement of the Workload whose share
holds ``i``.

A finished job finishes its Workloads at once (condition ``Finished``), which releases
their quota. Nothing here talks to the API: :func:`plan` returns the changes, the
controller carries them out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kelastic.agent import contract
from kelastic.operator.spec import Job, JobSpec, format_time

__all__ = [
    "API_VERSION",
    "GROUP",
    "POD_SET",
    "PRIORITY_LABEL",
    "QUEUE_LABEL",
    "ClearReservation",
    "CreateWorkload",
    "DeleteWorkload",
    "FinishWorkload",
    "FlavorView",
    "Grant",
    "Inputs",
    "Part",
    "Placement",
    "QueuePlan",
    "ReadyWorkload",
    "WorkloadChange",
    "WorkloadView",
    "clear_reservation_status",
    "finish_status",
    "flavor_view",
    "placement",
    "plan",
    "pods_ready_status",
    "queue_name",
    "with_placement",
    "workload_view",
]

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
#: The ElasticJob label that puts a job in a LocalQueue (Kueue's own label name).
QUEUE_LABEL = f"{GROUP}/queue-name"
#: The ElasticJob label naming a WorkloadPriorityClass (Kueue's own label name).
PRIORITY_LABEL = f"{GROUP}/priority-class"
#: The one pod set of a job's Workloads.
POD_SET = "workers"
#: Label of the operator's Workloads: which part of the job's request each one is.
PART_LABEL = "kelastic.dev/kueue-part"
#: Label of the operator's Workloads: the order in which they were made (0: the base).
SEQ_LABEL = "kelastic.dev/kueue-seq"


class Part(str, enum.Enum):
    BASE = "base"
    GROWTH = "growth"


@dataclass(frozen=True)
class WorkloadView:
    """A Workload of a job, as the planner needs it."""

    name: str
    part: Part
    seq: int
    #: ``spec.podSets[0].count`` and ``minCount`` as requested.
    count: int
    min_count: int | None
    owner_uid: str | None = None
    resource_version: str = ""
    #: The admitted count (``status.admission.podSetAssignments[0].count``) while the
    #: Workload holds a quota reservation, else None.
    reserved: int | None = None
    #: ``Admitted`` is True (quota reserved and every admission check ready).
    admitted: bool = False
    #: ``Evicted`` is True: (reason, message).
    evicted: tuple[str, str] | None = None
    finished: bool = False
    cluster_queue: str | None = None
    #: Kueue's word on why it is not admitted (``QuotaReserved`` False: reason, message).
    pending: tuple[str, str] | None = None
    #: The conditions as stored (kept when a change rewrites them).
    conditions: tuple[Mapping[str, Any], ...] = ()
    #: Whether ``PodsReady`` is True.
    pods_ready: bool = False
    #: The ResourceFlavors of the admission (``podSetAssignments[0].flavors``), sorted.
    flavors: tuple[str, ...] = ()

    @property
    def granted(self) -> int:
        """Workers this Workload lets the job run now (0 unless admitted and not evicted)."""
        if self.finished or self.evicted is not None or not self.admitted or self.reserved is None:
            return 0
        return self.reserved


def _condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    for cond in conditions:
        if cond.get("type") == kind:
            return cond
    return None


def _true(conditions: Sequence[Mapping[str, Any]], kind: str) -> bool:
    cond = _condition(conditions, kind)
    return cond is not None and cond.get("status") == "True"


def workload_view(body: Mapping[str, Any]) -> WorkloadView | None:
    """A Workload object → its view; None if it is not one of the operator's (no part label)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        part = Part(labels.get(PART_LABEL))
        seq = int(labels.get(SEQ_LABEL, "0"))
    except ValueError:
        return None
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    pod_sets = spec.get("podSets") or [{}]
    conditions = tuple(status.get("conditions") or ())
    admission = status.get("admission") or None
    reserved: int | None = None
    flavors: tuple[str, ...] = ()
    if admission is not None and _true(conditions, "QuotaReserved"):
        assignments = admission.get("podSetAssignments") or [{}]
        count = assignments[0].get("count")
        reserved = int(count) if count is not None else int(pod_sets[0].get("count") or 0)
        flavors = tuple(sorted({str(f) for f in (assignments[0].get("flavors") or {}).values()}))
    evicted = _condition(conditions, "Evicted")
    quota = _condition(conditions, "QuotaReserved")
    owner = next(
        (o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")),
        None,
    )
    return WorkloadView(
        name=str(meta.get("name", "")),
        part=part,
        seq=seq,
        count=int(pod_sets[0].get("count") or 0),
        min_count=pod_sets[0].get("minCount"),
        owner_uid=owner,
        resource_version=str(meta.get("resourceVersion", "")),
        reserved=reserved,
        admitted=_true(conditions, "Admitted"),
        evicted=(
            (str(evicted.get("reason", "")), str(evicted.get("message", "")))
            if evicted is not None and evicted.get("status") == "True"
            else None
        ),
        finished=_true(conditions, "Finished"),
        cluster_queue=(admission or {}).get("clusterQueue"),
        pending=(
            (str(quota.get("reason", "")), str(quota.get("message", "")))
            if quota is not None and quota.get("status") == "False"
            else None
        ),
        conditions=conditions,
        pods_ready=_true(conditions, "PodsReady"),
        flavors=flavors,
    )


@dataclass(frozen=True)
class Placement:
    """Where the workers of one admitted Workload may run: what its ResourceFlavors add to a pod."""

    #: Workers of this share (the Workload's granted count).
    count: int
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    #: The flavors, for messages.
    flavors: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlavorView:
    """What a ResourceFlavor adds to the pods admitted to it."""

    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


def flavor_view(body: Mapping[str, Any]) -> FlavorView:
    """A ResourceFlavor object → what it adds to pods (``spec.nodeLabels``, ``spec.tolerations``)."""
    spec = body.get("spec") or {}
    return FlavorView(
        node_labels={str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()},
        tolerations=tuple(dict(t) for t in spec.get("tolerations") or ()),
    )


def placement(wl: WorkloadView, flavors: Mapping[str, FlavorView]) -> Placement:
    """The placement of ``wl``'s granted workers: its flavors' node labels and tolerations merged."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for name in wl.flavors:
        flavor = flavors.get(name, FlavorView())
        selector.update(flavor.node_labels)
        tolerations += [t for t in flavor.tolerations if t not in tolerations]
    return Placement(wl.granted, selector, tuple(tolerations), wl.flavors)


def with_placement(manifest: Mapping[str, Any], where: Placement | None) -> dict[str, Any]:
    """A worker pod ``manifest`` placed as ``where`` says: the flavors' node labels merged into its
    ``nodeSelector`` (a flavor's value wins over the template's for the same key: Kueue counted
    the pod in that flavor) and their tolerations added (none twice)."""
    out = dict(manifest)
    if where is None or not (where.node_selector or where.tolerations):
        return out
    spec = dict(out.get("spec") or {})
    if where.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **where.node_selector}
    if where.tolerations:
        own = list(spec.get("tolerations") or [])
        spec["tolerations"] = own + [dict(t) for t in where.tolerations if t not in own]
    out["spec"] = spec
    return out


def queue_name(job: Job) -> str | None:
    """The LocalQueue the job is queued in, or None when Kueue does not manage it."""
    name = job.meta.labels.get(QUEUE_LABEL)
    return name or None


# ---------------------------------------------------------------- the changes


@dataclass(frozen=True)
class WorkloadChange:
    """A change to one of the job's Workloads; ``message`` is said in the job's Event."""

    reason: str
    message: str


@dataclass(frozen=True)
class CreateWorkload(WorkloadChange):
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeleteWorkload(WorkloadChange):
    name: str = ""
    #: The resourceVersion the decision saw (a precondition: a Workload Kueue changed since is kept).
    resource_version: str = ""


@dataclass(frozen=True)
class ClearReservation(WorkloadChange):
    """Release an evicted Workload's quota (its workers are gone): the status to write."""

    name: str = ""
    resource_version: str = ""
    status: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishWorkload(WorkloadChange):
    name: str = ""
    resource_version: str = ""
    status: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grant:
    """What Kueue lets the job run now, and why it waits for more."""

    queue: str
    #: Workers admitted now (0: the job waits for its base to be admitted).
    admitted: int
    #: Workers the job asks for beyond the grant (pending in Kueue).
    pending: int
    cluster_queue: str | None = None
    #: Kueue's word on the pending request (QuotaReserved False), or on an eviction.
    reason: str | None = None
    message: str | None = None
    #: The base Workload was evicted (preempted, or its pods not ready in time).
    evicted: bool = False
    #: Where the granted workers run, one share per admitted Workload, in the order they were made.
    placements: tuple[Placement, ...] = ()

    def placement_of(self, index: int) -> Placement | None:
        """The placement of worker ``index``: that of the share holding it (None beyond the grant)."""
        start = 0
        for share in self.placements:
            if index < start + share.count:
                return share
            start += share.count
        return None

    def summary(self) -> str:
        """The short text of ``kubectl get ej``'s Queue column."""
        head = f"{self.queue}: {self.admitted} admitted"
        if self.pending:
            head += f", {self.pending} pending"
        if self.evicted:
            return f"{head} ({self.reason or 'Evicted'})"
        return head


@dataclass(frozen=True)
class QueuePlan:
    grant: Grant
    changes: tuple[WorkloadChange, ...] = ()
    #: Admitted Workloads whose ``PodsReady`` to set True: every admitted worker runs and is
    #: ready (Kueue's ``waitForPodsReady`` evicts a Workload that stays without it).
    pods_ready: tuple[ReadyWorkload, ...] = ()


@dataclass(frozen=True)
class ReadyWorkload:
    name: str
    resource_version: str
    status: Mapping[str, Any] = field(default_factory=dict)


def _name(job: Job, part: Part, seq: int) -> str:
    # Workload names are DNS subdomains (253); a job name is at most 52 characters.
    suffix = "base" if part is Part.BASE else f"grow-{seq}"
    return f"{job.meta.name}-{job.meta.uid[:8]}-{suffix}"


def _manifest(
    job: Job,
    spec: JobSpec,
    queue: str,
    part: Part,
    seq: int,
    count: int,
    min_count: int,
    priority: tuple[str, int] | None,
) -> dict[str, Any]:
    template = dict(spec.template)
    pod_spec = dict(template.get("spec") or {})
    # Kueue counts the requests of the pod template; the template is the worker pod's.
    pod_set: dict[str, Any] = {
        "name": POD_SET,
        "count": count,
        "template": {"metadata": dict(template.get("metadata") or {}), "spec": pod_spec},
    }
    if min_count < count:
        pod_set["minCount"] = min_count
    wl_spec: dict[str, Any] = {"queueName": queue, "podSets": [pod_set]}
    if priority is not None:
        name, value = priority
        wl_spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": name}
        wl_spec["priority"] = value
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": _name(job, part, seq),
            "namespace": job.meta.namespace,
            "labels": {
                contract.LABEL_JOB_NAME: job.meta.name,
                PART_LABEL: part.value,
                SEQ_LABEL: str(seq),
            },
            "ownerReferences": [
                {
                    "apiVersion": "kelastic.dev/v1alpha1",
                    "kind": "ElasticJob",
                    "name": job.meta.name,
                    "uid": job.meta.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": wl_spec,
    }


def _set(
    conditions: list[dict[str, Any]], kind: str, status: bool, reason: str, message: str, now: str
) -> None:
    """Set condition ``kind`` (lastTransitionTime moves only when the status does)."""
    value = "True" if status else "False"
    for cond in conditions:
        if cond.get("type") == kind:
            if cond.get("status") != value:
                cond["lastTransitionTime"] = now
            cond.update(status=value, reason=reason, message=message)
            return
    conditions.append(
        {"type": kind, "status": value, "reason": reason, "message": message, "lastTransitionTime": now}
    )


def clear_reservation_status(wl: WorkloadView, now: datetime) -> dict[str, Any]:
    """The status that releases an evicted Workload's quota, as Kueue's job reconciler
    writes it once the job stopped: no admission, ``QuotaReserved`` and ``Admitted`` False,
    ``Requeued`` True after a preemption or a node failure (else False)."""
    stamp = format_time(now)
    reason, message = wl.evicted or ("Evicted", "")
    conditions = [dict(c) for c in wl.conditions]
    _set(conditions, "Requeued", reason in ("Preempted", "NodeFailures"), reason, message, stamp)
    _set(conditions, "QuotaReserved", False, "Pending", message, stamp)
    _set(conditions, "Admitted", False, "NoReservation", "The workload has no reservation", stamp)
    return {"admission": None, "conditions": conditions}


def pods_ready_status(wl: WorkloadView, message: str, now: datetime) -> dict[str, Any]:
    """The status that tells Kueue the Workload's pods run (``PodsReady`` True)."""
    conditions = [dict(c) for c in wl.conditions]
    _set(conditions, "PodsReady", True, "PodsReady", message, format_time(now))
    return {"conditions": conditions}


def finish_status(wl: WorkloadView, succeeded: bool, message: str, now: datetime) -> dict[str, Any]:
    """The status that finishes a Workload (Kueue releases its quota at once)."""
    conditions = [dict(c) for c in wl.conditions]
    reason = "Succeeded" if succeeded else "Failed"
    _set(conditions, "Finished", True, reason, message, format_time(now))
    return {"conditions": conditions}


# ---------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Inputs:
    """What :func:`plan` needs of the job besides its Workloads."""

    #: Worker pods that still exist (any phase, terminating included), by index.
    worker_indices: tuple[int, ...] = ()
    #: Worker pods that run and are ready.
    ready_workers: int = 0
    #: The job has ended (Succeeded/Failed) and whether it succeeded.
    finished: bool = False
    succeeded: bool = False
    finish_message: str = ""
    #: The WorkloadPriorityClass (name, value) the job's label names, if found.
    priority: tuple[str, int] | None = None
    #: The ResourceFlavors the Workloads were admitted to, as read (a missing one adds nothing).
    flavors: Mapping[str, FlavorView] = field(default_factory=dict)


@dataclass(frozen=True)
class _Planning:
    """What every step of :func:`plan` reads: the job, its queue, its own Workloads, the inputs."""

    job: Job
    spec: JobSpec
    queue: str
    #: The job's Workloads, finished ones included (their sequence numbers are taken).
    own: Sequence[WorkloadView]
    inputs: Inputs
    now: datetime

    def next_seq(self, default: int) -> int:
        """The sequence number of a new Workload (``default`` + 1 when there is none yet)."""
        return max((w.seq for w in self.own), default=default) + 1


def plan(job: Job, workloads: Sequence[WorkloadView], inputs: Inputs, now: datetime) -> QueuePlan | None:
    """Decide the job's Workloads and its grant. None when Kueue does not manage the job.

    Pure and level-based: the same job, Workloads and pods give the same plan, and carrying
    it out then planning again converges. One step per state of the job: ended
    (:func:`_plan_finished`), suspended (:func:`_plan_suspended`), without a base Workload
    (:func:`_plan_base`), base not admitted (:func:`_plan_not_granted`), admitted
    (:func:`_plan_admitted`).
    """
    queue = queue_name(job)
    spec = job.spec
    if queue is None or spec is None:
        return None
    own = [w for w in workloads if w.owner_uid in (job.meta.uid, None)]
    live = [w for w in own if not w.finished]
    if inputs.finished:
        return _plan_finished(queue, live, inputs, now)

    base = next((w for w in sorted(live, key=lambda w: w.seq) if w.part is Part.BASE), None)
    growth = sorted((w for w in live if w.part is Part.GROWTH), key=lambda w: w.seq)
    base_granted = base is not None and base.granted > 0
    highest = max(inputs.worker_indices, default=-1)
    grant_total = _granted(live) if base_granted and not spec.suspend else 0
    if spec.suspend:
        return _plan_suspended(queue, live, highest)

    # Pods at or above the grant must be gone before an evicted Workload's quota is freed.
    changes: list[WorkloadChange] = _release_evicted(live, stopped=highest < grant_total, now=now)
    ctx = _Planning(job, spec, queue, own, inputs, now)
    if base is None:
        return _plan_base(ctx, changes)
    if base.reserved is None and (
        base.count != spec.replicas or (base.min_count or base.count) != spec.min_replicas
    ):
        # Still pending with an old size: ask again for the new one (no quota is held).
        changes.append(_delete(base, f"the job now asks for {spec.min_replicas}..{spec.replicas} workers"))
    if not base_granted:
        return _plan_not_granted(queue, base, growth, highest, changes)
    return _plan_admitted(ctx, live, base, growth, grant_total, changes)


def _plan_finished(queue: str, live: Sequence[WorkloadView], inputs: Inputs, now: datetime) -> QueuePlan:
    """The job ended: every live Workload is finished, its quota released."""
    changes: list[WorkloadChange] = [
        FinishWorkload(
            reason="WorkloadFinished",
            message=f"finishing Workload {wl.name}: the job ended, its quota is released",
            name=wl.name,
            resource_version=wl.resource_version,
            status=finish_status(wl, inputs.succeeded, inputs.finish_message, now),
        )
        for wl in live
    ]
    return QueuePlan(Grant(queue, 0, 0), tuple(changes))


def _plan_suspended(queue: str, live: Sequence[WorkloadView], highest: int) -> QueuePlan:
    """A suspended job gives its quota back once its pods are gone, and asks again on resume."""
    changes: list[WorkloadChange] = []
    if highest < 0:
        changes += [_delete(w, "the job is suspended (spec.suspend)") for w in live]
    return QueuePlan(Grant(queue, 0, 0, reason="Suspended", message="spec.suspend is true"), tuple(changes))


def _release_evicted(live: Sequence[WorkloadView], *, stopped: bool, now: datetime) -> list[WorkloadChange]:
    """The evicted Workloads' quota is released once their workers are gone (``stopped``)."""
    return [
        ClearReservation(
            reason="WorkloadEvicted",
            message=(
                f"Workload {wl.name} was evicted ({wl.evicted[0]}: {wl.evicted[1]}); its "
                f"workers are stopped, releasing its quota"
            ),
            name=wl.name,
            resource_version=wl.resource_version,
            status=clear_reservation_status(wl, now),
        )
        for wl in live
        if wl.evicted is not None and wl.reserved is not None and stopped
    ]


def _plan_base(ctx: _Planning, changes: list[WorkloadChange]) -> QueuePlan:
    """No base Workload: create the one that asks for the job's min..max workers."""
    job, spec, queue, inputs = ctx.job, ctx.spec, ctx.queue, ctx.inputs
    seq = ctx.next_seq(-1)
    changes.append(
        CreateWorkload(
            reason="WorkloadCreated",
            message=f"queued in LocalQueue {queue}: Workload for {spec.min_replicas}..{spec.replicas} workers",
            manifest=_manifest(
                job, spec, queue, Part.BASE, seq, spec.replicas, spec.min_replicas, inputs.priority
            ),
        )
    )
    return QueuePlan(
        Grant(queue, 0, spec.replicas, reason="Creating", message="creating the job's Workload"),
        tuple(changes),
    )


def _plan_not_granted(
    queue: str,
    base: WorkloadView,
    growth: Sequence[WorkloadView],
    highest: int,
    changes: list[WorkloadChange],
) -> QueuePlan:
    """The base Workload is not admitted: no worker may run; growth Workloads go once no
    worker is left."""
    if highest < 0:
        changes += [_delete(w, "the job's base Workload is not admitted") for w in growth]
    reason, message = base.pending or base.evicted or ("Pending", "waiting for Kueue")
    return QueuePlan(
        Grant(
            queue,
            0,
            base.count,
            cluster_queue=base.cluster_queue,
            reason=reason,
            message=message,
            evicted=base.evicted is not None,
        ),
        tuple(changes),
    )


def _plan_admitted(
    ctx: _Planning,
    live: Sequence[WorkloadView],
    base: WorkloadView,
    growth: Sequence[WorkloadView],
    grant_total: int,
    changes: list[WorkloadChange],
) -> QueuePlan:
    """Admitted: grow toward replicas through one pending growth Workload; give back surplus."""
    spec, queue, inputs, now = ctx.spec, ctx.queue, ctx.inputs, ctx.now
    waiting = [w for w in growth if w.reserved is None]
    want = spec.replicas - grant_total
    if want > 0:
        changes += _ask_for_more(ctx, waiting, want)
    else:
        changes += [_delete(w, "the job has every worker it asks for") for w in waiting]
        changes += _give_back_surplus(spec, growth, grant_total - spec.replicas, now)
    pending_wl = waiting[0] if waiting else None
    evicted = [w for w in live if w.evicted is not None]
    said: tuple[str, str] | None = None
    if evicted:
        said = evicted[0].evicted
    elif pending_wl is not None:
        said = pending_wl.pending
    running = min(spec.replicas, grant_total)
    pods_ready: tuple[ReadyWorkload, ...] = ()
    if inputs.ready_workers >= running > 0:
        ready = f"all {running} admitted worker pods are ready"
        pods_ready = tuple(
            ReadyWorkload(w.name, w.resource_version, pods_ready_status(w, ready, now))
            for w in live
            if w.granted > 0 and not w.pods_ready
        )
    # The shares of the grant: the base first, then the growth Workloads in the order made.
    shares = sorted((w for w in live if w.granted > 0), key=lambda w: w.seq)
    return QueuePlan(
        Grant(
            queue,
            grant_total,
            max(0, want),
            cluster_queue=base.cluster_queue,
            reason=said[0] if said else None,
            message=said[1] if said else None,
            placements=tuple(placement(w, inputs.flavors) for w in shares),
        ),
        tuple(changes),
        pods_ready,
    )


def _ask_for_more(ctx: _Planning, waiting: Sequence[WorkloadView], want: int) -> list[WorkloadChange]:
    """One pending growth Workload for the ``want`` workers the grant lacks."""
    changes: list[WorkloadChange] = []
    if not waiting:
        seq = ctx.next_seq(0)
        changes.append(
            CreateWorkload(
                reason="WorkloadCreated",
                message=f"asking LocalQueue {ctx.queue} for {want} more worker(s) (Workload for 1..{want})",
                manifest=_manifest(
                    ctx.job, ctx.spec, ctx.queue, Part.GROWTH, seq, want, 1, ctx.inputs.priority
                ),
            )
        )
    for extra in waiting[1:]:
        changes.append(_delete(extra, "one growth request at a time"))
    if waiting and waiting[0].count != want:
        changes.append(_delete(waiting[0], f"the job now lacks {want} worker(s), not {waiting[0].count}"))
    return changes


def _give_back_surplus(
    spec: JobSpec, growth: Sequence[WorkloadView], surplus: int, now: datetime
) -> list[WorkloadChange]:
    """Finish the newest granted growth Workloads that fit in the ``surplus`` past replicas."""
    changes: list[WorkloadChange] = []
    for wl in reversed([w for w in growth if w.granted > 0]):
        if wl.granted <= surplus:
            surplus -= wl.granted
            changes.append(
                FinishWorkload(
                    reason="WorkloadFinished",
                    message=(
                        f"finishing Workload {wl.name}: the job was scaled to {spec.replicas}, "
                        f"its {wl.granted} worker(s) of quota are released"
                    ),
                    name=wl.name,
                    resource_version=wl.resource_version,
                    status=finish_status(wl, True, "the job was scaled down", now),
                )
            )
    return changes


def _granted(workloads: Sequence[WorkloadView]) -> int:
    return sum(w.granted for w in workloads)


def _delete(wl: WorkloadView, why: str) -> DeleteWorkload:
    return DeleteWorkload(
        reason="WorkloadDeleted",
        message=f"deleting Workload {wl.name}: {why}",
        name=wl.name,
        resource_version=wl.resource_version,
    )

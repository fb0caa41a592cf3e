"""Thin kopf handlers: they only feed the :class:`~kelastic.operator.controller.Controller`.

``build_registry(controller)`` returns a kopf registry holding:

- two indexes (pods and Services carrying the ``kelastic.dev/job-name`` label,
  keyed by (namespace, job name)), so a reconcile never LISTs and an operator
  restarted mid-job sees every existing pod before it acts (kopf runs no handler
  until its indexes are filled: adoption without duplicates);
- the watch settings: pods and Services are listed and watched with the server-side
  ``labelSelector=kelastic.dev/job-name`` (kopf's ``labels=`` filters would only
  drop other pods after receiving them: in a busy cluster, every pod change of every
  tenant), and with the namespaces given, kopf's cluster scanning is off, so it never
  lists namespaces or CRDs (a namespaced Role does not allow it; kopf would retry
  the 403s before acting);
- event handlers for ElasticJobs, those pods and Services, each one only
  triggering a reconcile of the job concerned;
- startup/cleanup handlers that start and stop the controller's resync loop and,
  when configured, the leader election.

No handler adds a finalizer, so a job can always be deleted, even while no
operator runs; its pods and Services go with it through their ownerReferences.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import kopf

from kelastic.agent import contract
from kelastic.operator import kueue
from kelastic.operator.controller import Controller, JobKey
from kelastic.operator.leader import LeaderElector
from kelastic.operator.observed import PodView, ServiceView, pod_view, service_view
from kelastic.operator.spec import GROUP, PLURAL, VERSION

__all__ = ["OWNED_SELECTOR", "NoDiffBase", "build_registry", "configure_settings"]

#: The server-side selector of the pods and Services the operator owns (label exists).
OWNED_SELECTOR = contract.LABEL_JOB_NAME
#: The kinds watched with :data:`OWNED_SELECTOR` only.
OWNED_KINDS = (("v1", "pods"), ("v1", "services"))
#: Kueue's Workloads, watched (with :data:`OWNED_SELECTOR`) only when the operator runs with --kueue.
WORKLOADS = (kueue.GROUP, "workloads")


class NoDiffBase(kopf.DiffBaseStorage):
    """A diff base that keeps nothing: kelastic-operator has no change-detecting handlers.

    kopf builds every watched object's "essence" (a deep copy of the body less its
    metadata and status) at each event, for ``on.create``/``on.update`` diffs, even
    when no such handler exists. Every handler here is ``on.event`` or an index, which
    never read it: at 1,000 jobs of 8 pods the copies were about a tenth of the
    operator's CPU. Nothing is stored on the objects either.
    """

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def configure_settings(settings: kopf.OperatorSettings, *, cluster_wide: bool, kueue: bool = False) -> None:
    """The kopf settings of kelastic-operator (applied at startup, before any watch starts)."""
    settings.persistence.diffbase_storage = NoDiffBase()
    # Our own Events say what happened; kopf's would repeat each handler run.
    settings.posting.level = logging.ERROR
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Leader election is ours (a Lease), so kopf itself runs standalone.
    settings.peering.standalone = True
    for kind in OWNED_KINDS:
        settings.watching.label_selectors[kind] = OWNED_SELECTOR
    if kueue:
        settings.watching.label_selectors[WORKLOADS] = OWNED_SELECTOR
    # Namespaced: serve exactly the namespaces named. Scanning would list namespaces and
    # CRDs, which the chart's Role does not grant. Cluster-wide, scanning follows the CRD
    # being installed or changed after the operator started (the ClusterRole grants it).
    settings.scanning.disabled = not cluster_wide


def build_registry(
    controller: Controller, elector: LeaderElector | None = None, *, cluster_wide: bool = False
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings, cluster_wide=cluster_wide, kueue=controller.queues is not None)
        controller.start()
        if elector is not None:
            elector.start()

    @kopf.on.cleanup(registry=registry)
    async def shutdown(**_: Any) -> None:
        if elector is not None:
            await elector.stop()
        await controller.stop()
        controller.store.close()

    # Only labelled objects arrive (the server filters the watch); the checks below keep a
    # selector that a cluster failed to apply from turning into a crash.
    # (kopf types ``namespace`` as optional for cluster-scoped kinds; every kind here is
    # namespaced, so it is always set.)
    @kopf.index("v1", "pods", id="kelastic_pods", registry=registry)
    def kelastic_pods(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[JobKey, PodView]:
        job = labels.get(contract.LABEL_JOB_NAME)
        return {(namespace or "", job): pod_view(body)} if job else {}

    @kopf.index("v1", "services", id="kelastic_services", registry=registry)
    def kelastic_services(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[JobKey, ServiceView]:
        job = labels.get(contract.LABEL_JOB_NAME)
        return {(namespace or "", job): service_view(body)} if job else {}

    # kopf passes each index as a keyword argument named after it (kelastic_pods, ...);
    # its handler protocols cannot declare such names, hence the two ignores below.
    @kopf.on.event(GROUP, VERSION, PLURAL, id="elasticjob", registry=registry)  # type: ignore[arg-type]
    async def job_event(
        type: str | None,
        namespace: str | None,
        name: str,
        uid: str,
        kelastic_pods: kopf.Index[JobKey, PodView],
        kelastic_services: kopf.Index[JobKey, ServiceView],
        meta: kopf.Meta,
        body: kopf.Body,
        **_: Any,
    ) -> None:
        controller.bind_indexes(kelastic_pods, kelastic_services)
        key = (namespace or "", name)
        if type == "DELETED":
            controller.job_gone(key, uid)
        else:
            # The watch's body is the controller's copy of the job: no GET per reconcile.
            controller.job_seen(key, meta.get("resourceVersion"), copy.deepcopy(dict(body)))

    @kopf.on.event("v1", "pods", id="elasticjob-pod", registry=registry)
    @kopf.on.event("v1", "services", id="elasticjob-service", registry=registry)  # type: ignore[arg-type]
    async def owned_event(
        namespace: str | None,
        name: str | None,
        labels: kopf.Labels,
        resource: kopf.Resource,
        kelastic_pods: kopf.Index[JobKey, PodView],
        kelastic_services: kopf.Index[JobKey, ServiceView],
        **_: Any,
    ) -> None:
        controller.bind_indexes(kelastic_pods, kelastic_services)
        job = labels.get(contract.LABEL_JOB_NAME)
        if job:
            key = (namespace or "", job)
            if resource.plural == "pods" and name:
                controller.pod_seen(key, name)
            controller.trigger(key)

    if controller.queues is not None:
        _register_workloads(registry, controller)
    return registry


def _register_workloads(registry: kopf.OperatorRegistry, controller: Controller) -> None:
    """With Kueue: the index of the operator's Workloads, and a pass of their job on each change."""
    queues = controller.queues
    assert queues is not None

    @kopf.index(kueue.GROUP, "v1beta2", "workloads", id="kelastic_workloads", registry=registry)
    def kelastic_workloads(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[JobKey, kueue.WorkloadView]:
        job = labels.get(contract.LABEL_JOB_NAME)
        view = kueue.workload_view(body) if job else None
        return {(namespace or "", job): view} if job and view is not None else {}

    @kopf.on.event(kueue.GROUP, "v1beta2", "workloads", id="elasticjob-workload", registry=registry)  # type: ignore[arg-type]
    async def workload_event(
        namespace: str | None,
        labels: kopf.Labels,
        kelastic_workloads: kopf.Index[JobKey, kueue.WorkloadView],
        **_: Any,
    ) -> None:
        queues.bind_index(kelastic_workloads)
        job = labels.get(contract.LABEL_JOB_NAME)
        if job:
            controller.trigger((namespace or "", job))

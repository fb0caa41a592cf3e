"""Thin kopf handlers: they only feed the :class:`~kelastic.operator.controller.Controller`.

``build_registry(controller)`` returns a kopf registry holding:

- two indexes (pods and Services carrying the ``kelastic.dev/job-name`` label,
  keyed by (namespace, job name)), so a reconcile never LISTs and an operator
  restarted mid-job sees every existing pod before it acts (kopf runs no handler
  until its indexes are filled: adoption without duplicates);
- event handlers for ElasticJobs, those pods and Services, each one only
  triggering a reconcile of the job concerned;
- startup/cleanup handlers that start and stop the controller's resync loop and,
  when configured, the leader election.

No handler adds a finalizer, so a job can always be deleted, even while no
operator runs; its pods and Services go with it through their ownerReferences.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kelastic.agent import contract
from kelastic.operator.controller import Controller
from kelastic.operator.leader import LeaderElector
from kelastic.operator.observed import pod_view, service_view
from kelastic.operator.spec import GROUP, PLURAL, VERSION

__all__ = ["build_registry"]

_OURS = {contract.LABEL_JOB_NAME: kopf.PRESENT}


def build_registry(controller: Controller, elector: LeaderElector | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own Events say what happened; kopf's would repeat each handler run.
        settings.posting.level = logging.ERROR
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        # Leader election is ours (a Lease), so kopf itself runs standalone.
        settings.peering.standalone = True
        controller.start()
        if elector is not None:
            elector.start()

    @kopf.on.cleanup(registry=registry)
    async def shutdown(**_: Any) -> None:
        if elector is not None:
            await elector.stop()
        await controller.stop()
        controller.store.close()

    @kopf.index("v1", "pods", labels=_OURS, id="kelastic_pods", registry=registry)
    def kelastic_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, labels[contract.LABEL_JOB_NAME]): pod_view(body)}

    @kopf.index("v1", "services", labels=_OURS, id="kelastic_services", registry=registry)
    def kelastic_services(
        namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        return {(namespace, labels[contract.LABEL_JOB_NAME]): service_view(body)}

    @kopf.on.event(GROUP, VERSION, PLURAL, id="elasticjob", registry=registry)
    async def job_event(
        type: str | None,
        namespace: str,
        name: str,
        uid: str,
        kelastic_pods: kopf.Index,
        kelastic_services: kopf.Index,
        meta: kopf.Meta,
        **_: Any,
    ) -> None:
        controller.bind_indexes(kelastic_pods, kelastic_services)
        if type == "DELETED":
            controller.job_gone((namespace, name), uid)
        else:
            controller.job_seen((namespace, name), meta.get("resourceVersion"))

    @kopf.on.event("v1", "pods", labels=_OURS, id="elasticjob-pod", registry=registry)
    @kopf.on.event("v1", "services", labels=_OURS, id="elasticjob-service", registry=registry)
    async def owned_event(
        namespace: str,
        labels: dict[str, str],
        kelastic_pods: kopf.Index,
        kelastic_services: kopf.Index,
        **_: Any,
    ) -> None:
        controller.bind_indexes(kelastic_pods, kelastic_services)
        controller.trigger((namespace, labels[contract.LABEL_JOB_NAME]))

    return registry

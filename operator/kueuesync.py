"""The I/O around :mod:`kelastic.operator.kueue`: the jobs' Workloads as the watch shows
them, the WorkloadPriorityClass values, the ResourceFlavors the Workloads are admitted to,
and carrying a plan's changes out.

Only built when the operator runs with ``--kueue``: without it no Workload is watched or
written, and a labelled job runs as any other (the label is Kueue's, which then is not
installed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

from kelastic.operator import kueue
from kelastic.operator.events import EventEmitter
from kelastic.operator.joblog import JobKey, job_log
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.spec import Job
from kelastic.operator.status import TERMINAL_PHASES, Phase

__all__ = ["QueueSync", "workloads_path"]

T = TypeVar("T")
Io = Callable[..., Awaitable[Any]]

#: How long a WorkloadPriorityClass's value is reused before it is read again (seconds).
PRIORITY_TTL = 60.0
#: How long a ResourceFlavor's node labels and tolerations are reused before they are read again (seconds).
FLAVOR_TTL = 60.0


def workloads_path(namespace: str, name: str | None = None, *, status: bool = False) -> str:
    path = f"/apis/{kueue.API_VERSION}/namespaces/{quote(namespace)}/workloads"
    if name:
        path += f"/{quote(name)}"
        if status:
            path += "/status"
    return path


class QueueSync:
    """Plans a queued job's Workloads from the watched ones and applies the plan."""

    def __init__(self, kube: Kube, io: Io, events: EventEmitter) -> None:
        self.kube = kube
        self._io = io
        self.events = events
        self._index: Mapping[JobKey, Iterable[kueue.WorkloadView]] = {}
        self._priorities: dict[str, tuple[float, int | None]] = {}
        self._flavors: dict[str, tuple[float, kueue.FlavorView]] = {}

    def bind_index(self, index: Mapping[JobKey, Iterable[kueue.WorkloadView]]) -> None:
        """kopf's live index of the operator's Workloads, keyed by (namespace, job name)."""
        self._index = index

    def workloads(self, key: JobKey) -> list[kueue.WorkloadView]:
        return list(self._index.get(key, ()))

    async def priority(self, job: Job) -> tuple[str, int] | None:
        """The WorkloadPriorityClass the job's label names, with its value (read at most once a minute)."""
        name = job.meta.labels.get(kueue.PRIORITY_LABEL)
        if not name:
            return None
        cached = self._priorities.get(name)
        if cached is None or time.monotonic() - cached[0] > PRIORITY_TTL:
            value: int | None = None
            try:
                body = await self._io(
                    self.kube.request,
                    "GET",
                    f"/apis/{kueue.API_VERSION}/workloadpriorityclasses/{quote(name)}",
                )
                value = int(body.get("value", 0))
            except ApiError as err:
                if err.status != 404:
                    raise
                job_log(
                    (job.meta.namespace, job.meta.name),
                    logging.WARNING,
                    f"WorkloadPriorityClass {name} (label {kueue.PRIORITY_LABEL}) does not exist; "
                    "the job's Workloads get Kueue's default priority",
                )
            cached = (time.monotonic(), value)
            self._priorities[name] = cached
        return None if cached[1] is None else (name, cached[1])

    async def read_flavors(self, key: JobKey) -> None:
        """Read the ResourceFlavors the job's Workloads are admitted to that are not known (or were
        read over a minute ago). One that cannot be read adds nothing to the pods (logged).

        Returns once every flavor the Workloads name is known, as of the index now: a plan made
        right after (without awaiting anything) places every admitted worker."""
        for _ in range(3):  # a Workload admitted meanwhile names another flavor: read it too
            now = time.monotonic()
            stale = sorted(
                {f for w in self.workloads(key) for f in w.flavors}
                - {n for n, (at, _) in self._flavors.items() if now - at <= FLAVOR_TTL}
            )
            if not stale:
                return
            for name in stale:
                self._flavors[name] = (time.monotonic(), await self._read_flavor(key, name))

    async def _read_flavor(self, key: JobKey, name: str) -> kueue.FlavorView:
        try:
            body = await self._io(
                self.kube.request, "GET", f"/apis/{kueue.API_VERSION}/resourceflavors/{quote(name)}"
            )
        except ApiError as err:
            if err.status not in (403, 404):
                raise
            job_log(
                key,
                logging.WARNING,
                f"cannot read ResourceFlavor {name} ({err}): its node labels and tolerations are not "
                "added to the workers Kueue admitted to it",
            )
            return kueue.FlavorView()
        return kueue.flavor_view(body)

    def plan(
        self,
        job: Job,
        pods: Sequence[PodView],
        phase: str | None,
        priority: tuple[str, int] | None,
        now: datetime,
        *,
        finish_message: str = "",
    ) -> kueue.QueuePlan | None:
        """The plan for ``job`` as of ``phase`` (its status's, before or after a pass)."""
        key = (job.meta.namespace, job.meta.name)
        workers = [p for p in pods if p.index is not None and p.role == "worker"]
        terminal = phase in {p.value for p in TERMINAL_PHASES}
        inputs = kueue.Inputs(
            worker_indices=tuple(
                p.index for p in workers if p.index is not None and p.phase is not PodPhase.SUCCEEDED
            ),
            ready_workers=sum(1 for p in workers if p.ready and not p.terminating),
            finished=terminal,
            succeeded=phase == Phase.SUCCEEDED.value,
            finish_message=finish_message or f"the ElasticJob is {phase}",
            priority=priority,
            flavors={name: view for name, (_, view) in self._flavors.items()},
        )
        return kueue.plan(job, self.workloads(key), inputs, now)

    async def apply(self, body: Mapping[str, Any], job: Job, plan: kueue.QueuePlan) -> None:
        """Carry the plan's changes out; a conflict or a Workload already gone is left to the next pass."""
        ns = job.meta.namespace
        key = (ns, job.meta.name)
        for change in plan.changes:
            try:
                if isinstance(change, kueue.CreateWorkload):
                    await self._io(self.kube.request, "POST", workloads_path(ns), dict(change.manifest))
                elif isinstance(change, kueue.DeleteWorkload):
                    await self._io(
                        self.kube.request,
                        "DELETE",
                        workloads_path(ns, change.name),
                        {"preconditions": {"resourceVersion": change.resource_version}},
                    )
                elif isinstance(change, kueue.ClearReservation | kueue.FinishWorkload):
                    await self._patch_status(ns, change.name, change.resource_version, change.status)
            except ApiError as err:
                if err.status in (404, 409):
                    continue  # gone, or changed since the watch showed it: the next pass decides again
                job_log(key, logging.WARNING, f"{change.message} failed: {err}")
                self.events.emit(
                    body, "FailedWorkloadChange", f"{change.message} failed: {err}", warning=True
                )
                continue
            job_log(key, logging.INFO, change.message)
            self.events.emit(body, change.reason, change.message)
        for ready in plan.pods_ready:
            try:
                await self._patch_status(ns, ready.name, ready.resource_version, ready.status)
            except ApiError as err:
                if err.status not in (404, 409):
                    job_log(key, logging.WARNING, f"setting PodsReady on Workload {ready.name} failed: {err}")

    async def _patch_status(
        self, ns: str, name: str, resource_version: str, status: Mapping[str, Any]
    ) -> None:
        patch: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            patch["metadata"] = {"resourceVersion": resource_version}
        await self._io(self._merge_patch, workloads_path(ns, name, status=True), patch)

    def _merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.kube.request("PATCH", path, dict(patch), content_type="application/merge-patch+json")

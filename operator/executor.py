"""Applying a reconcile decision: the only place the controller changes the cluster.

:class:`ActionExecutor` takes a :class:`~kelastic.operator.reconcile.Decision` and
carries its actions out, in the order that keeps a job whole:

1. Services, the job's Secret (``CreateSecret``: its value is made here, and a
   failure holds back the worker pods of the pass), and the objects made to exist
   (``EnsureObject``: the NetworkPolicies, the PodGroup, whose failure also holds back
   the worker pods: they would run unguarded, or name a group that does not exist), in order;
2. the membership, handed to the store publisher (survivors of a scale-down
   re-form before their peer is stopped);
3. pod creates and deletes, concurrently;
4. Events (one per reason for the pods of one pass, one for the creates that failed
   together), then the job's own deletion (``DeleteJob``, its TTL).

A create that finds the object (409) or a delete that finds it gone (404/409) is
the desired state, not a failure. Any other failed create or delete is a log line
and a ``FailedCreate``/``FailedDelete`` Event, and marks the job in
:attr:`ActionExecutor.failed` so the controller retries the pass with its back-off.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kelastic.agent import contract
from kelastic.operator import jobsecret
from kelastic.operator.events import EventEmitter, combined_message
from kelastic.operator.jobcache import JobCache
from kelastic.operator.joblog import JobKey, job_log, key_of
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.metrics import OperatorMetrics
from kelastic.operator.observed import PodView, ServiceView, pod_view, service_view
from kelastic.operator.reconcile import (
    Action,
    CreatePod,
    CreateSecret,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteService,
    Emit,
    EnsureObject,
    PublishMembership,
)
from kelastic.operator.spec import Job

__all__ = ["ENSURE_PREDECESSOR_SECONDS", "ENSURE_RETRY_SECONDS", "ActionExecutor", "Applied"]

#: An object whose creation failed (no permission, an API not served) is tried again after this (seconds).
ENSURE_RETRY_SECONDS = 60.0
#: An object of the same name that an earlier job (same name, other uid) left, still being
#: deleted, is waited for this long before trying again (seconds).
ENSURE_PREDECESSOR_SECONDS = 2.0

#: Runs a blocking API call off the event loop: ``await io(fn, *args)`` is ``fn(*args)``.
Io = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Applied:
    """What :meth:`ActionExecutor.apply` changed: whether it created a Service, how many pods it
    created and deleted."""

    created_service: bool = False
    created_pods: int = 0
    deleted_pods: int = 0


class ActionExecutor:
    """Carries decisions out through ``kube`` (each call through ``io``), reporting through
    ``events`` and ``metrics``; pods it creates are expected in ``cache``; memberships go to
    ``publish(key, action)``."""

    def __init__(
        self,
        kube: Kube,
        io: Io,
        events: EventEmitter,
        metrics: OperatorMetrics,
        cache: JobCache,
        publish: Callable[[JobKey, PublishMembership], None],
        job_secret: Callable[[str], str],
    ) -> None:
        """``job_secret(uid)``: the value of a job's Secret (derived from the operator's master key)."""
        self.kube = kube
        self._io = io
        self.events = events
        self.metrics = metrics
        self.cache = cache
        self._publish = publish
        self._job_secret = job_secret
        #: Jobs whose last :meth:`apply` had a create or delete fail, and what failed (cleared by
        #: the controller, which names it when it retries).
        self.failed: dict[JobKey, str] = {}
        self._ensured: dict[str, str] = {}  # EnsureObject key -> the manifest last made true (JSON)
        self._ensure_retry: dict[str, float] = {}  # key -> when to try again after a failure (monotonic)

    def forget(self, uid: str) -> None:
        """The job with ``uid`` is gone: what was made to exist for it goes with it."""
        self._ensured = {k: v for k, v in self._ensured.items() if not k.startswith(f"{uid}/")}

    async def apply(
        self,
        job: Job,
        body: Mapping[str, Any],
        decision: Decision,
        pods: list[PodView],
        services: list[ServiceView],
    ) -> Applied:
        """Apply ``decision``; update ``pods``/``services`` with what changed, and say what it was.

        Raises :class:`ApiError` only when deleting the job itself fails (other than 404/409).
        """
        ns = job.meta.namespace
        key = (ns, job.meta.name)
        created_service = False
        workers_wait = False
        for action in decision.actions:
            if isinstance(action, CreateSecret):
                workers_wait = not await self._create_secret(body, ns, action) or workers_wait
            elif isinstance(action, CreateService):
                result = await self._change(body, action, self.kube.create, ns, "services", action.manifest)
                if result is not None:
                    services.append(service_view(result))
                    created_service = True
            elif isinstance(action, DeleteService):
                await self._change(body, action, self.kube.delete, ns, "services", action.name)
            elif (
                isinstance(action, EnsureObject)
                and not await self._ensure(body, action)
                and action.workers_wait
            ):
                workers_wait = True
                self.failed.setdefault(key, f"the worker pods wait for this: {action.message}")
        # The membership goes first: survivors of a scale-down re-form before their peer is stopped.
        for action in decision.actions:
            if isinstance(action, PublishMembership):
                self._publish(key, action)
        pod_actions = [
            a
            for a in decision.actions
            if isinstance(a, DeletePod) or (isinstance(a, CreatePod) and not (workers_wait and _is_worker(a)))
        ]
        failed_creates: list[str] = []
        deleted = 0
        results = await asyncio.gather(*(self._pod_action(body, ns, a, failed_creates) for a in pod_actions))
        created: list[CreatePod] = []
        for action, result in zip(pod_actions, results, strict=True):
            if isinstance(action, CreatePod) and isinstance(result, dict):
                view = pod_view(result)
                pods.append(view)
                created.append(action)
                self.cache.expect(key, view)
            elif isinstance(action, DeletePod) and result is not None:
                pods[:] = [replace(p, terminating=True) if p.uid == action.uid else p for p in pods]
                deleted += 1
        # One Event per reason for the pods a pass created (a job of 1,000 pods: one Event, not 1,000).
        for reason in dict.fromkeys(a.reason for a in created):
            same = [a for a in created if a.reason == reason]
            self.events.emit(
                body, reason, combined_message([a.message for a in same]), warning=same[0].warning
            )
        if failed_creates:  # likewise one Event for the creates that failed (a 403 on 1,000 pods)
            self.events.emit(body, "FailedCreate", combined_message(failed_creates), warning=True)
        for action in decision.actions:
            if isinstance(action, Emit):
                self.events.emit(body, action.reason, action.message, warning=action.warning)
                job_log(key, logging.WARNING if action.warning else logging.INFO, action.message)
            elif isinstance(action, DeleteJob):
                job_log(key, logging.INFO, action.message)
                try:
                    await self._io(self.kube.delete_job, ns, job.meta.name, job.meta.uid)
                except ApiError as err:
                    if err.status not in (404, 409):
                        raise
        return Applied(created_service, len(created), deleted)

    async def _create_secret(self, body: Mapping[str, Any], ns: str, action: CreateSecret) -> bool:
        """Create the job's Secret with its derived value; True when it exists now (made, or found: 409).

        A failure is a ``FailedCreate`` Event saying that the worker pods wait, and a retry.
        """
        failures: list[str] = []
        manifest = jobsecret.with_value(action.manifest, self._job_secret(str(body["metadata"]["uid"])))
        await self._change(body, action, self.kube.create, ns, "secrets", manifest, failures=failures)
        if failures:
            self.events.emit(
                body, "FailedCreate", f"{failures[0]}; the worker pods wait for it", warning=True
            )
        return not failures

    async def _ensure(self, body: Mapping[str, Any], action: EnsureObject) -> bool:
        """Make ``action``'s object exist with its manifest's labels and spec; whether it exists
        (made now or earlier, perhaps with an older manifest).

        Once per run and whenever the manifest changes: create it; if it exists (409),
        merge-patch its labels and spec. A failure (no permission, an API the cluster
        does not serve) is an Event and a log line, retried at most once a minute. One left by
        an earlier job of the same name (another owner, or being deleted: the garbage
        collector removes it) is not taken over: it is waited for and created anew.
        """
        wanted = json.dumps(action.manifest, sort_keys=True, default=str)
        existed = action.key in self._ensured
        if self._ensured.get(action.key) == wanted:
            return True
        if time.monotonic() < self._ensure_retry.get(action.key, 0.0):
            return existed
        found = False
        name = str((action.manifest.get("metadata") or {}).get("name"))
        try:
            try:
                await self._io(self.kube.request, "POST", action.path, dict(action.manifest))
                message = action.message
            except ApiError as err:
                if err.status != 409:
                    raise
                current = await self._io(self.kube.request, "GET", f"{action.path}/{name}")
                predecessor = _predecessor(current, action.manifest)
                if predecessor:
                    self._ensure_retry[action.key] = time.monotonic() + ENSURE_PREDECESSOR_SECONDS
                    # the pass is retried soon (back-off from 1 s)
                    self.failed.setdefault(key_of(body), f"{name} {predecessor}")
                    job_log(key_of(body), logging.INFO, f"{action.message}: waiting, {name} {predecessor}")
                    return False
                found = True
                patch = {
                    "metadata": {"labels": (action.manifest.get("metadata") or {}).get("labels") or {}},
                    "spec": action.manifest.get("spec") or {},
                }
                merge = functools.partial(self.kube.request, content_type="application/merge-patch+json")
                await self._io(merge, "PATCH", f"{action.path}/{name}", patch)
                message = f"{action.message} (updated the existing one)"
        except ApiError as err:
            self._ensure_retry[action.key] = time.monotonic() + ENSURE_RETRY_SECONDS
            failure = f"{action.message} failed: {err}"
            if action.workers_wait and not (existed or found):
                failure += f"; the worker pods wait for it (tried again in {ENSURE_RETRY_SECONDS:g}s)"
            job_log(key_of(body), logging.WARNING, failure)
            self.events.emit(body, "FailedCreate", failure, warning=True)
            return existed or found
        if existed or message == action.message:
            job_log(key_of(body), logging.INFO, message)
            self.events.emit(body, action.reason, message, warning=action.warning)
        self._ensured[action.key] = wanted
        self._ensure_retry.pop(action.key, None)
        return True

    async def _pod_action(
        self, body: Mapping[str, Any], ns: str, action: CreatePod | DeletePod, failed_creates: list[str]
    ) -> Any:
        if isinstance(action, CreatePod):
            # The Event comes per reason for the whole pass (see apply).
            return await self._change(
                body,
                action,
                self.kube.create,
                ns,
                "pods",
                action.manifest,
                event=False,
                failures=failed_creates,
            )
        return await self._change(
            body, action, self.kube.delete, ns, "pods", action.name, action.uid, action.grace_seconds
        )

    async def _change(
        self,
        body: Mapping[str, Any],
        action: Action,
        fn: Callable[..., Any],
        *args: Any,
        event: bool = True,
        failures: list[str] | None = None,
    ) -> Any:
        """Run one create/delete; Event on success (unless ``event`` is False) or real failure
        (with ``failures``, the failure's message is added there for one Event per pass instead).

        Returns the result, None if not done.
        """
        try:
            result = await self._io(fn, *args)
        except ApiError as err:
            # 409 on create: it exists already (a stale cache or a repeated event); 404/409 on
            # delete: it is gone or was replaced. Both are the desired state, not failures.
            if err.status in (404, 409):
                return None
            verb = "FailedCreate" if isinstance(action, CreatePod | CreateService) else "FailedDelete"
            message = f"{action.message} failed: {err}"
            self.failed.setdefault(key_of(body), message)
            job_log(key_of(body), logging.WARNING, message)
            if failures is not None:
                failures.append(message)
            else:
                self.events.emit(body, verb, message, warning=True)
            return None
        job_log(key_of(body), logging.INFO, action.message)
        self.metrics.action_applied(action.reason)
        if event:
            self.events.emit(body, action.reason, action.message, warning=action.warning)
        return result if result is not None else True


def _predecessor(current: Mapping[str, Any], manifest: Mapping[str, Any]) -> str:
    """Why the existing object ``current`` is not the one ``manifest`` asks for but an earlier
    job's, which the garbage collector is about to remove ("" when it may be taken over)."""
    meta = current.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return "is being deleted (an earlier job's); it is created anew once gone"
    ours = {o.get("uid") for o in (manifest.get("metadata") or {}).get("ownerReferences") or ()}
    theirs = {o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")}
    if ours and theirs and not theirs & ours:
        return "belongs to an earlier job of the same name; it is created anew once the garbage collector removed it"
    return ""


def _is_worker(action: CreatePod) -> bool:
    labels = (action.manifest.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(contract.LABEL_ROLE) == contract.ROLE_WORKER)

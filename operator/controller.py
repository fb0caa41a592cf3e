"""The operator's I/O loop around the pure core: observe, reconcile, apply, record.

:class:`Controller` is driven by the kopf handlers (``handlers``) through
:meth:`Controller.trigger`. Triggers for one job coalesce: at most one reconcile
of a job runs at a time, and triggers that arrive meanwhile cause exactly one
more pass. Nothing polls the API server per job. A job is reconciled when:

- the job, one of its pods or its Service changed (the watches);
- a deadline the core asked for comes (``requeue_after``: timeouts, grace
  periods, TTLs), or a failed pass is retried (backoff 1 s doubling to 60 s);
- the rendezvous store's figures changed. Stores of running jobs are read every
  ``store_read_interval`` (one small TCP read per job, no API request); a new
  round or restart count triggers a pass at once, progress alone at most every
  ``progress_interval``, so status writes per job stay bounded;
- the slow ``resync_interval`` comes round: a safety net that reconciles every
  job from the caches (no API request unless something must change).

A pass takes the job from the watch's cache (its status is the core's memory;
our own status write's answer replaces it, so the pass after a write starts from
it), pods and Services from kopf's in-memory indexes (no LIST, no GET per pass),
the rendezvous store's last figures (off the loop),
runs :func:`~kelastic.operator.reconcile.reconcile`, applies its actions (Services
first, then pods concurrently, then the membership), posts an Event for each
change, and writes the status when it differs. Nothing raised inside a pass
escapes: it is logged and the next trigger or resync retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, TypeVar

from kelastic.agent import contract
from kelastic.operator import builders, validation
from kelastic.operator.events import EventRecorder
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.metrics import OperatorMetrics, count_recoveries
from kelastic.operator.observed import (
    Observed,
    PodPhase,
    PodView,
    RendezvousView,
    ServiceView,
    pod_view,
    service_view,
)
from kelastic.operator.reconcile import (
    Action,
    CreatePod,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteService,
    Emit,
    EnsureObject,
    PublishMembership,
    ReconcileConfig,
    reconcile,
)
from kelastic.operator.spec import API_VERSION, KIND, Job, parse_job
from kelastic.operator.status import TERMINAL_PHASES, merge_patch
from kelastic.operator.store_client import StoreClient
from kelastic.operator.workqueue import WorkQueue

__all__ = ["Controller", "ControllerOptions", "JobKey"]

log = logging.getLogger("kelastic.operator")
T = TypeVar("T")
JobKey = tuple[str, str]  # (namespace, name)

COMPONENT = "kelastic-operator"


def job_log(key: JobKey, level: int, message: str, *, exc_info: bool = False) -> None:
    """Log about one job: ``ElasticJob ns/name: message``; JSON logs also carry it as ``object``."""
    ref = {"apiVersion": API_VERSION, "kind": KIND, "namespace": key[0], "name": key[1]}
    log.log(level, "ElasticJob %s/%s: %s", key[0], key[1], message, exc_info=exc_info, extra={"k8s_ref": ref})


#: How long a pod this operator created counts as existing before the watch shows it (seconds).
EXPECT_SECONDS = 5.0


def combined_message(messages: list[str], limit: int = 1024) -> str:
    """One Event message for several like actions.

    ``["creating worker pod a", "creating worker pod b"]`` gives ``"creating worker
    pods a, b"``; messages of other shapes are joined with ``"; "``. Past ``limit``
    characters the names end with ``"... and N more"``.
    """
    if len(messages) == 1:
        return messages[0][:limit]
    heads = {m.rsplit(" ", 1)[0] for m in messages}
    if len(heads) == 1 and all(" " in m for m in messages):
        head, names = heads.pop() + "s", [m.rsplit(" ", 1)[1] for m in messages]
        sep = ", "
    else:
        head, names, sep = "", messages, "; "
    text = f"{head} " if head else ""
    for i, name in enumerate(names):
        more = f" ... and {len(names) - i} more"
        if len(text) + len(name) + len(sep) + len(more) > limit:
            return text.rstrip(sep) + more
        text += name + (sep if i < len(names) - 1 else "")
    return text


def _older(body: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    """Whether ``body``'s resourceVersion is lower than ``than``'s (False when either is not an integer)."""
    try:
        return int(str((body.get("metadata") or {}).get("resourceVersion"))) < int(
            str((than.get("metadata") or {}).get("resourceVersion"))
        )
    except ValueError:
        return False


def _key_of(body: Mapping[str, Any]) -> JobKey:
    meta = body.get("metadata") or {}
    return (str(meta.get("namespace")), str(meta.get("name")))


@dataclass(frozen=True)
class ControllerOptions:
    #: Every job is reconciled from the caches at least this often (seconds): a safety net.
    resync_interval: float = 60.0
    #: The stores of running jobs are read this often (seconds).
    store_read_interval: float = 2.0
    #: Progress alone (no new round) triggers a status write at most this often per job (seconds).
    progress_interval: float = 5.0
    #: A failed pass is retried after 1 s, doubling up to this (seconds).
    max_retry_delay: float = 60.0
    #: Upper bound on reconciles running at once (each may hold a few API calls).
    max_parallel: int = 16
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)


class Controller:
    def __init__(
        self,
        kube: Kube,
        store: StoreClient,
        options: ControllerOptions | None = None,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.kube = kube
        #: Prometheus series (kelastic.operator.metrics); served by the CLI's --metrics-port.
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.store = store
        self.options = options or ControllerOptions()
        self.is_leader = is_leader
        self._pods_index: Mapping[JobKey, Iterable[PodView]] = {}
        self._services_index: Mapping[JobKey, Iterable[ServiceView]] = {}
        self._known: set[JobKey] = set()
        #: Which jobs to reconcile when: coalesced triggers, deadlines, back-off after failures.
        self.queue: WorkQueue[JobKey] = WorkQueue(
            self._process, max_delay=self.options.max_retry_delay, describe=lambda k: f"{k[0]}/{k[1]}"
        )
        self._rdzv_cache: dict[JobKey, tuple[float, RendezvousView | None]] = {}
        self._rdzv_reading: set[JobKey] = set()
        self._stores: dict[JobKey, tuple[str, str]] = {}  # running jobs' (store endpoint, run id)
        self._bodies: dict[JobKey, dict[str, Any]] = {}  # the newest ElasticJob seen (watch or write)
        self._change_failed: set[JobKey] = set()  # jobs whose last pass had a create/delete fail
        self._passed_at: dict[JobKey, float] = {}  # when the last pass of a job started (monotonic)
        #: The API server's verdict on each job's pod template, once per generation.
        self.templates = validation.TemplateChecker(
            self.kube.dry_run_create, self._io, self.options.reconcile.build
        )
        self._to_publish: dict[JobKey, PublishMembership] = {}
        #: Pods created by this operator and not yet seen by the watch: name -> (when, view).
        self._created: dict[JobKey, dict[str, tuple[float, PodView]]] = {}
        self._logged_membership: dict[JobKey, tuple[str, ...]] = {}
        self._failure_logs: dict[str, str] = {}  # pod uid -> log tail, for failed workers
        self._ensured: dict[str, str] = {}  # EnsureObject key -> the manifest last made true (JSON)
        self._ensure_failed: dict[str, float] = {}  # key -> when creating it last failed (monotonic)
        self._own_writes: dict[JobKey, str] = {}  # resourceVersion our last status write produced
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kelastic-api")
        self._limit = asyncio.Semaphore(self.options.max_parallel)
        self._resync_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._stopping = False
        #: Counters for tests, benchmarks and logs.
        self.stats: dict[str, int] = {
            "reconciles": 0,
            "api_calls": 0,
            "errors": 0,
            "job_reads": 0,
        }
        self.events = EventRecorder(
            lambda ns, body: self._io(self.kube.create, ns, "events", body),
            lambda ns, name, patch: self._io(self.kube.patch, ns, "events", name, patch),
        )

    # ------------------------------------------------------------------ wiring

    def bind_indexes(
        self, pods: Mapping[JobKey, Iterable[PodView]], services: Mapping[JobKey, Iterable[ServiceView]]
    ) -> None:
        """Give the controller kopf's live pod and Service indexes (keyed by (namespace, job name))."""
        self._pods_index = pods
        self._services_index = services

    def start(self) -> None:
        self.store.warm_up()
        loop = asyncio.get_running_loop()
        self._resync_task = loop.create_task(self._resync(), name="kelastic-resync")
        self._poll_task = loop.create_task(self._poll_stores(), name="kelastic-store-poll")

    async def stop(self) -> None:
        self._stopping = True
        await self.queue.stop()
        tasks = [t for t in (self._resync_task, self._poll_task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def job_seen(
        self, key: JobKey, resource_version: str | None = None, body: Mapping[str, Any] | None = None
    ) -> None:
        """A job was added or changed (``body``: as the watch delivered it).

        The echo of our own status write triggers nothing.
        """
        self._known.add(key)
        if body is not None:
            self._remember(key, body)
        if resource_version is not None and self._own_writes.get(key) == resource_version:
            return
        self.trigger(key)

    def _remember(self, key: JobKey, body: Mapping[str, Any]) -> None:
        """Keep ``body`` as the job's newest state, unless the cache already holds a newer one.

        A watch event can arrive after the answer of our own later write; both carry a
        resourceVersion, which etcd-backed servers issue as increasing integers. Where
        they do not parse, the arriving body wins (the watch's order).
        """
        old = self._bodies.get(key)
        if old is not None and _older(body, old):
            return
        self._bodies[key] = dict(body)

    def job_gone(self, key: JobKey, uid: str | None) -> None:
        self._known.discard(key)
        self._bodies.pop(key, None)
        self._stores.pop(key, None)
        self.queue.discard(key)
        self._passed_at.pop(key, None)
        self.templates.forget(key)
        self._logged_membership.pop(key, None)
        self._created.pop(key, None)
        self.metrics.job_removed(key)
        self._rdzv_cache.pop(key, None)
        self._own_writes.pop(key, None)
        if uid:
            self.store.forget(uid)
            self._ensured = {k: v for k, v in self._ensured.items() if not k.startswith(f"{uid}/")}

    def on_leadership(self, leader: bool) -> None:
        if leader:
            for key in list(self._known):
                self.trigger(key)

    # ------------------------------------------------------------------ triggering

    def trigger(self, key: JobKey) -> None:
        """Reconcile ``key`` soon; coalesces with a pass already running."""
        if not self._stopping:
            self.queue.add(key)

    async def _process(self, key: JobKey) -> None:
        """One reconcile pass of ``key`` (the work queue's callback): a failed pass, or one
        whose create or delete failed, is logged and retried with the job's back-off."""
        async with self._limit:
            try:
                self._change_failed.discard(key)
                await self.reconcile_once(key)
                if key in self._change_failed:
                    # A create or delete failed (its Event says why): nothing else
                    # would bring the job back soon, so retry as for a failed pass.
                    delay = self.queue.retry(key)
                    job_log(key, logging.INFO, f"retrying the failed change in {delay:g}s")
                else:
                    self.queue.forget(key)
            except asyncio.CancelledError:
                raise
            except ApiError as err:
                self.stats["errors"] += 1
                delay = self.queue.retry(key)
                job_log(key, logging.WARNING, f"reconcile failed: {err}; retrying in {delay:g}s")
            except Exception:
                self.stats["errors"] += 1
                delay = self.queue.retry(key)
                job_log(key, logging.ERROR, f"reconcile failed; retrying in {delay:g}s", exc_info=True)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.options.resync_interval)
            for key in list(self._known):
                self.trigger(key)

    def _requeue(self, key: JobKey, delay: float | None) -> None:
        """Reconcile ``key`` after ``delay`` seconds (the earlier of this and a pending request)."""
        self.queue.add_after(key, delay)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        self.stats["api_calls"] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except ApiError as err:
            self.metrics.api_error(err.status)
            raise

    # ------------------------------------------------------------------ one pass

    async def reconcile_once(self, key: JobKey) -> Decision | None:
        """Observe, decide and apply for one job. Returns the decision (None if not acting)."""
        if not self.is_leader():
            return None
        namespace, name = key
        body = self._bodies.get(key)
        if body is None:
            # Triggered before the job's watch delivered it (a pod event at start-up): read it once.
            self.stats["job_reads"] += 1
            body = await self._io(self.kube.get_job, namespace, name)
            if body is None:
                self.job_gone(key, None)
                return None
            self._remember(key, body)
        self._known.add(key)
        self.stats["reconciles"] += 1
        started = self._passed_at[key] = time.monotonic()
        pods = self._with_expected(key, list(self._pods_index.get(key, ())))
        services = list(self._services_index.get(key, ()))
        pods = await self._with_failure_logs(namespace, pods)
        job = await self.templates.check(parse_job(body))
        rdzv = await self._read_rendezvous(key, job, pods)
        original_status = dict(body.get("status") or {})
        decision: Decision | None = None
        for _ in range(3):
            observed = Observed(
                now=datetime.now(timezone.utc), pods=tuple(pods), services=tuple(services), rendezvous=rdzv
            )
            decision = reconcile(job, observed, self.options.reconcile)
            created_service = await self._apply(job, body, decision, pods, services)
            if not created_service:
                break
            # The new Service has its cluster IP now: decide again so workers start in this pass.
            job = parse_job({**body, "status": decision.status})
        assert decision is not None
        # Recoveries are counted once their mark is in the status: a new operator reads it
        # and does not count them again (the agents report their latest for as long as they run).
        recoveries, status = count_recoveries(decision.status, rdzv.recoveries if rdzv is not None else ())
        patch = merge_patch(original_status, status)
        if patch and not any(isinstance(a, DeleteJob) for a in decision.actions):
            try:
                written = await self._io(self.kube.patch_job_status, namespace, name, patch)
                rv = (written.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._own_writes[key] = str(rv)
                if written.get("metadata"):
                    self._remember(key, written)
            except ApiError as err:
                if err.status != 404:
                    raise
            else:
                self.metrics.recoveries_counted(recoveries)
        self._requeue(key, decision.requeue_after)
        self.metrics.reconciled(time.monotonic() - started)
        self.metrics.job_observed(
            key,
            decision.status.get("phase"),
            world_size=decision.status.get("worldSize"),
            restarts=decision.status.get("restarts"),
        )
        return decision

    def _with_expected(self, key: JobKey, pods: list[PodView]) -> list[PodView]:
        """``pods`` plus the pods this operator created that the watch has not delivered yet.

        Without them, a pass that starts between a create and its watch event would
        create the same pod again (a 409, a wasted request per pod). As with the
        ReplicaSet controller's expectations, a created pod is assumed to exist for
        :data:`EXPECT_SECONDS` at most; a pass is scheduled for then, so a pod deleted
        before the watch ever showed it is noticed.
        """
        created = self._created.get(key)
        if not created:
            return pods
        seen = {p.name for p in pods}
        now = time.monotonic()
        for name, (since, _) in list(created.items()):
            if name in seen or now - since > EXPECT_SECONDS:
                del created[name]
        if not created:
            del self._created[key]
            return pods
        self._requeue(key, EXPECT_SECONDS)
        return pods + [view for _, view in created.values()]

    async def _with_failure_logs(self, namespace: str, pods: list[PodView]) -> list[PodView]:
        """Give failed workers without a termination message the tail of their log instead.

        A real kubelet does this itself with ``terminationMessagePolicy:
        FallbackToLogsOnError``; doing it here as well makes the job's Failed condition
        name the failed rank and exit code on any cluster. One read per failed pod.
        """
        out: list[PodView] = []
        for pod in pods:
            if (
                pod.role == contract.ROLE_WORKER
                and pod.phase is PodPhase.FAILED
                and not pod.terminating
                and not pod.message
            ):
                text = self._failure_logs.get(pod.uid)
                if text is None:
                    try:
                        text = await self._io(self.kube.pod_log, namespace, pod.name, pod.container)
                    except ApiError as err:
                        log.debug("no log of failed pod %s/%s: %s", namespace, pod.name, err)
                        text = ""
                    if len(self._failure_logs) >= 1000:
                        self._failure_logs.pop(next(iter(self._failure_logs)))
                    self._failure_logs[pod.uid] = text
                if text:
                    pod = replace(pod, message=text)
            out.append(pod)
        return out

    async def _read_rendezvous(self, key: JobKey, job: Job, pods: list[PodView]) -> RendezvousView | None:
        """The store's last known figures for the job (None before the first read).

        Never waits for the store: a slow or dead store must not delay the reconcile.
        Registers the job's store for the periodic reads of :meth:`_poll_stores` while
        the job runs with a store (and unregisters it otherwise).
        """
        spec = job.spec
        endpoint = (spec.rdzv_endpoint or job.status.get("rdzvEndpoint")) if spec is not None else None
        if (
            spec is None
            or not builders.uses_control(spec)
            or job.status.get("phase") in {p.value for p in TERMINAL_PHASES}
            or not endpoint
            or (
                not spec.rdzv_endpoint
                and not any(
                    p.role == contract.ROLE_RENDEZVOUS and p.phase is PodPhase.RUNNING and not p.terminating
                    for p in pods
                )
            )
        ):
            self._stores.pop(key, None)
            return None
        store = (str(endpoint), job.meta.uid)
        first = self._stores.get(key) != store
        self._stores[key] = store
        cached = self._rdzv_cache.get(key)
        if (first or cached is None) and key not in self._rdzv_reading:
            self._rdzv_reading.add(key)
            self._spawn(self._refresh_rendezvous(key, *store))
        return cached[1] if cached is not None else None

    async def _poll_stores(self) -> None:
        """Read the store of every running job every ``store_read_interval`` (no API request)."""
        while True:
            await asyncio.sleep(self.options.store_read_interval)
            if not self.is_leader():
                continue
            for key, store in list(self._stores.items()):
                if key not in self._rdzv_reading:
                    self._rdzv_reading.add(key)
                    self._spawn(self._refresh_rendezvous(key, *store))

    async def _refresh_rendezvous(self, key: JobKey, endpoint: str, run_id: str) -> None:
        try:
            view = await self.store.read(endpoint, run_id)
        finally:
            self._rdzv_reading.discard(key)
        old = self._rdzv_cache.get(key)
        self._rdzv_cache[key] = (time.monotonic(), view)
        if view is None or key not in self._known:
            return
        before = old[1] if old is not None else None
        # A new round (world size, members) or restart count is worth a pass now; progress
        # alone at most every progress_interval, which keeps status writes per job bounded.
        if before is None or (view.world_size, view.members, view.restarts, view.recoveries) != (
            before.world_size,
            before.members,
            before.restarts,
            before.recoveries,
        ):
            self.trigger(key)
        elif (view.step, view.total) != (before.step, before.total):
            # Any pass writes the newest progress: wait for progress_interval after the last one.
            due = self._passed_at.get(key, float("-inf")) + self.options.progress_interval
            self._requeue(key, max(0.0, due - time.monotonic()))

    def _request_publish(self, key: JobKey, action: PublishMembership) -> None:
        """Publish the latest membership of a job in the background, one publish at a time, in order."""
        idle = key not in self._to_publish
        self._to_publish[key] = action
        if idle:
            self._spawn(self._publisher(key))

    async def _publisher(self, key: JobKey) -> None:
        try:
            while key in self._to_publish:
                # Connect first, then publish the newest membership: a connect can take seconds,
                # and what was true before it may not be any more.
                await self.store.connect(self._to_publish[key].endpoint)
                action = self._to_publish.get(key)
                if action is None:
                    break
                if await self.store.publish(action):
                    # The store gets the membership again every few seconds (it may have
                    # restarted); the log says so only when the membership changed.
                    changed = self._logged_membership.get(key) != action.nodes
                    self._logged_membership[key] = action.nodes
                    job_log(
                        key,
                        logging.INFO if changed else logging.DEBUG,
                        f"published membership {list(action.nodes)}",
                    )
                if self._to_publish.get(key) is action:
                    del self._to_publish[key]
        finally:
            self._to_publish.pop(key, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ applying

    async def _apply(
        self,
        job: Job,
        body: Mapping[str, Any],
        decision: Decision,
        pods: list[PodView],
        services: list[ServiceView],
    ) -> bool:
        """Apply ``decision``; update ``pods``/``services`` with what changed. True if a Service was created."""
        ns = job.meta.namespace
        created_service = False
        for action in decision.actions:
            if isinstance(action, CreateService):
                result = await self._change(body, action, self.kube.create, ns, "services", action.manifest)
                if result is not None:
                    services.append(service_view(result))
                    created_service = True
            elif isinstance(action, DeleteService):
                await self._change(body, action, self.kube.delete, ns, "services", action.name)
            elif isinstance(action, EnsureObject):
                await self._ensure(body, action)
        # The membership goes first: survivors of a scale-down re-form before their peer is stopped.
        for action in decision.actions:
            if isinstance(action, PublishMembership):
                self._request_publish((ns, job.meta.name), action)
        pod_actions = [a for a in decision.actions if isinstance(a, CreatePod | DeletePod)]
        failed_creates: list[str] = []
        results = await asyncio.gather(*(self._pod_action(body, ns, a, failed_creates) for a in pod_actions))
        key = (ns, job.meta.name)
        created: list[CreatePod] = []
        for action, result in zip(pod_actions, results, strict=True):
            if isinstance(action, CreatePod) and isinstance(result, dict):
                view = pod_view(result)
                pods.append(view)
                created.append(action)
                self._created.setdefault(key, {})[view.name] = (time.monotonic(), view)
            elif isinstance(action, DeletePod) and result is not None:
                pods[:] = [replace(p, terminating=True) if p.uid == action.uid else p for p in pods]
        # One Event per reason for the pods a pass created (a job of 1,000 pods: one Event, not 1,000).
        for reason in dict.fromkeys(a.reason for a in created):
            same = [a for a in created if a.reason == reason]
            self._event(body, reason, combined_message([a.message for a in same]), warning=same[0].warning)
        if failed_creates:  # likewise one Event for the creates that failed (a 403 on 1,000 pods)
            self._event(body, "FailedCreate", combined_message(failed_creates), warning=True)
        for action in decision.actions:
            if isinstance(action, Emit):
                self._event(body, action.reason, action.message, warning=action.warning)
                job_log(
                    (ns, job.meta.name), logging.WARNING if action.warning else logging.INFO, action.message
                )
            elif isinstance(action, DeleteJob):
                job_log((ns, job.meta.name), logging.INFO, action.message)
                try:
                    await self._io(self.kube.delete_job, ns, job.meta.name, job.meta.uid)
                except ApiError as err:
                    if err.status not in (404, 409):
                        raise
        return created_service

    async def _ensure(self, body: Mapping[str, Any], action: EnsureObject) -> None:
        """Make ``action``'s object exist with its manifest's labels and spec.

        Once per run and whenever the manifest changes: create it; if it exists (409),
        merge-patch its labels and spec. A failure (no permission, an API the cluster
        does not serve) is an Event and a log line, retried at most once a minute.
        """
        wanted = json.dumps(action.manifest, sort_keys=True, default=str)
        failed_at = self._ensure_failed.get(action.key)
        if self._ensured.get(action.key) == wanted or (
            failed_at is not None and time.monotonic() - failed_at < 60.0
        ):
            return
        try:
            try:
                await self._io(self.kube.request, "POST", action.path, dict(action.manifest))
                message = action.message
            except ApiError as err:
                if err.status != 409:
                    raise
                name = str((action.manifest.get("metadata") or {}).get("name"))
                patch = {
                    "metadata": {"labels": (action.manifest.get("metadata") or {}).get("labels") or {}},
                    "spec": action.manifest.get("spec") or {},
                }
                merge = functools.partial(self.kube.request, content_type="application/merge-patch+json")
                await self._io(merge, "PATCH", f"{action.path}/{name}", patch)
                message = f"{action.message} (updated the existing one)"
        except ApiError as err:
            self._ensure_failed[action.key] = time.monotonic()
            failure = f"{action.message} failed: {err}"
            job_log(_key_of(body), logging.WARNING, failure)
            self._event(body, "FailedCreate", failure, warning=True)
            return
        if action.key in self._ensured or message == action.message:
            job_log(_key_of(body), logging.INFO, message)
            self._event(body, action.reason, message, warning=action.warning)
        self._ensured[action.key] = wanted
        self._ensure_failed.pop(action.key, None)

    async def _pod_action(
        self, body: Mapping[str, Any], ns: str, action: CreatePod | DeletePod, failed_creates: list[str]
    ) -> Any:
        if isinstance(action, CreatePod):
            # The Event comes per reason for the whole pass (see _apply).
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
        return await self._change(body, action, self.kube.delete, ns, "pods", action.name, action.uid)

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
            self._change_failed.add(_key_of(body))
            job_log(_key_of(body), logging.WARNING, message)
            if failures is not None:
                failures.append(message)
            else:
                self._event(body, verb, message, warning=True)
            return None
        job_log(_key_of(body), logging.INFO, action.message)
        self.metrics.action_applied(action.reason)
        if event:
            self._event(body, action.reason, action.message, warning=action.warning)
        return result if result is not None else True

    def _event(self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
        meta = body.get("metadata") or {}
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
        }
        self._spawn(self._post_event(event))

    async def _post_event(self, event: dict[str, Any]) -> None:
        """Post or count the Event (a repeat of the same cause updates one object)."""
        try:
            await self.events.record(event)
        except Exception as exc:  # Events are best effort
            log.debug("could not post Event %s: %s", event.get("reason"), exc)

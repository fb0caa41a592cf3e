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

The parts, one module each: the work queue (``workqueue``), what is remembered of
each job between passes (``jobcache``), the pod template's verdict
(``validation``), the rendezvous stores (``storesync``), carrying actions out
(``executor``) and Events (``events``). This module wires them and runs the pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kelastic.operator import nodeloss, validation
from kelastic.operator.clock import SYSTEM, Clock
from kelastic.operator.events import EventEmitter, EventRecorder
from kelastic.operator.executor import ActionExecutor
from kelastic.operator.jobcache import EXPECT_SECONDS, JobCache
from kelastic.operator.joblog import JobKey, job_log
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.kueue import queue_name
from kelastic.operator.kueuesync import QueueSync
from kelastic.operator.metrics import OperatorMetrics, count_recoveries
from kelastic.operator.observed import Observed, PodView, ServiceView
from kelastic.operator.reconcile import (
    Decision,
    DeleteJob,
    ReconcileConfig,
    external_store,
    lost_node,
    reconcile,
)
from kelastic.operator.spec import parse_job
from kelastic.operator.status import merge_patch
from kelastic.operator.store_client import StoreClient
from kelastic.operator.storesync import StoreSync
from kelastic.operator.workqueue import WorkQueue

__all__ = ["Controller", "ControllerOptions", "JobKey"]

T = TypeVar("T")


@dataclass(frozen=True)
class ControllerOptions:
    """How often the controller acts on its own, and how much it does at once."""

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
    #: Jobs labelled ``kueue.x-k8s.io/queue-name`` wait for Kueue's admission (kelastic.operator.kueue).
    kueue: bool = False


class Controller:
    """Reconciles ElasticJobs: :meth:`trigger` asks for a pass, :meth:`reconcile_once` is one.

    ``is_leader()`` gates every pass (a standby observes, never acts); ``metrics``
    receives what happened. :meth:`start` and :meth:`stop` run inside the event loop.
    """

    def __init__(
        self,
        kube: Kube,
        store: StoreClient,
        options: ControllerOptions | None = None,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        metrics: OperatorMetrics | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.kube = kube
        #: The time of the queue's delays, the store reads, the resync and each pass's ``now``.
        self.clock = clock
        #: Prometheus series (kelastic.operator.metrics); served by the CLI's --metrics-port.
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.store = store
        self.options = options or ControllerOptions()
        self.is_leader = is_leader
        self._pods_index: Mapping[JobKey, Iterable[PodView]] = {}
        self._services_index: Mapping[JobKey, Iterable[ServiceView]] = {}
        #: Which jobs to reconcile when: coalesced triggers, deadlines, back-off after failures.
        self.queue: WorkQueue[JobKey] = WorkQueue(
            self._process,
            max_delay=self.options.max_retry_delay,
            describe=lambda k: f"{k[0]}/{k[1]}",
            clock=clock,
        )
        #: The newest body of each job, our own writes, pods created but not yet watched.
        self.cache = JobCache()
        #: The API server's verdict on each job's pod template, once per generation.
        self.templates = validation.TemplateChecker(
            self.kube.dry_run_create, self._io, self.options.reconcile.build
        )
        #: Each running job's store: its last figures, the periodic reads, the membership published.
        self.stores = StoreSync(
            store,
            trigger=self.trigger,
            requeue=self._requeue,
            known=lambda key: key in self.cache.known,
            spawn=self._spawn,
            is_leader=lambda: self.is_leader(),
            read_interval=self.options.store_read_interval,
            progress_interval=self.options.progress_interval,
            clock=clock,
        )
        #: Events are posted in the background; a repeat updates the Event already posted.
        self.events = EventEmitter(
            EventRecorder(
                lambda ns, body: self._io(self.kube.create, ns, "events", body),
                lambda ns, name, patch: self._io(self.kube.patch, ns, "events", name, patch),
            ),
            self._spawn,
        )
        self.executor = ActionExecutor(
            self.kube, self._io, self.events, self.metrics, self.cache, self.stores.publish, store.job_secret
        )
        #: Queued jobs' Workloads (only with ``options.kueue``).
        self.queues = QueueSync(self.kube, self._io, self.events) if self.options.kueue else None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kelastic-api")
        self._limit = asyncio.Semaphore(self.options.max_parallel)
        self._resync_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._stopping = False
        #: Counters for tests, benchmarks and logs.
        self.stats: dict[str, int] = {"reconciles": 0, "api_calls": 0, "errors": 0, "job_reads": 0}

    # ------------------------------------------------------------------ wiring

    def bind_indexes(
        self, pods: Mapping[JobKey, Iterable[PodView]], services: Mapping[JobKey, Iterable[ServiceView]]
    ) -> None:
        """Give the controller kopf's live pod and Service indexes (keyed by (namespace, job name))."""
        self._pods_index = pods
        self._services_index = services

    def start(self) -> None:
        """Start the resync and the store reads (inside the running event loop)."""
        self.store.warm_up()
        loop = asyncio.get_running_loop()
        self._resync_task = loop.create_task(self._resync(), name="kelastic-resync")
        self._poll_task = loop.create_task(self.stores.poll(), name="kelastic-store-poll")

    async def stop(self) -> None:
        """Stop: no new pass; running passes, timers and background tasks are cancelled and awaited.

        Threads blocked in an API request are not waited for (the process may exit with them).
        """
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
        self.cache.known.add(key)
        if body is not None:
            self.cache.remember(key, body)
        if self.cache.is_own_write(key, resource_version):
            return
        self.trigger(key)

    def pod_seen(self, key: JobKey, name: str) -> None:
        """The watch delivered an event of the job's pod ``name``: it is no longer only expected."""
        self.cache.seen(key, name)

    def job_gone(self, key: JobKey, uid: str | None) -> None:
        """The job was deleted: forget everything kept about it."""
        self.cache.forget(key)
        self.stores.forget(key, uid)
        self.queue.discard(key)
        self.templates.forget(key)
        self.metrics.job_removed(key)
        if uid:
            self.executor.forget(uid)

    def on_leadership(self, leader: bool) -> None:
        """Leadership changed: a new leader passes over every known job (a standby only observed)."""
        if leader:
            for key in list(self.cache.known):
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
                self.executor.failed.pop(key, None)
                await self.reconcile_once(key)
                if (failure := self.executor.failed.get(key)) is not None:
                    # A create or delete failed (its Event says why): nothing else
                    # would bring the job back soon, so retry as for a failed pass.
                    delay = self.queue.retry(key)
                    job_log(key, logging.INFO, f"retrying the failed change in {delay:g}s ({failure})")
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
            await self.clock.sleep(self.options.resync_interval)
            for key in list(self.cache.known):
                self.trigger(key)

    def _requeue(self, key: JobKey, delay: float | None) -> None:
        """Reconcile ``key`` after ``delay`` seconds (the earlier of this and a pending request)."""
        self.queue.add_after(key, delay)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a blocking API call) in the controller's thread pool; counts it and its failures."""
        self.stats["api_calls"] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except ApiError as err:
            self.metrics.api_error(err.status)
            raise

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background; :meth:`stop` cancels what is still running."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ one pass

    async def _lost_nodes(self, key: JobKey, pods: Iterable[PodView]) -> dict[str, str]:
        """The nodes of the pods the taint manager deleted that the control plane gave up, with why
        (``kelastic.operator.nodeloss``). One GET per such node; none for a job without such pods.
        A node that cannot be read counts as held: its pods wait for it, said in the log."""
        lost: dict[str, str] = {}
        for node in sorted(lost_node.nodes_to_read(pods)):
            try:
                why = nodeloss.node_lost(await self._io(self.kube.get_node, node))
            except ApiError as err:
                job_log(
                    key,
                    logging.WARNING,
                    f"cannot read node {node} ({err}): the job's pods the control plane evicted from it "
                    "stay Terminating until it returns (the operator needs get on nodes to replace them)",
                )
                continue
            if why is not None:
                lost[node] = why
        return lost

    async def reconcile_once(self, key: JobKey) -> Decision | None:
        """Observe, decide and apply for one job. Returns the decision (None if not acting)."""
        if not self.is_leader():
            return None
        namespace, name = key
        body = self.cache.body(key)
        if body is None:
            # Triggered before the job's watch delivered it (a pod event at start-up): read it once.
            self.stats["job_reads"] += 1
            body = await self._io(self.kube.get_job, namespace, name)
            if body is None:
                self.job_gone(key, None)
                return None
            self.cache.remember(key, body)
        self.cache.known.add(key)
        self.stats["reconciles"] += 1
        started = time.monotonic()
        self.stores.pass_started(key)
        pods, expecting = self.cache.with_expected(key, list(self._pods_index.get(key, ())))
        if expecting:
            self._requeue(key, EXPECT_SECONDS)
        services = list(self._services_index.get(key, ()))
        pods = await self.cache.with_failure_logs(
            namespace, pods, lambda ns, pod, container: self._io(self.kube.pod_log, ns, pod, container)
        )
        # A job refused for its store is refused before the store is read: the operator connects
        # only to stores it may (reconcile applies the same rule again, purely).
        job = external_store.admitted(await self.templates.check(parse_job(body)), self.options.reconcile)
        rdzv = self.stores.observe(key, job, pods)
        lost_nodes = await self._lost_nodes(key, pods)
        original_status = dict(body.get("status") or {})
        decision: Decision | None = None
        queued = self.queues is not None and queue_name(job) is not None and job.spec is not None
        priority = await self.queues.priority(job) if self.queues is not None and queued else None
        for _ in range(3):
            grant = None
            if self.queues is not None and queued:
                # No await between these two: the flavors read are those of the Workloads planned.
                await self.queues.read_flavors(key)
                before = self.queues.plan(job, pods, job.status.get("phase"), priority, self.clock.now())
                grant = before.grant if before is not None else None
            observed = Observed(
                now=self.clock.now(),
                pods=tuple(pods),
                services=tuple(services),
                rendezvous=rdzv,
                queue=grant,
                lost_nodes=lost_nodes,
            )
            decision = reconcile(job, observed, self.options.reconcile)
            applied = await self.executor.apply(job, body, decision, pods, services)
            # Decide again over what this pass made: a new Service has its cluster IP, so
            # workers start in this pass; new pods count in the status this pass writes
            # (else the next pass writes it again). Not after a delete: a replacement waits
            # for the watch to show the old pod gone.
            if not (applied.created_service or (applied.created_pods and not applied.deleted_pods)):
                break
            job = parse_job({**body, "status": decision.status})
        assert decision is not None
        if self.queues is not None and queued:
            # Planned again as of the pass's outcome: a job that just ended finishes its Workloads now.
            after = self.queues.plan(job, pods, decision.status.get("phase"), priority, self.clock.now())
            if after is not None:
                await self.queues.apply(body, job, after)
        # Recoveries are counted once their mark is in the status: a new operator reads it
        # and does not count them again (the agents report their latest for as long as they run).
        recoveries, status = count_recoveries(decision.status, rdzv.recoveries if rdzv is not None else ())
        patch = merge_patch(original_status, status)
        if patch and not any(isinstance(a, DeleteJob) for a in decision.actions):
            try:
                self.cache.wrote(key, await self._io(self.kube.patch_job_status, namespace, name, patch))
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
            standbys=decision.status.get("standbys"),
            goodput=decision.status.get("goodput"),
        )
        return decision

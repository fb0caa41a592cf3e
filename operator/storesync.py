"""The controller's side of each job's rendezvous store: figures read, membership published.

:class:`StoreSync` never makes a reconcile pass wait for a store:

- :meth:`StoreSync.observe` returns the store's last figures for a job (None before
  the first read) and registers the store of a running job for the periodic reads;
- :meth:`StoreSync.poll` reads every registered store every ``read_interval``
  seconds (one small TCP read per job, no API request). A new round or restart
  count, or a new recovery, triggers a pass at once; progress alone at most every
  ``progress_interval`` after the job's last pass, which keeps status writes per
  job bounded;
- :meth:`StoreSync.publish` hands a membership to a per-job background publisher:
  one publish at a time, always the newest membership.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kelastic.agent import contract
from kelastic.operator import builders
from kelastic.operator.clock import SYSTEM, Clock
from kelastic.operator.joblog import JobKey, job_log
from kelastic.operator.observed import PodPhase, PodView, RendezvousView
from kelastic.operator.reconcile import PublishMembership
from kelastic.operator.spec import Job
from kelastic.operator.status import TERMINAL_PHASES
from kelastic.operator.store_client import StoreClient

__all__ = ["StoreSync"]

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class StoreSync:
    """Reads and writes each job's store off the reconcile pass.

    ``trigger(key)`` asks for a pass now, ``requeue(key, delay)`` for one after
    ``delay`` seconds; ``known(key)`` says whether the job still exists; ``spawn``
    runs a coroutine in the background; reads pause while ``is_leader()`` is False.
    """

    def __init__(
        self,
        store: StoreClient,
        *,
        trigger: Callable[[JobKey], None],
        requeue: Callable[[JobKey, float], None],
        known: Callable[[JobKey], bool],
        spawn: Spawn,
        is_leader: Callable[[], bool],
        read_interval: float,
        progress_interval: float,
        clock: Clock = SYSTEM,
    ) -> None:
        self.store = store
        self._trigger = trigger
        self._requeue = requeue
        self._known = known
        self._spawn = spawn
        self._is_leader = is_leader
        self.read_interval = read_interval
        self.progress_interval = progress_interval
        self._clock = clock
        self._views: dict[JobKey, tuple[float, RendezvousView | None]] = {}  # (when read, figures)
        self._reading: set[JobKey] = set()
        self._stores: dict[JobKey, tuple[str, str]] = {}  # running jobs' (store endpoint, run id)
        self._passed_at: dict[JobKey, float] = {}  # when the last pass of a job started (monotonic)
        self._to_publish: dict[JobKey, PublishMembership] = {}
        self._logged_membership: dict[JobKey, tuple[str, ...]] = {}
        self._finishing: set[JobKey] = set()  # jobs with a succeeded worker, read once more at once

    # ------------------------------------------------------------------ reading

    def pass_started(self, key: JobKey) -> None:
        """A pass of ``key`` starts (it writes the newest progress: the next is due ``progress_interval`` later)."""
        self._passed_at[key] = self._clock.monotonic()

    def observe(self, key: JobKey, job: Job, pods: list[PodView]) -> RendezvousView | None:
        """The store's last known figures for the job (None before the first read).

        Never waits for the store: a slow or dead store must not delay the reconcile.
        Registers the job's store for the periodic reads of :meth:`poll` while the job
        runs with a store (and unregisters it otherwise); a store not read yet is read now,
        in the background.
        """
        spec = job.spec
        endpoint = (spec.rdzv_endpoint or job.status.get("rdzvEndpoint")) if spec is not None else None
        if job.status.get("phase") in {p.value for p in TERMINAL_PHASES}:
            return self._last_look(key)
        if (
            spec is None
            or not builders.uses_control(spec)
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
        cached = self._views.get(key)
        finishing = key not in self._finishing and any(
            p.role == contract.ROLE_WORKER and p.phase is PodPhase.SUCCEEDED for p in pods
        )
        if (first or cached is None or finishing) and key not in self._reading:
            # A worker succeeded: its agent published its last steps before it ended, and the
            # job may finish (and its store go) before the next periodic read: read now, and
            # let a change of progress alone trigger a pass too.
            if finishing:
                self._finishing.add(key)
            self._reading.add(key)
            self._spawn(self._refresh(key, *store, final=finishing))
        return cached[1] if cached is not None else None

    async def poll(self) -> None:
        """Read the store of every running job every ``read_interval`` (no API request); runs until cancelled."""
        while True:
            await self._clock.sleep(self.read_interval)
            if not self._is_leader():
                continue
            for key, store in list(self._stores.items()):
                if key not in self._reading:
                    self._reading.add(key)
                    self._spawn(self._refresh(key, *store))

    def _last_look(self, key: JobKey) -> RendezvousView | None:
        """A finished job: stop the periodic reads, but read its store once more, since the
        agents' last progress report (at their workers' exit) may have landed after the last
        read; a pass follows when it changed the figures. Returns the last figures read, so
        that the finished job's status shows them."""
        store = self._stores.pop(key, None)
        if store is not None and key not in self._reading:
            self._reading.add(key)
            self._spawn(self._refresh(key, *store, final=True))
        cached = self._views.get(key)
        return cached[1] if cached is not None else None

    async def _refresh(self, key: JobKey, endpoint: str, run_id: str, final: bool = False) -> None:
        try:
            view = await self.store.read(endpoint, run_id)
        finally:
            self._reading.discard(key)
        if final and view is None:
            return  # the store is gone already: the figures read last stay
        old = self._views.get(key)
        self._views[key] = (self._clock.monotonic(), view)
        if view is None or not self._known(key):
            return
        before = old[1] if old is not None else None
        # A new round (world size, members), restart count, recovery or checkpoint restore is worth
        # a pass now; progress (and a new checkpoint) alone at most every progress_interval, which
        # keeps status writes per job bounded. A round is new even with the same members (a
        # deleted pod comes back under its name).
        if (
            before is None
            or (
                final
                and (view.step, view.total, view.round, view.restarts)
                != (before.step, before.total, before.round, before.restarts)
            )
            or (
                view.world_size,
                view.members,
                view.restarts,
                view.recoveries,
                view.round,
                _restores(view),
                view.standbys,
            )
            != (
                before.world_size,
                before.members,
                before.restarts,
                before.recoveries,
                before.round,
                _restores(before),
                before.standbys,
            )
        ):
            self._trigger(key)
        elif (view.step, view.total, _latest(view)) != (before.step, before.total, _latest(before)):
            # Any pass writes the newest progress: wait for progress_interval after the last one.
            due = self._passed_at.get(key, float("-inf")) + self.progress_interval
            self._requeue(key, max(0.0, due - self._clock.monotonic()))

    # ------------------------------------------------------------------ publishing

    def publish(self, key: JobKey, action: PublishMembership) -> None:
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

    # ------------------------------------------------------------------ forgetting

    def forget(self, key: JobKey, uid: str | None) -> None:
        """The job is gone: stop reading its store and drop its figures (and its connection, by ``uid``)."""
        self._stores.pop(key, None)
        self._views.pop(key, None)
        self._passed_at.pop(key, None)
        self._logged_membership.pop(key, None)
        self._finishing.discard(key)
        if uid:
            self.store.forget(uid)


def _restores(view: RendezvousView) -> tuple[object, ...]:
    return tuple(c.restored for c in view.checkpoints)


def _latest(view: RendezvousView) -> tuple[int | None, ...]:
    return tuple(c.latest for c in view.checkpoints)

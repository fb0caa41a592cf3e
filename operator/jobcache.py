"""What the controller remembers of each job between passes, so that a pass sends no read.

:class:`JobCache` holds, per job:

- the newest ElasticJob body seen, from the watch or from the answer of our own
  status write, whichever is newer (:meth:`JobCache.remember`);
- the resourceVersion our last status write produced, so the watch's echo of it
  triggers no pass (:meth:`JobCache.is_own_write`);
- the pods this operator created that the watch has not shown yet (the
  "expectations" of the ReplicaSet controller: :meth:`JobCache.with_expected`);
- the log tails of failed workers (:meth:`JobCache.with_failure_logs`), read once
  per pod.

Pods and Services themselves live in kopf's indexes, not here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from kelastic.agent import contract
from kelastic.operator.joblog import JobKey, log
from kelastic.operator.kube import ApiError
from kelastic.operator.observed import PodPhase, PodView

__all__ = ["EXPECT_SECONDS", "JobCache", "older"]

#: How long a pod this operator created counts as existing before the watch shows it (seconds).
#: The watch's first event of the pod ends it sooner (:meth:`JobCache.seen`); this bound only
#: matters when that event never comes (a watch that broke). Under load the watch can lag the
#: creates by many seconds: at 5 s, a burst of 1,000 jobs re-sent some 2,000 creates (409s).
EXPECT_SECONDS = 30.0
#: Failed workers' log tails kept at most (the oldest go first).
MAX_FAILURE_LOGS = 1000

#: Reads the tail of a pod's log: ``(namespace, pod name, container) -> text``.
ReadLog = Callable[[str, str, str | None], Awaitable[str]]


def older(body: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    """Whether ``body``'s resourceVersion is lower than ``than``'s (False when either is not an integer)."""
    try:
        return int(str((body.get("metadata") or {}).get("resourceVersion"))) < int(
            str((than.get("metadata") or {}).get("resourceVersion"))
        )
    except ValueError:
        return False


class JobCache:
    """Per-job memory of the controller; every method is cheap and sends no request,
    except :meth:`with_failure_logs` (one log read per failed pod, ever)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Jobs the watch delivered and that still exist.
        self.known: set[JobKey] = set()
        self._bodies: dict[JobKey, dict[str, Any]] = {}
        self._own_writes: dict[JobKey, str] = {}
        self._created: dict[JobKey, dict[str, tuple[float, PodView]]] = {}
        self._failure_logs: dict[str, str] = {}  # pod uid -> log tail

    # ------------------------------------------------------------------ the job itself

    def body(self, key: JobKey) -> dict[str, Any] | None:
        """The newest body of the job seen (None before the watch delivered it)."""
        return self._bodies.get(key)

    def remember(self, key: JobKey, body: Mapping[str, Any]) -> None:
        """Keep ``body`` as the job's newest state, unless the cache already holds a newer one.

        A watch event can arrive after the answer of our own later write; both carry a
        resourceVersion, which etcd-backed servers issue as increasing integers. Where
        they do not parse, the arriving body wins (the watch's order).
        """
        old = self._bodies.get(key)
        if old is not None and older(body, old):
            return
        self._bodies[key] = dict(body)

    def wrote(self, key: JobKey, written: Mapping[str, Any]) -> None:
        """Our status write was answered with ``written``: it is the job's newest state."""
        meta = written.get("metadata") or {}
        if meta.get("resourceVersion"):
            self._own_writes[key] = str(meta["resourceVersion"])
        if meta:
            self.remember(key, written)

    def is_own_write(self, key: JobKey, resource_version: str | None) -> bool:
        """Whether ``resource_version`` is the one our last status write of the job produced."""
        return resource_version is not None and self._own_writes.get(key) == resource_version

    # ------------------------------------------------------------------ pods

    def expect(self, key: JobKey, view: PodView) -> None:
        """This operator just created the pod ``view``: count it as existing until the watch shows it."""
        self._created.setdefault(key, {})[view.name] = (self._clock(), view)

    def seen(self, key: JobKey, name: str) -> None:
        """The watch delivered an event of the pod ``name``: from now on the index tells of it."""
        created = self._created.get(key)
        if created is not None and created.pop(name, None) is not None and not created:
            del self._created[key]

    def with_expected(self, key: JobKey, pods: list[PodView]) -> tuple[list[PodView], bool]:
        """``pods`` plus the pods this operator created that the watch has not delivered yet.

        Without them, a pass that starts between a create and its watch event would
        create the same pod again (a 409, a wasted request per pod). As with the
        ReplicaSet controller's expectations, a created pod is assumed to exist for
        :data:`EXPECT_SECONDS` at most. The flag is True while some are still
        expected: the caller passes again after :data:`EXPECT_SECONDS`, so a pod
        deleted before the watch ever showed it is noticed.
        """
        created = self._created.get(key)
        if not created:
            return pods, False
        seen = {p.name for p in pods}
        now = self._clock()
        for name, (since, _) in list(created.items()):
            if name in seen or now - since > EXPECT_SECONDS:
                del created[name]
        if not created:
            del self._created[key]
            return pods, False
        return pods + [view for _, view in created.values()], True

    async def with_failure_logs(
        self, namespace: str, pods: list[PodView], read_log: ReadLog
    ) -> list[PodView]:
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
                        text = await read_log(namespace, pod.name, pod.container)
                    except ApiError as err:
                        log.debug("no log of failed pod %s/%s: %s", namespace, pod.name, err)
                        text = ""
                    if len(self._failure_logs) >= MAX_FAILURE_LOGS:
                        self._failure_logs.pop(next(iter(self._failure_logs)))
                    self._failure_logs[pod.uid] = text
                if text:
                    pod = replace(pod, message=text)
            out.append(pod)
        return out

    # ------------------------------------------------------------------ forgetting

    def forget(self, key: JobKey) -> None:
        """The job is gone: drop what is kept of it (failed pods' logs age out on their own)."""
        self.known.discard(key)
        self._bodies.pop(key, None)
        self._own_writes.pop(key, None)
        self._created.pop(key, None)

"""The operator's Prometheus metrics (``prometheus_client``), served on ``--metrics-port``.

:class:`OperatorMetrics` owns one registry; the controller tells it what happened
and it keeps the series:

``kelastic_jobs{phase}``
    ElasticJobs this operator reconciles, by ``status.phase`` (every phase is
    present, 0 when none).
``kelastic_job_world_size{namespace,job}``, ``kelastic_job_restarts{namespace,job}``
    Ranks in the job's current rendezvous round, and restarts its agents spent
    (the highest ``TORCHELASTIC_RESTART_COUNT``); removed with the job.
``kelastic_job_standbys{namespace,job}``
    Worker pods waiting in the job's rendezvous as hot standbys (``status.standbys``);
    only for jobs that show it, removed with the job.
``kelastic_job_goodput_ratio{namespace,job}``, ``kelastic_job_goodput_seconds{namespace,job,kind}``
    The job's goodput (``status.goodput.ratio``) and its parts in seconds, by ``kind``:
    ``elapsed``, ``productive``, ``restart``, ``redone`` and ``save_stall``
    (docs/operations.md); only once the job has them, removed with the job.
``kelastic_pod_recreations_total{reason}``
    Pods the operator deleted or created to replace one: ``RecreateWorker`` (a
    failed worker), ``StoreDied`` (the rendezvous store), and whatever else
    :data:`RECREATION_REASONS` names.
``kelastic_reconcile_total``, ``kelastic_reconcile_duration_seconds``
    Reconcile passes and how long each took (histogram).
``kelastic_api_errors_total{code}``
    Kubernetes API calls that failed, by HTTP status (``0``: no answer).
``kelastic_recovery_seconds``
    Recovery times of jobs (histogram): from an agent deciding to restart its
    workers (a member was lost or joined, or workers failed) to the next rendezvous
    round closing, as the agents report it through the store (see
    ``kelastic.agent.rendezvous.control``). Every member of a round reports the same
    recovery; reports of one job that end within :data:`SAME_RECOVERY_WINDOW`
    seconds of each other count once, with the longest duration. The end of the
    latest recovery counted is kept in the job's status (:data:`RECOVERY_FIELD`), so
    an operator that restarts or takes over never counts a recovery again: the
    agents keep reporting their latest one for as long as they run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kelastic.operator.spec import parse_time
from kelastic.operator.status import Phase

__all__ = [
    "GOODPUT_SECONDS",
    "RECOVERY_BUCKETS",
    "RECOVERY_FIELD",
    "RECREATION_REASONS",
    "SAME_RECOVERY_WINDOW",
    "OperatorMetrics",
    "count_recoveries",
    "new_recoveries",
]

JobKey = tuple[str, str]

#: Action reasons that replace a pod (counted in kelastic_pod_recreations_total).
RECREATION_REASONS = frozenset({"RecreateWorker", "StoreDied", "RecreateEvicted", "ForceDeleted"})
#: Buckets (seconds) of the recovery histogram.
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Recovery reports of one job ending this close together (seconds) are one recovery.
SAME_RECOVERY_WINDOW = 3.0
#: The ElasticJob status field holding when the latest recovery counted ended (RFC 3339, ms).
RECOVERY_FIELD = "lastRecoveryTime"
#: ``kelastic_job_goodput_seconds``'s kinds and the ``status.goodput`` field of each.
GOODPUT_SECONDS = {
    "elapsed": "elapsedSeconds",
    "productive": "productiveSeconds",
    "restart": "restartSeconds",
    "redone": "redoneSeconds",
    "save_stall": "saveStallSeconds",
}


def new_recoveries(
    reports: Iterable[tuple[str, float, float]],
    last_ended: float | None,
    window: float = SAME_RECOVERY_WINDOW,
) -> list[tuple[float, float]]:
    """Group agents' recovery reports ``(node, seconds, ended)`` into recoveries not counted yet (pure).

    A report belongs to an already counted recovery when it ended within ``window``
    seconds of ``last_ended`` or earlier. The others are grouped by ``ended``: reports
    within ``window`` of the group's first one are the same recovery (all members of
    a round report it). Returns ``(seconds, ended)`` per new recovery, oldest first,
    ``seconds`` the longest of its group and ``ended`` the latest.
    """
    fresh = sorted(
        (ended, seconds) for _, seconds, ended in reports if last_ended is None or ended > last_ended + window
    )
    groups: list[tuple[float, float, float]] = []  # (first ended, latest ended, longest seconds)
    for ended, seconds in fresh:
        if groups and ended - groups[-1][0] <= window:
            first, latest, longest = groups[-1]
            groups[-1] = (first, max(latest, ended), max(longest, seconds))
        else:
            groups.append((ended, ended, seconds))
    return [(longest, latest) for _, latest, longest in groups]


def count_recoveries(
    status: Mapping[str, Any], reports: Iterable[tuple[str, float, float]]
) -> tuple[list[float], dict[str, Any]]:
    """The recoveries in ``reports`` that no operator counted yet, and ``status`` recording them (pure).

    ``status`` is the job's status as stored; its :data:`RECOVERY_FIELD` says when
    the latest counted recovery ended. Returns the new recoveries' durations (count
    them once the returned status is written) and the status to write: ``status``
    itself when there is nothing new, else a copy with the field moved forward.
    """
    since = parse_time(status.get(RECOVERY_FIELD))
    fresh = new_recoveries(reports, since.timestamp() if since is not None else None)
    if not fresh:
        return [], dict(status)
    ended = datetime.fromtimestamp(max(end for _, end in fresh), timezone.utc)
    mark = ended.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return [seconds for seconds, _ in fresh], {**status, RECOVERY_FIELD: mark}


class OperatorMetrics:
    """The operator's series in their own registry (so tests and several operators never collide)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("kelastic_jobs", "ElasticJobs by status.phase.", ["phase"], registry=r)
        self.world_size = Gauge(
            "kelastic_job_world_size",
            "Ranks in the job's current rendezvous round.",
            ["namespace", "job"],
            registry=r,
        )
        self.restarts = Gauge(
            "kelastic_job_restarts",
            "Re-forms of the job's worker group, failures and membership changes alike "
            "(status.restarts, the RE-FORMS column).",
            ["namespace", "job"],
            registry=r,
        )
        self.standbys = Gauge(
            "kelastic_job_standbys",
            "Worker pods waiting in the job's rendezvous as hot standbys, without a rank.",
            ["namespace", "job"],
            registry=r,
        )
        self.goodput_ratio = Gauge(
            "kelastic_job_goodput_ratio",
            "Share of the job's time spent on training steps it kept (status.goodput.ratio).",
            ["namespace", "job"],
            registry=r,
        )
        self.goodput_seconds = Gauge(
            "kelastic_job_goodput_seconds",
            "The job's time since its first step, by kind: elapsed, productive, and lost to restarts, "
            "to redone steps and to save stalls (status.goodput).",
            ["namespace", "job", "kind"],
            registry=r,
        )
        self.recreations = Counter(
            "kelastic_pod_recreations", "Pods replaced by the operator, by reason.", ["reason"], registry=r
        )
        self.reconciles = Counter("kelastic_reconcile", "Reconcile passes.", registry=r)
        self.reconcile_seconds = Histogram(
            "kelastic_reconcile_duration_seconds",
            "Duration of one reconcile pass.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.api_errors = Counter(
            "kelastic_api_errors", "Failed Kubernetes API calls, by HTTP status.", ["code"], registry=r
        )
        self.recovery_seconds = Histogram(
            "kelastic_recovery_seconds",
            "From a member lost (or workers failed) to the next rendezvous round closed, as the agents report it.",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._phases: dict[JobKey, str] = {}
        self._servers: list[Any] = []
        for phase in Phase:
            self.jobs.labels(phase.value).set(0)

    # what the controller reports --------------------------------------------------------------
    def job_observed(
        self,
        key: JobKey,
        phase: str | None,
        world_size: int | None = None,
        restarts: int | None = None,
        *,
        standbys: int | None = None,
        goodput: Mapping[str, Any] | None = None,
    ) -> None:
        """A reconcile pass saw ``key`` in ``phase`` (None: no phase yet, counted as Created);
        ``goodput`` is the job's ``status.goodput``."""
        with self._lock:
            self._phases[key] = phase or Phase.CREATED.value
            self._set_phases()
        if world_size is not None:
            self.world_size.labels(*key).set(world_size)
        if restarts is not None:
            self.restarts.labels(*key).set(restarts)
        if standbys is not None:
            self.standbys.labels(*key).set(standbys)
        if goodput:
            if isinstance(goodput.get("ratio"), int | float):
                self.goodput_ratio.labels(*key).set(goodput["ratio"])
            for kind, field in GOODPUT_SECONDS.items():
                if isinstance(goodput.get(field), int | float):
                    self.goodput_seconds.labels(*key, kind).set(goodput[field])

    def job_removed(self, key: JobKey) -> None:
        """The job is gone: drop it from the phase counts and its own series."""
        with self._lock:
            self._phases.pop(key, None)
            self._set_phases()
        for gauge in (self.world_size, self.restarts, self.standbys, self.goodput_ratio):
            try:
                gauge.remove(*key)
            except KeyError:
                pass
        for kind in GOODPUT_SECONDS:
            try:
                self.goodput_seconds.remove(*key, kind)
            except KeyError:
                pass

    def _set_phases(self) -> None:
        counts: dict[str, int] = {p.value: 0 for p in Phase}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.jobs.labels(phase).set(n)

    def reconciled(self, seconds: float) -> None:
        self.reconciles.inc()
        self.reconcile_seconds.observe(seconds)

    def action_applied(self, reason: str) -> None:
        if reason in RECREATION_REASONS:
            self.recreations.labels(reason).inc()

    def api_error(self, status: int) -> None:
        self.api_errors.labels(str(status)).inc()

    def recoveries_counted(self, durations: Iterable[float]) -> None:
        """Observe recoveries that :func:`count_recoveries` found new (once their status is written)."""
        for seconds in durations:
            self.recovery_seconds.observe(seconds)

    def phase_counts(self) -> Mapping[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for phase in self._phases.values():
                counts[phase] = counts.get(phase, 0) + 1
            return counts

    # serving ----------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._servers.append(server)
        return int(server.server_address[1])

    def stop(self) -> None:
        """Stop serving (every server :meth:`serve` started)."""
        while self._servers:
            server = self._servers.pop()
            server.shutdown()
            server.server_close()

"""What the agent serves on ``/metrics``: restarts, rendezvous rounds, recovery and progress.

:class:`AgentTelemetry` is fed from three places and renders Prometheus text
(:mod:`kelastic.agent.exposition`) on demand:

* it is the agent's :class:`~kelastic.agent.events.EventSink` (every event is also
  forwarded to the sink it wraps): ``kelastic.agent.rendezvous`` gives the world
  size and closes a recovery, ``kelastic.agent.restart`` opens one;
* its :attr:`metrics` object is the agent's :class:`~kelastic.agent.metrics.Metrics`:
  restart counters and the rendezvous timings;
* :meth:`sample` takes the ranks' latest progress reports (``progress.update``),
  called about once a second by :meth:`start_sampler`, and at every scrape.

A *recovery* is the time from the agent deciding to restart its workers (a
member was lost or joined, or the workers failed) to the next rendezvous round
closing with this node in it.

Series (all prefixed ``kelastic_agent_``): ``restarts_total{kind}`` (``failure``
spends one of ``--max-restarts``, ``membership`` does not),
``rendezvous_rounds_total``, ``rendezvous_duration_seconds`` (histogram),
``recovery_seconds{cause}`` (histogram), ``world_size``, ``restart_count``,
``step`` (the slowest local rank's last step), ``steps_per_second`` (over the
last ``rate_window`` seconds of samples), ``seconds_since_progress`` (since the
most recent report of any local rank; absent until a rank reports); with the memory
checkpoint (``kelastic.checkpoint``): ``checkpoint_latest`` (the newest complete
checkpoint), ``checkpoint_bytes`` and ``checkpoint_limit_bytes`` (held on this node, and
its limit), ``checkpoint_saves_total``, ``checkpoint_refused_total`` (saves that did not
fit), ``checkpoint_restores_total{source}`` (memory, replica or durable) and
``checkpoint_restore_seconds`` (the latest restore); with the straggler rule
(:mod:`kelastic.agent.straggler_watch`): ``straggler`` (1 while the group's verdict names
this node, else 0), ``straggler_ratio`` (its work per step over the others' median then)
and ``straggler_steps_aside_total`` (times it left its round for a standby); and what kelastic's services turned
away (:data:`kelastic.agent.auth.REFUSALS`): ``refused_total{service,reason}`` (service
``checkpoint``, ``peer_link``, ``health`` or ``store_record``: a rendezvous store record that
failed its MAC; reason ``unauthenticated``, ``bad_frame``,
``bad_request``, ``timeout`` or ``over_capacity``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kelastic.agent.auth import REFUSALS, Reason
from kelastic.agent.events import Event, EventSink, record
from kelastic.agent.exposition import Family, counter, gauge, histogram, render
from kelastic.agent.metrics import Metrics
from kelastic.agent.progress import ProgressReport

__all__ = ["DURATION_BUCKETS", "AgentTelemetry", "ProgressSample", "refusals", "steps_per_second"]

#: Histogram buckets (seconds) for rendezvous and recovery durations: sub-second to minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

_PREFIX = "kelastic_agent_"


@dataclass(frozen=True)
class ProgressSample:
    """The slowest local rank's step at ``time`` (seconds since the epoch)."""

    time: float
    step: int


def refusals() -> dict[tuple[tuple[str, str], ...], float]:
    """:data:`~kelastic.agent.auth.REFUSALS` as labelled samples; the unauthenticated series of
    the checkpoint service and the peer link are always there (0 until one happens)."""
    counts = {("checkpoint", Reason.UNAUTHENTICATED.value): 0, ("peer_link", Reason.UNAUTHENTICATED.value): 0}
    counts.update(REFUSALS.snapshot())
    return {(("service", s), ("reason", r)): float(n) for (s, r), n in sorted(counts.items())}


def steps_per_second(samples: list[ProgressSample]) -> float | None:
    """Steps per second between the first and last sample (pure); None without two samples apart in time.

    A step that went backwards (workers restarted from a checkpoint) starts the
    window again from that sample.
    """
    start = 0
    for i in range(1, len(samples)):
        if samples[i].step < samples[i - 1].step:
            start = i
    window = samples[start:]
    if len(window) < 2 or window[-1].time <= window[0].time:
        return None
    return (window[-1].step - window[0].step) / (window[-1].time - window[0].time)


def _restart_cause(reason: str) -> str:
    """``membership`` when the restart did not spend a restart (a peer left/joined), else ``failure``."""
    return "membership" if ("membership" in reason or "waiting to join" in reason) else "failure"


class AgentTelemetry:
    """Event sink + metrics + progress sampler of one agent; :meth:`render` is the ``/metrics`` body."""

    def __init__(
        self,
        forward: EventSink | None = None,
        *,
        rate_window: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._forward = forward
        self._clock = clock
        self._rate_window = rate_window
        self._lock = threading.Lock()
        self.metrics = Metrics()
        self._world_size: int | None = None
        self._restart_count: int | None = None
        self._recovering_since: tuple[float, str, str] | None = None  # (since, cause, reason)
        self._recoveries: dict[str, list[float]] = {}
        self._last_recovery: tuple[float, float] | None = None
        self._last_failure: tuple[str, float] | None = None
        self._samples: collections.deque[ProgressSample] = collections.deque()
        self._last_report: float | None = None
        self._progress: Callable[[], Mapping[int, ProgressReport]] | None = None
        self._checkpoint: Callable[[], Mapping[str, Any]] | None = None
        self._straggler: Callable[[], Mapping[str, Any] | None] | None = None
        self._straggler_node = ""
        self._steps_aside = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # EventSink --------------------------------------------------------------------------------
    def record(self, event: Event) -> None:
        now = self._clock()
        with self._lock:
            if event.name == "kelastic.agent.straggler":
                self._steps_aside += 1
            elif event.name == "kelastic.agent.restart":
                if self._recovering_since is None:
                    reason = str(event.metadata.get("reason", ""))
                    self._recovering_since = (now, _restart_cause(reason), reason)
            elif event.name == "kelastic.agent.rendezvous":
                world = event.metadata.get("world_size")
                self._world_size = int(world) if isinstance(world, int | float) else self._world_size
                restarts = event.metadata.get("restart_count")
                if isinstance(restarts, int | float):
                    self._restart_count = int(restarts)
                if self._recovering_since is not None:
                    since, cause, reason = self._recovering_since
                    seconds = max(0.0, now - since)
                    self._recoveries.setdefault(cause, []).append(seconds)
                    self._last_recovery = (seconds, now)
                    if cause == "failure":
                        self._last_failure = (reason, now)
                    self._recovering_since = None
        if self._forward is not None:
            record(event, self._forward)

    def recoveries(self) -> dict[str, list[float]]:
        """Recovery durations (seconds) so far, by cause."""
        with self._lock:
            return {k: list(v) for k, v in self._recoveries.items()}

    def last_recovery(self) -> tuple[float, float] | None:
        """The latest recovery as ``(seconds, ended)``, ``ended`` in seconds since the epoch; None before one."""
        with self._lock:
            return self._last_recovery

    def last_failure(self) -> tuple[str, float] | None:
        """The reason of the latest restart a failure caused (``"workers FAILED (rank 1 was
        OOM-killed ...); 2/3 restarts left"``) and when the group re-formed after it (seconds
        since the epoch); None before one."""
        with self._lock:
            return self._last_failure

    # progress ---------------------------------------------------------------------------------
    def sample(self, reports: Mapping[int, ProgressReport]) -> None:
        """Record the ranks' latest reports (the slowest rank's step; the newest report's time)."""
        if not reports:
            return
        now = self._clock()
        step = min(r.step for r in reports.values())
        newest = max(r.time for r in reports.values())
        with self._lock:
            self._last_report = newest if self._last_report is None else max(self._last_report, newest)
            self._samples.append(ProgressSample(now, step))
            while self._samples and self._samples[0].time < now - self._rate_window:
                self._samples.popleft()

    def start_sampler(
        self, progress: Callable[[], Mapping[int, ProgressReport]], period: float = 1.0
    ) -> None:
        """Sample ``progress()`` every ``period`` seconds on a daemon thread until :meth:`stop`."""
        self._progress = progress

        def loop() -> None:
            while not self._stop.wait(period):
                self._sample_now()

        self._thread = threading.Thread(target=loop, name="kelastic-telemetry", daemon=True)
        self._thread.start()

    def _sample_now(self) -> None:
        if self._progress is None:
            return
        try:
            self.sample(self._progress())
        except Exception:  # progress files of a stopping attempt may vanish under us
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # exposition -------------------------------------------------------------------------------
    def families(self) -> list[Family]:
        counters = self.metrics.counters()
        timings = self.metrics.timings()
        rendezvous = timings.get("agent.rendezvous", [])
        with self._lock:
            samples = list(self._samples)
            last_report = self._last_report
            world, restart_count = self._world_size, self._restart_count
            recoveries = {k: list(v) for k, v in self._recoveries.items()}
        rate = steps_per_second(samples)
        since = None if last_report is None else max(0.0, self._clock() - last_report)
        return [
            counter(
                f"{_PREFIX}restarts_total",
                "Restarts of this node's workers; kind=failure spends one of --max-restarts, "
                "kind=membership (a peer left or joined) does not.",
                {
                    (("kind", "failure"),): counters.get("agent.restarts", 0),
                    (("kind", "membership"),): counters.get("agent.membership_restarts", 0),
                },
            ),
            counter(
                f"{_PREFIX}rendezvous_rounds_total",
                "Rendezvous rounds this agent completed.",
                len(rendezvous),
            ),
            histogram(
                f"{_PREFIX}rendezvous_duration_seconds",
                "Time this agent spent in each rendezvous, from joining to the round closing.",
                rendezvous,
                DURATION_BUCKETS,
            ),
            histogram(
                f"{_PREFIX}recovery_seconds",
                "From the decision to restart the workers to the next round closing, by cause.",
                {(("cause", c),): recoveries.get(c, []) for c in ("membership", "failure")},
                DURATION_BUCKETS,
            ),
            gauge(f"{_PREFIX}world_size", "Ranks in the current group (all nodes).", world),
            gauge(
                f"{_PREFIX}restart_count",
                "TORCHELASTIC_RESTART_COUNT of the current workers.",
                restart_count,
            ),
            gauge(
                f"{_PREFIX}step",
                "The slowest local rank's last reported step (progress.update).",
                samples[-1].step if samples else None,
            ),
            gauge(
                f"{_PREFIX}steps_per_second",
                "Training steps per second of the slowest local rank, over the last samples.",
                rate,
            ),
            gauge(
                f"{_PREFIX}seconds_since_progress",
                "Seconds since any local rank last reported progress.",
                since,
            ),
            counter(
                f"{_PREFIX}refused_total",
                "Connections and requests kelastic's services turned away, by service (checkpoint, "
                "peer_link, health, store_record) and reason (unauthenticated, bad_frame, bad_request, timeout, "
                "over_capacity).",
                refusals(),
            ),
        ]

    def watch_checkpoint(self, status: Callable[[], Mapping[str, Any]]) -> None:
        """Report the node's memory checkpoint (``CheckpointKeeper.status``) in ``/metrics``."""
        self._checkpoint = status

    def _checkpoint_families(self) -> list[Family]:
        if self._checkpoint is None:
            return []
        st = self._checkpoint()
        restored = st.get("restored") or {}
        restores = dict(st.get("restores") or {})
        return [
            gauge(
                f"{_PREFIX}checkpoint_latest",
                "The newest complete memory checkpoint this node holds.",
                st.get("latest"),
            ),
            gauge(
                f"{_PREFIX}checkpoint_bytes",
                "Bytes of memory checkpoints held on this node.",
                st.get("bytes"),
            ),
            gauge(
                f"{_PREFIX}checkpoint_limit_bytes", "This node's checkpoint memory limit.", st.get("limit")
            ),
            counter(f"{_PREFIX}checkpoint_saves_total", "Memory checkpoints committed.", st.get("saves", 0)),
            counter(
                f"{_PREFIX}checkpoint_refused_total",
                "Memory checkpoints not saved because they did not fit in this node's limit.",
                st.get("refused", 0),
            ),
            counter(
                f"{_PREFIX}checkpoint_restores_total",
                "Restores reported by this node's ranks, by where the checkpoint came from.",
                {(("source", src),): restores.get(src, 0) for src in ("memory", "replica", "durable")},
            ),
            gauge(
                f"{_PREFIX}checkpoint_restore_seconds",
                "Seconds the latest restore took, from choosing the checkpoint to the last byte read.",
                restored.get("seconds"),
            ),
        ]

    def watch_straggler(self, verdict: Callable[[], Mapping[str, Any] | None], *, node: str) -> None:
        """Report the group's straggler verdict as it concerns ``node`` (this one) in ``/metrics``."""
        self._straggler, self._straggler_node = verdict, node

    def _straggler_families(self) -> list[Family]:
        if self._straggler is None:
            return []
        v = self._straggler() or {}
        named = v.get("node") == self._straggler_node and v.get("action") in ("report", "replace")
        ratio = v.get("ratio") if named and isinstance(v.get("ratio"), int | float) else None
        with self._lock:
            steps_aside = self._steps_aside
        return [
            gauge(
                f"{_PREFIX}straggler",
                "1 while the group's straggler verdict names this node (its steps are consistently slower).",
                1 if named else 0,
            ),
            gauge(
                f"{_PREFIX}straggler_ratio",
                "This node's work per step over the median of the other members', while it is the straggler.",
                ratio,
            ),
            counter(
                f"{_PREFIX}straggler_steps_aside_total",
                "Times this node left its round as a straggler so that a standby took its place.",
                steps_aside,
            ),
        ]

    def render(self) -> str:
        """The ``/metrics`` body (samples progress first, so a scrape sees the latest step)."""
        self._sample_now()
        return render([*self.families(), *self._checkpoint_families(), *self._straggler_families()])

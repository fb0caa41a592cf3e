"""Agent metrics: counters and timings, delivered to a pluggable sink.

A metric is a ``(group, name, value)`` triple: ``group`` is the subsystem
(``"agent"``, ``"workers.<role>"``), ``name`` what is measured. Counters are
incremented with :meth:`Metrics.incr`, gauges set with :meth:`Metrics.put`,
durations measured with :meth:`Metrics.timer` (seconds, as float). Every value
is forwarded to the :class:`MetricSink`; the :class:`Metrics` object also keeps
the running totals so the agent can report them at the end of a run.

Sinks: :class:`NullSink` (default: totals only), :class:`LogSink` (one JSON
line per value on the ``kelastic.agent.metrics`` logger), :class:`MemorySink`.
A failing sink is logged, never raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "LogSink",
    "MemorySink",
    "MetricSink",
    "MetricValue",
    "Metrics",
    "NullSink",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricValue:
    """One emitted value."""

    group: str
    name: str
    value: float
    timestamp: float


@runtime_checkable
class MetricSink(Protocol):
    def emit(self, metric: MetricValue) -> None: ...


class NullSink:
    def emit(self, metric: MetricValue) -> None:
        return None


class LogSink:
    """Logs each value as a JSON line."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.DEBUG) -> None:
        self._logger = logger or _log
        self._level = level

    def emit(self, metric: MetricValue) -> None:
        self._logger.log(
            self._level,
            "%s",
            json.dumps(
                {"group": metric.group, "name": metric.name, "value": metric.value, "ts": metric.timestamp}
            ),
        )


class MemorySink:
    """Keeps every emitted value in ``.values`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: list[MetricValue] = []

    def emit(self, metric: MetricValue) -> None:
        with self._lock:
            self.values.append(metric)


class Metrics:
    """Counters, gauges and timings with running totals.

    ``counters()`` maps ``"group.name"`` to the sum of increments;
    ``gauges()`` to the last value put; ``timings()`` to a list of durations.
    """

    def __init__(self, sink: MetricSink | None = None) -> None:
        self._sink: MetricSink = sink if sink is not None else NullSink()
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._timings: dict[str, list[float]] = {}

    @property
    def sink(self) -> MetricSink:
        return self._sink

    def _emit(self, group: str, name: str, value: float) -> None:
        try:
            self._sink.emit(MetricValue(group, name, float(value), time.time()))
        except Exception:
            _log.exception("metric sink %r failed on %s.%s", self._sink, group, name)

    def incr(self, group: str, name: str, by: float = 1) -> None:
        key = f"{group}.{name}"
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + by
        self._emit(group, name, by)

    def put(self, group: str, name: str, value: float) -> None:
        with self._lock:
            self._gauges[f"{group}.{name}"] = float(value)
        self._emit(group, name, value)

    def observe(self, group: str, name: str, seconds: float) -> None:
        with self._lock:
            self._timings.setdefault(f"{group}.{name}", []).append(float(seconds))
        self._emit(group, name, seconds)

    @contextmanager
    def timer(self, group: str, name: str) -> Iterator[None]:
        """Record the duration of the ``with`` body (also when it raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.observe(group, name, time.monotonic() - start)

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return dict(self._gauges)

    def timings(self) -> dict[str, list[float]]:
        with self._lock:
            return {k: list(v) for k, v in self._timings.items()}

"""Structured agent events: what happened to the agent and its workers, as JSON.

An :class:`Event` is a name, a source (the agent or one worker), a timestamp
and flat metadata. The agent hands every event to an :class:`EventSink`; the
sink decides where it goes. :class:`LogSink` (the default) writes one JSON
object per line to the ``kelastic.agent.events`` logger (at DEBUG level unless
told otherwise), :class:`FileSink`
appends JSON lines to a file, :class:`MemorySink` keeps them for inspection and
:class:`NullSink` drops them. Any object with a ``record(event)`` method is a
sink, so users can forward events to their own systems.

A sink must never break the agent: :func:`record` swallows and logs sink errors.

``kelastic-agent`` writes its events to the file named by ``$KELASTIC_EVENTS_FILE``
(:data:`EVENTS_FILE_ENV`) when set, else to the log (see :func:`default_sink`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "EVENTS_FILE_ENV",
    "Event",
    "EventMetadataValue",
    "EventSink",
    "EventSource",
    "FileSink",
    "LogSink",
    "MemorySink",
    "NullSink",
    "default_sink",
    "record",
]

_log = logging.getLogger(__name__)

EventMetadataValue = str | int | float | bool | None


class EventSource(str, Enum):
    """Who an event is about."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass(frozen=True)
class Event:
    """One structured event; ``to_json``/``from_json`` round-trip exactly."""

    name: str
    source: EventSource
    timestamp: float = field(default_factory=time.time)
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        data["source"] = self.source.value
        return json.dumps(data, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Event:
        data = json.loads(text)
        return Event(
            name=data["name"],
            source=EventSource(data["source"]),
            timestamp=float(data["timestamp"]),
            metadata=dict(data["metadata"]),
        )


@runtime_checkable
class EventSink(Protocol):
    """Where events go. ``record`` should be quick; it runs on the agent's thread."""

    def record(self, event: Event) -> None: ...


class NullSink:
    """Drops every event."""

    def record(self, event: Event) -> None:
        return None


class LogSink:
    """Writes each event as one JSON line to a logger (``kelastic.agent.events``)."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.DEBUG) -> None:
        self._logger = logger or _log
        self._level = level

    def record(self, event: Event) -> None:
        self._logger.log(self._level, "%s", event.to_json())


class FileSink:
    """Appends each event as one JSON line to ``path`` (created with its parents)."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self._path

    def record(self, event: Event) -> None:
        line = event.to_json() + "\n"
        with self._lock, self._path.open("a", encoding="utf-8") as f:
            f.write(line)


class MemorySink:
    """Keeps events in ``.events`` (thread-safe); handy for tests and embedding."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def record(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self.events]


#: Environment variable: append the agent's events as JSON lines to this file.
EVENTS_FILE_ENV = "KELASTIC_EVENTS_FILE"


def default_sink() -> EventSink:
    """:class:`FileSink` on ``$KELASTIC_EVENTS_FILE`` if set, else :class:`LogSink`."""
    path = os.environ.get(EVENTS_FILE_ENV)
    return FileSink(path) if path else LogSink()


def record(event: Event, sink: EventSink | None) -> None:
    """Hand ``event`` to ``sink`` (``None`` = :class:`LogSink`); a failing sink is logged, never raised."""
    target = sink if sink is not None else LogSink()
    try:
        target.record(event)
    except Exception:
        _log.exception("event sink %r failed to record %s", target, event.name)

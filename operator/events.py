"""Kubernetes Events about ElasticJobs, aggregated as kubectl and client-go expect.

A reconcile is level-based: the same cause (a worker failing to be created, a store
that died) may be reported at every pass. Posting a new Event object each time would
flood ``kubectl describe`` and etcd, so :class:`EventRecorder` keeps, per involved
object + type + reason + message, the Event it posted; a repeat patches that object's
``count`` and ``lastTimestamp`` (a JSON merge patch) instead of creating another. This
is what client-go's event correlator does, and it works on every Kubernetes version
(``events.k8s.io`` series are newer and optional).

The memory is bounded (least recently used entries go first) and local: after an
operator restart, or once the API server dropped the Event (its TTL, one hour by
default), the next repeat creates a fresh Event with ``count: 1``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kelastic.operator.kube import ApiError
from kelastic.operator.spec import format_time

__all__ = ["EventRecorder", "event_key"]

log = logging.getLogger(__name__)

#: (namespace, involved uid, type, reason, message): what makes two Events the same.
EventKey = tuple[str, str, str, str, str]

Create = Callable[[str, dict[str, Any]], Awaitable[Mapping[str, Any]]]
Patch = Callable[[str, str, dict[str, Any]], Awaitable[Any]]


def event_key(event: Mapping[str, Any]) -> EventKey:
    obj = event.get("involvedObject") or {}
    return (
        str((event.get("metadata") or {}).get("namespace")),
        str(obj.get("uid") or obj.get("name")),
        str(event.get("type")),
        str(event.get("reason")),
        str(event.get("message")),
    )


@dataclass
class _Posted:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    name: str | None = None
    count: int = 0


class EventRecorder:
    """Post Events through ``create``/``patch`` (API calls); repeats update one object."""

    def __init__(self, create: Create, patch: Patch, *, max_entries: int = 4096) -> None:
        self._create = create
        self._patch = patch
        self._max = max_entries
        self._posted: OrderedDict[EventKey, _Posted] = OrderedDict()
        #: Counters for tests and benchmarks.
        self.stats: dict[str, int] = {"created": 0, "patched": 0}

    async def record(self, event: dict[str, Any]) -> None:
        """Post ``event`` (a v1 Event without a name or timestamps), or count it on the Event already posted.

        Raises :class:`ApiError` when the API refuses; the caller decides (Events are best effort).
        """
        key = event_key(event)
        entry = self._posted.get(key)
        if entry is None:
            entry = self._posted[key] = _Posted()
            while len(self._posted) > self._max:
                self._posted.popitem(last=False)
        else:
            self._posted.move_to_end(key)
        # One post per key at a time: a repeat that arrives while the first create is in
        # flight must patch the object that create makes, not make a second one.
        async with entry.lock:
            now = format_time(datetime.now(timezone.utc))
            if entry.name is not None:
                try:
                    await self._patch(key[0], entry.name, {"count": entry.count + 1, "lastTimestamp": now})
                except ApiError as err:
                    if err.status != 404:
                        raise
                    entry.name = None  # expired on the server: start a new Event
                else:
                    entry.count += 1
                    self.stats["patched"] += 1
                    return
            body = {**event, "metadata": {**(event.get("metadata") or {}), "name": _event_name(event)}}
            body.update(count=1, firstTimestamp=now, lastTimestamp=now)
            created = await self._create(key[0], body)
            entry.name = str((created.get("metadata") or {}).get("name") or body["metadata"]["name"])
            entry.count = 1
            self.stats["created"] += 1


def _event_name(event: Mapping[str, Any]) -> str:
    """``<object name>.<hex nanoseconds>``: unique per post, sortable, like client-go's names."""
    obj = event.get("involvedObject") or {}
    return f"{obj.get('name') or 'kelastic'}.{time.time_ns():x}"

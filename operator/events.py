"""Kubernetes Events about ElasticJobs: built, posted off the pass, aggregated as kubectl expects.

:class:`EventEmitter` is what the controller calls: ``emit(job body, reason,
message)`` builds the v1 Event (:func:`job_event`) and posts it in the background,
so an Event never delays or fails a reconcile pass (Events are best effort).
:func:`combined_message` folds like messages of one pass into one Event (a job of
1,000 pods gets one "creating worker pods" Event, not 1,000).

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
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kelastic.operator.kube import ApiError
from kelastic.operator.spec import API_VERSION, KIND, format_time

__all__ = ["COMPONENT", "EventEmitter", "EventRecorder", "combined_message", "event_key", "job_event"]

#: The Events' source and reporting component.
COMPONENT = "kelastic-operator"

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


def job_event(body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False) -> dict[str, Any]:
    """The v1 Event (no name, no timestamps: :class:`EventRecorder` adds them) about the job ``body``."""
    meta = body.get("metadata") or {}
    return {
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


class EventEmitter:
    """Posts Events about jobs through ``recorder`` in background tasks made by ``spawn``.

    :meth:`emit` returns at once and never raises; a post that fails is logged at
    debug level and dropped.
    """

    def __init__(self, recorder: EventRecorder, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.recorder = recorder
        self._spawn = spawn

    def emit(self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
        """Post an Event about the job ``body`` (in the background)."""
        self._spawn(self._post(job_event(body, reason, message, warning=warning)))

    async def _post(self, event: dict[str, Any]) -> None:
        """Post or count the Event (a repeat of the same cause updates one object)."""
        try:
            await self.recorder.record(event)
        except Exception as exc:  # Events are best effort
            log.debug("could not post Event %s: %s", event.get("reason"), exc)

"""Object storage of the API server: objects, resourceVersion, watch history.

All operations run on the server's event loop thread, so no locking is needed.
Stored objects are treated as immutable: a write stores a new dict and never
mutates one already stored, which lets watch history and in-flight responses
share them safely.

- ``resourceVersion`` is one global counter; every write (create, update,
  delete) takes the next value and appends exactly one event to the history.
- The history keeps the last ``history_size`` events; a watch that asks to
  resume from an older version gets :class:`Gone` (HTTP 410 for the client).
- Watchers are per-watch bounded queues fed synchronously on every write; a
  watcher that falls too far behind is closed (the client re-lists), as a real
  API server does with slow consumers.
- With ``state_dir`` the whole store is persisted as one JSON snapshot, written
  to a temporary file, fsynced and renamed over the previous one (a crash leaves
  either the old or the new snapshot, never a torn file). Snapshots are written
  at most every ``flush_interval`` seconds and on :meth:`Store.flush`.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

__all__ = ["EventType", "Gone", "Store", "WatchEvent", "Watcher"]

Obj = dict[str, Any]
SNAPSHOT_NAME = "apiserver-state.json"


class EventType(str, Enum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


#: One entry of a watch's queue: (event type, object, resourceVersion). The API server also
#: queues its own marker, ("INITIAL_END", {}, rv), after an initial state it sent as events.
WatchItem = tuple[EventType | Literal["INITIAL_END"], Obj, int]


class Gone(Exception):
    """The requested resourceVersion is older than the retained history."""


@dataclass(frozen=True)
class WatchEvent:
    """One write: its resourceVersion, storage key, the new object and the previous one."""

    rv: int
    type: EventType
    key: str
    obj: Obj
    old: Obj | None


@dataclass(eq=False)
class Watcher:
    """A watch's subscription: a filter and a bounded queue of matching events.

    ``match(obj) -> bool`` is the watch's namespace/label/field filter. Events are
    translated as the API does for filtered watches: an object that stops
    matching is delivered as DELETED, one that starts matching as ADDED.
    ``None`` in the queue means the server closed the watch (too slow, or stop).
    """

    key: str
    match: Callable[[Obj], bool]
    maxsize: int = 100_000
    queue: asyncio.Queue[WatchItem | None] = field(default_factory=asyncio.Queue)
    closed: bool = False

    def offer(self, ev: WatchEvent) -> None:
        if self.closed:
            return
        now = self.match(ev.obj)
        if ev.type is EventType.MODIFIED:
            before = ev.old is not None and self.match(ev.old)
            if now and before:
                kind = EventType.MODIFIED
            elif now:
                kind = EventType.ADDED
            elif before:
                kind = EventType.DELETED
            else:
                return
        elif now:
            kind = ev.type
        else:
            return
        if self.queue.qsize() >= self.maxsize:
            self.close()
            return
        self.queue.put_nowait((kind, ev.obj, ev.rv))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


def _owner_uids(obj: Obj) -> set[str]:
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    return {r["uid"] for r in refs if isinstance(r, dict) and r.get("uid")}


class Store:
    """Objects by storage key (``group/plural``), namespace ('' when cluster-scoped) and name."""

    def __init__(
        self,
        history_size: int = 20_000,
        state_dir: Path | None = None,
        flush_interval: float = 1.0,
    ) -> None:
        if history_size < 1:
            raise ValueError(f"history_size must be >= 1, got {history_size}")
        self.rv = 0
        self._objects: dict[str, dict[str, dict[str, Obj]]] = {}
        self._uids: dict[str, tuple[str, str, str]] = {}
        self._dependents: dict[str, set[str]] = {}
        self._history: deque[WatchEvent] = deque(maxlen=history_size)
        # Everything at or below this version has left the history.
        self._compacted_rv = 0
        # Per collection key: the version its history starts at (see open_history).
        self._history_start: dict[str, int] = {}
        self._watchers: dict[str, set[Watcher]] = {}
        self._state_dir = state_dir
        self._flush_interval = flush_interval
        self._dirty = False
        self._flush_handle: asyncio.TimerHandle | None = None
        #: Called after every write, with the event (used by garbage collection).
        self.listeners: list[Callable[[WatchEvent], None]] = []

    # ---- reads -------------------------------------------------------------
    def get(self, key: str, namespace: str, name: str) -> Obj | None:
        return self._objects.get(key, {}).get(namespace, {}).get(name)

    def list(self, key: str, namespace: str | None = None) -> list[Obj]:
        """Objects of ``key`` (in ``namespace`` when given), ordered by namespace then name."""
        spaces = self._objects.get(key, {})
        if namespace is not None:
            names = spaces.get(namespace, {})
            return [names[n] for n in sorted(names)]
        out: list[Obj] = []
        for ns in sorted(spaces):
            names = spaces[ns]
            out.extend(names[n] for n in sorted(names))
        return out

    def count(self, key: str, namespace: str | None = None) -> int:
        spaces = self._objects.get(key, {})
        if namespace is not None:
            return len(spaces.get(namespace, {}))
        return sum(len(v) for v in spaces.values())

    # builtins.list: inside this class, `list` names the method Store.list.
    def keys(self) -> builtins.list[str]:
        return list(self._objects)

    def by_uid(self, uid: str) -> tuple[str, Obj] | None:
        where = self._uids.get(uid)
        if where is None:
            return None
        obj = self.get(*where)
        return (where[0], obj) if obj is not None else None

    def dependents(self, uid: str) -> builtins.list[tuple[str, Obj]]:
        """Objects whose ownerReferences name ``uid``."""
        out = []
        for dep_uid in list(self._dependents.get(uid, ())):
            found = self.by_uid(dep_uid)
            if found is not None:
                out.append(found)
        return out

    # ---- writes ------------------------------------------------------------
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, key: str, obj: Obj, event: EventType) -> Obj:
        """Store ``obj`` (ADDED or MODIFIED) under a new resourceVersion, which is written into it."""
        rv = self.next_rv()
        meta = obj["metadata"]
        meta["resourceVersion"] = str(rv)
        ns = meta.get("namespace", "")
        name = meta["name"]
        names = self._objects.setdefault(key, {}).setdefault(ns, {})
        old = names.get(name)
        names[name] = obj
        uid = meta.get("uid")
        if uid:
            self._uids[uid] = (key, ns, name)
            self._reindex_owners(uid, old, obj)
        self._emit(WatchEvent(rv, event, key, obj, old))
        return obj

    def remove(self, key: str, obj: Obj) -> Obj:
        """Remove ``obj`` for good; the DELETED event carries it with a new resourceVersion."""
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        names = self._objects.get(key, {}).get(ns, {})
        old = names.pop(meta["name"], None)
        if not names:
            self._objects.get(key, {}).pop(ns, None)
        rv = self.next_rv()
        final = dict(obj)
        final["metadata"] = {**meta, "resourceVersion": str(rv)}
        uid = meta.get("uid")
        if uid:
            self._uids.pop(uid, None)
            self._reindex_owners(uid, old, None)
        self._emit(WatchEvent(rv, EventType.DELETED, key, final, old))
        return final

    def drop_key(self, key: str) -> None:
        """Forget every object of ``key`` without events (used when a CRD's storage is torn down)."""
        for obj in [o for names in self._objects.pop(key, {}).values() for o in names.values()]:
            uid = obj["metadata"].get("uid")
            if uid:
                self._uids.pop(uid, None)
                self._reindex_owners(uid, obj, None)

    def _reindex_owners(self, uid: str, old: Obj | None, new: Obj | None) -> None:
        before = _owner_uids(old) if old else set()
        after = _owner_uids(new) if new else set()
        for owner in before - after:
            deps = self._dependents.get(owner)
            if deps is not None:
                deps.discard(uid)
                if not deps:
                    del self._dependents[owner]
        for owner in after - before:
            self._dependents.setdefault(owner, set()).add(uid)

    def _emit(self, ev: WatchEvent) -> None:
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        self._history.append(ev)
        for w in list(self._watchers.get(ev.key, ())):
            w.offer(ev)
        for listener in self.listeners:
            listener(ev)
        self._mark_dirty()

    # ---- watch ---------------------------------------------------------------
    def compact(self) -> None:
        """Drop the whole history: every watch resuming from an older version gets Gone."""
        self._history.clear()
        self._compacted_rv = self.rv

    def open_history(self, key: str) -> None:
        """Start ``key``'s watch history now (a newly served custom resource type).

        As with the real API server, whose watch cache of a custom resource
        begins when its CRD is established, a watch from an older version gets
        :class:`Gone`. Kept across CRD updates; forgotten with :meth:`close_history`.
        """
        self._history_start.setdefault(key, self.rv)

    def close_history(self, key: str) -> None:
        self._history_start.pop(key, None)

    def events_since(self, key: str, rv: int) -> Iterator[WatchEvent]:
        """Events of ``key`` after ``rv``; raises :class:`Gone` if some were compacted away."""
        start = self._history_start.get(key, 0)
        if rv < start:
            raise Gone(f"too old resource version: {rv} ({start})")
        if rv < self._compacted_rv:
            raise Gone(f"too old resource version: {rv} ({self._compacted_rv + 1})")
        hist = self._history
        # Versions in the history are strictly increasing, so bisect over positions.
        start = bisect.bisect_right(_RvView(hist), rv)
        for i in range(start, len(hist)):
            ev = hist[i]
            if ev.key == key:
                yield ev

    def subscribe(self, watcher: Watcher) -> None:
        self._watchers.setdefault(watcher.key, set()).add(watcher)

    def unsubscribe(self, watcher: Watcher) -> None:
        ws = self._watchers.get(watcher.key)
        if ws is not None:
            ws.discard(watcher)

    def close_watchers(self) -> None:
        for ws in self._watchers.values():
            for w in ws:
                w.close()

    def watcher_count(self) -> int:
        return sum(len(ws) for ws in self._watchers.values())

    # ---- persistence -----------------------------------------------------------
    def load(self) -> bool:
        """Load the snapshot from ``state_dir`` if there is one; True if loaded."""
        if self._state_dir is None:
            return False
        path = self._state_dir / SNAPSHOT_NAME
        if not path.exists():
            return False
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"cannot read the API server state {path}: {exc}; move it away to start empty"
            ) from exc
        self.rv = int(data["resourceVersion"])
        self._compacted_rv = self.rv
        for key, objs in data["objects"].items():
            for obj in objs:
                meta = obj["metadata"]
                ns = meta.get("namespace", "")
                self._objects.setdefault(key, {}).setdefault(ns, {})[meta["name"]] = obj
                uid = meta.get("uid")
                if uid:
                    self._uids[uid] = (key, ns, meta["name"])
                    self._reindex_owners(uid, None, obj)
        return True

    def _mark_dirty(self) -> None:
        if self._state_dir is None:
            return
        self._dirty = True
        if self._flush_handle is None:
            loop = asyncio.get_running_loop()
            self._flush_handle = loop.call_later(self._flush_interval, self._timed_flush)

    def _timed_flush(self) -> None:
        self._flush_handle = None
        self.flush()

    def flush(self) -> None:
        """Write the snapshot now if anything changed since the last one."""
        if self._state_dir is None or not self._dirty:
            return
        self._dirty = False
        self._state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "resourceVersion": self.rv,
            "savedAt": time.time(),
            "objects": {key: self.list(key) for key in self._objects},
        }
        path = self._state_dir / SNAPSHOT_NAME
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        with open(tmp, "w") as fh:
            json.dump(data, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self._state_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class _RvView:
    """A sequence view of the history's resourceVersions, for bisect."""

    def __init__(self, hist: deque[WatchEvent]) -> None:
        self._hist = hist

    def __len__(self) -> int:
        return len(self._hist)

    def __getitem__(self, i: int) -> int:
        return self._hist[i].rv

"""Garbage collection of ownerReferences, and namespace termination.

Runs inside the API server process as a listener of the store: reactions are
scheduled on the event loop right after the write that triggers them, like the
controllers of a real control plane (asynchronous, level-based, idempotent).

- Background: when an owner is gone, dependents none of whose owners exist are
  deleted; dependents that still have a live owner only lose the dangling
  reference. A new object whose owners all do not exist is deleted too.
- Foreground: an owner carrying the ``foregroundDeletion`` finalizer has its
  dependents deleted (in foreground too); the finalizer is removed once no
  dependent is left, which lets the owner go.
- Orphan: an owner carrying the ``orphan`` finalizer has its reference removed
  from every dependent, then the finalizer is removed.
- Namespaces being deleted have all their content deleted, then go.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .errors import ApiError
from .patch import clone
from .registry import FINALIZER_FOREGROUND, FINALIZER_ORPHAN, DeleteOptions, Registry
from .storage import EventType, WatchEvent

__all__ = ["GarbageCollector"]

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class GarbageCollector:
    """Reacts to store events (see module docstring). Create once per registry, on the loop thread."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.store = registry.store
        self._loop = asyncio.get_running_loop()
        self.store.listeners.append(self._on_event)

    def _on_event(self, ev: WatchEvent) -> None:
        self._loop.call_soon(self._safe, ev)

    def _safe(self, ev: WatchEvent) -> None:
        try:
            self._process(ev)
        except Exception:  # one bad object must not stop collection of the others
            log.exception(
                "garbage collection failed on %s %s", ev.type.value, ev.obj.get("metadata", {}).get("name")
            )

    def _type_of(self, key: str) -> Any:
        return self.registry.types.by_key(key)

    def _process(self, ev: WatchEvent) -> None:
        meta = ev.obj["metadata"]
        uid = meta.get("uid", "")
        if ev.type is EventType.DELETED:
            for key, dep in self.store.dependents(uid):
                self._collect_dependent(key, dep)
            for ref in meta.get("ownerReferences") or ():
                self._maybe_finish_foreground(ref.get("uid", ""))
            ns = meta.get("namespace")
            if ns:
                self.registry.namespaces.finish(ns)
            return
        current = self.store.get(ev.key, meta.get("namespace", ""), meta["name"])
        if current is None or current["metadata"].get("uid") != uid:
            return
        cm = current["metadata"]
        if ev.type is EventType.ADDED and cm.get("ownerReferences"):
            self._collect_dependent(ev.key, current)
            return
        if not cm.get("deletionTimestamp"):
            return
        finalizers = cm.get("finalizers") or []
        if FINALIZER_ORPHAN in finalizers:
            for key, dep in self.store.dependents(uid):
                self._drop_refs(key, dep, {uid})
            self._remove_finalizer(ev.key, current, FINALIZER_ORPHAN)
        elif FINALIZER_FOREGROUND in finalizers:
            deps = self.store.dependents(uid)
            for key, dep in deps:
                if not dep["metadata"].get("deletionTimestamp"):
                    self._delete(key, dep, "Foreground")
            self._maybe_finish_foreground(uid)
        rt = self._type_of(ev.key)
        if rt is not None and rt.kind == "Namespace" and not rt.crd:
            self._empty_namespace(cm["name"])

    def _collect_dependent(self, key: str, dep: Obj) -> None:
        refs = dep["metadata"].get("ownerReferences") or []
        dead = {r.get("uid") for r in refs if self.store.by_uid(r.get("uid", "")) is None}
        if not dead:
            return
        if len(dead) == len(refs):
            self._delete(key, dep, "Background")
        else:
            self._drop_refs(key, dep, dead)

    def _maybe_finish_foreground(self, owner_uid: str) -> None:
        found = self.store.by_uid(owner_uid)
        if found is None:
            return
        key, owner = found
        if FINALIZER_FOREGROUND not in (owner["metadata"].get("finalizers") or ()):
            return
        blocking = [
            d
            for _, d in self.store.dependents(owner_uid)
            if any(
                r.get("uid") == owner_uid and r.get("blockOwnerDeletion", True)
                for r in d["metadata"].get("ownerReferences") or ()
            )
        ]
        if not blocking:
            self._remove_finalizer(key, owner, FINALIZER_FOREGROUND)

    def _delete(self, key: str, obj: Obj, policy: str) -> None:
        rt = self._type_of(key)
        if rt is None:
            return
        m = obj["metadata"]
        try:
            self.registry.delete(rt, m.get("namespace"), m["name"], DeleteOptions(propagation=policy))
        except ApiError as exc:
            if exc.code != 404:
                log.warning("garbage collector could not delete %s %s: %s", rt.kind, m["name"], exc)

    def _update(self, key: str, new: Obj) -> None:
        rt = self._type_of(key)
        if rt is None:
            return
        m = new["metadata"]
        try:
            self.registry.update(rt, m.get("namespace"), m["name"], self.registry.present(rt, new))
        except ApiError as exc:
            if exc.code not in (404, 409):
                log.warning("garbage collector could not update %s %s: %s", rt.kind, m["name"], exc)

    def _drop_refs(self, key: str, dep: Obj, uids: set[str]) -> None:
        new = clone(dep)
        refs = [r for r in new["metadata"].get("ownerReferences") or () if r.get("uid") not in uids]
        if refs:
            new["metadata"]["ownerReferences"] = refs
        else:
            new["metadata"].pop("ownerReferences", None)
        self._update(key, new)

    def _remove_finalizer(self, key: str, obj: Obj, finalizer: str) -> None:
        new = clone(obj)
        new["metadata"]["finalizers"] = [f for f in new["metadata"].get("finalizers") or () if f != finalizer]
        self._update(key, new)

    def _empty_namespace(self, ns: str) -> None:
        for rt in self.registry.types.all():
            if not rt.namespaced or "delete" not in rt.verbs:
                continue
            if rt.crd and rt.version != rt.storage_version:
                continue
            for obj in self.store.list(rt.key, ns):
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(rt.key, obj, "Background")
        self.registry.namespaces.finish(ns)

"""The disruption controller: keeps each PodDisruptionBudget's ``status`` current.

Runs inside the API server process as a listener of the store, as the garbage collector
does: after a pod or a budget of a namespace changes, every budget of that namespace gets
the figures a real cluster's disruption controller writes (``expectedPods``,
``currentHealthy``, ``desiredHealthy``, ``disruptionsAllowed``, ``observedGeneration`` and
the ``DisruptionAllowed`` condition, reason ``SufficientPods`` or ``InsufficientPods``),
worked out by :func:`~kelastic.localcluster.apiserver.eviction.budget_of`, the rule the
eviction subresource applies. A status that would not change is not written.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .errors import ApiError
from .eviction import budget_of
from .registry import Registry, now_rfc3339
from .storage import WatchEvent

__all__ = ["DisruptionController", "budget_status"]

log = logging.getLogger(__name__)
Obj = dict[str, Any]
KIND = "PodDisruptionBudget"


def budget_status(pdb: Obj, pods: list[Obj], now: str) -> Obj:
    """The status the disruption controller gives ``pdb`` over its namespace's ``pods`` (the
    condition's transition time kept from the current status while it does not flip)."""
    budget = budget_of(pdb, pods)
    allowed = budget.disruptions_allowed
    generation = pdb["metadata"].get("generation", 1)
    current = pdb.get("status") or {}
    flag = "True" if allowed > 0 else "False"
    before: Obj = next(
        (c for c in current.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), {}
    )
    condition = {
        "type": "DisruptionAllowed",
        "status": flag,
        "reason": "SufficientPods" if allowed > 0 else "InsufficientPods",
        "message": "",
        "observedGeneration": generation,
        "lastTransitionTime": before.get("lastTransitionTime") if before.get("status") == flag else now,
    }
    status: Obj = {
        "observedGeneration": generation,
        "disruptionsAllowed": allowed,
        "currentHealthy": budget.current_healthy,
        "desiredHealthy": budget.desired_healthy,
        "expectedPods": budget.expected_pods,
        "conditions": [condition],
    }
    if current.get("disruptedPods"):
        status["disruptedPods"] = current["disruptedPods"]
    return status


class DisruptionController:
    """Reacts to pod and budget events (see the module docstring). Create once per registry,
    on the loop thread."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.store = registry.store
        self._loop = asyncio.get_running_loop()
        self._dirty: set[str] = set()
        self.store.listeners.append(self._on_event)

    def _on_event(self, ev: WatchEvent) -> None:
        rt = self.registry.types.by_key(ev.key)
        if rt is None or rt.crd or rt.kind not in ("Pod", KIND):
            return
        ns = ev.obj["metadata"].get("namespace", "")
        if ns and ns not in self._dirty:
            self._dirty.add(ns)
            self._loop.call_soon(self._sync, ns)

    def _sync(self, ns: str) -> None:
        self._dirty.discard(ns)
        pdb_type = self.registry.types.by_group_kind("policy", KIND)
        pod_type = self.registry.types.lookup("", "v1", "pods")
        if pdb_type is None or pod_type is None:
            return
        budgets = self.store.list(pdb_type.key, ns)
        if not budgets:
            return
        pods = self.store.list(pod_type.key, ns)
        for pdb in budgets:
            status = budget_status(pdb, pods, now_rfc3339())
            if status == pdb.get("status"):
                continue
            try:
                self.registry.update(
                    pdb_type, ns, pdb["metadata"]["name"], {**pdb, "status": status}, subresource="status"
                )
            except ApiError as exc:  # gone or changed meanwhile: the next event brings it back
                log.debug("could not write the status of budget %s/%s: %s", ns, pdb["metadata"]["name"], exc)

"""Helpers of the reconcile tests (test_op_reconcile*.py, and the executor's gates in
test_op_netpol.py and test_op_podgroup.py), loaded with runpy: conftest modules cannot be
imported by name.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kelastic.operator.executor import ActionExecutor
from kelastic.operator.jobcache import JobCache
from kelastic.operator.metrics import OperatorMetrics
from kelastic.operator.reconcile import CreatePod, Decision, DeletePod, ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job

CONFIG = ReconcileConfig(min_replicas_timeout=60.0, success_grace=10.0)


AGENT_REPORT = """
[default] worker group failed
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_19:52:28
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : 2 (pid: 28911)
  error_file: /tmp/x/error.json
  traceback : ValueError: bad batch
============================================================
"""


def run(body: dict[str, Any], obs: Any, config: ReconcileConfig = CONFIG) -> Decision:
    return reconcile(parse_job(body), obs, config)


def kinds(decision: Decision, kind: type) -> list[Any]:
    return [a for a in decision.actions if isinstance(a, kind)]


def created_names(decision: Decision) -> list[str]:
    return [a.manifest["metadata"]["name"] for a in kinds(decision, CreatePod)]


def deleted_names(decision: Decision) -> list[str]:
    return [a.name for a in kinds(decision, DeletePod)]


def cond(decision: Decision, kind: str) -> dict[str, Any] | None:
    for c in decision.status.get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def apply_decision(
    kube: Any, job: Any, body: dict[str, Any], decision: Decision, executor: Any = None
) -> tuple[Any, list[tuple[str, str]]]:
    """One pass of a real ActionExecutor over ``decision`` against ``kube`` (a new executor, or
    ``executor`` again for a later pass); the executor and the (reason, message) of each Event
    it posted in this pass."""
    posted: list[tuple[str, str]] = []

    class Events:
        def emit(self, body: Any, reason: str, message: str, *, warning: bool = False) -> None:
            posted.append((reason, message))

    async def io(fn: Any, *args: Any) -> Any:
        return fn(*args)

    if executor is None:
        executor = ActionExecutor(
            kube, io, Events(), OperatorMetrics(), JobCache(), lambda key, action: None, lambda uid: "0" * 64
        )
    executor.events = Events()
    asyncio.run(executor.apply(job, body, decision, [], []))
    return executor, posted

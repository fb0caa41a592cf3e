"""Helpers of the reconcile table tests (test_op_reconcile*.py), loaded with runpy: conftest
modules cannot be imported by name.
"""

from __future__ import annotations

from typing import Any

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

"""End-to-end: a worker that always crashes fails the job, and the reason says why.

Scenario (d) of the operator issue. See conftest.py for the cluster these run on.
One job is run for the whole module; each test checks one property of its end.

The Failed reason quotes the earliest failed worker pod and its container's
termination message, where the agent wrote its root cause: the failed rank and
its exit code.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow

JOB = "e2e-d"


@pytest.fixture(scope="module")
def crashed(cluster: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The job run to its end: ``(cluster, final status)``; diagnostics are printed if it never fails."""
    # --steps 0 makes examples/train.py exit 2 on every start: a permanent error (1-127).
    manifest = cluster.job_manifest(
        JOB, replicas=2, args=["--steps=0"], spec={"maxRestarts": 1, "backoffLimit": 1}
    )
    cluster.jobs_seen.add(JOB)
    cluster.apply_job(manifest)
    try:
        status = cluster.wait_phase(JOB, {"Failed", "Succeeded"}, timeout=180)
    except AssertionError:
        print(cluster.dump())
        raise
    yield cluster, status
    cluster.delete_job(JOB)


def failed_message(status: dict[str, Any]) -> str:
    failed = [c for c in status.get("conditions") or [] if c["type"] == "Failed" and c["status"] == "True"]
    assert failed, f"no Failed condition: {status}"
    return str(failed[0].get("message", ""))


@pytest.mark.lanes("emulator")
def test_d_always_crashing_worker_fails_the_job_with_an_event(crashed: tuple[Any, dict[str, Any]]) -> None:
    cluster, status = crashed
    assert status["phase"] == "Failed", status
    message = failed_message(status)
    assert re.search(rf"{JOB}-worker-\d+", message), (
        f"the reason should name the failed worker pod: {message!r}"
    )
    assert re.search(r"\bexit(ed)?( with)?\s*code\s*[:=]?\s*[1-9]", message, re.IGNORECASE), message
    warnings = [e for e in cluster.job_events(JOB) if e.get("type") == "Warning"]
    assert warnings, "a Warning Event should report the failure"


@pytest.mark.lanes("emulator")
def test_d_failed_reason_names_the_rank_and_its_exit_code(crashed: tuple[Any, dict[str, Any]]) -> None:
    cluster, status = crashed
    message = failed_message(status)
    # e.g. "... rank 0 (local rank 0, node e2e-d-worker-0) exited with code 2"
    assert re.search(r"\brank \d+ \(local rank \d+, node \S+\) exited with code 2\b", message), (
        f"the reason should name the failing rank and its exit code (2): {message!r}"
    )
    warnings = [e for e in cluster.job_events(JOB) if e.get("type") == "Warning"]
    assert any("exited with code 2" in str(e.get("message")) for e in warnings), warnings

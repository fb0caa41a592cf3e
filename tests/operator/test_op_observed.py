"""The observed views (operator/observed.py): a pod's exit code, termination message and the
failure's gist.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import PodPhase, failure_summary, pod_view

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_pod_view_reads_exit_code_and_message() -> None:
    body = {
        "metadata": {
            "name": "demo-worker-1",
            "uid": "u1",
            "labels": {"kelastic.dev/role": "worker", "kelastic.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "uid-demo", "controller": True}],
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"containers": [{"name": "trainer"}, {"name": "side"}]},
        "status": {
            "phase": "Failed",
            "podIP": "127.1.0.9",
            "containerStatuses": [
                {"name": "side", "state": {"terminated": {"exitCode": 0}}},
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "OOMKilled",
                            "message": "bye",
                            "finishedAt": "2026-01-01T00:00:05Z",
                        }
                    },
                },
            ],
        },
    }
    view = pod_view(body)
    assert (view.index, view.phase, view.exit_code, view.reason, view.message) == (
        1,
        PodPhase.FAILED,
        137,
        "OOMKilled",
        "bye",
    )
    assert view.terminating and view.owner_uid == "uid-demo" and view.pod_ip == "127.1.0.9"
    assert view.finished_at is not None and view.finished_at.second == 5


def test_failure_summary() -> None:
    assert (
        failure_summary(harness.AGENT_REPORT)
        == "rank 3 (local_rank: 1) exitcode 2 (pid: 28911): ValueError: bad batch"
    )
    plain = harness.AGENT_REPORT.replace(
        "  traceback : ValueError: bad batch", "  traceback : Process 28911 exited with code 2"
    )
    assert failure_summary(plain) == "rank 3 (local_rank: 1) exitcode 2 (pid: 28911)"
    pointer = harness.AGENT_REPORT.replace(
        "  traceback : ValueError: bad batch",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    )
    assert failure_summary(pointer) == "rank 3 (local_rank: 1) exitcode 2 (pid: 28911)"
    assert failure_summary("a\n\nb\nc\nd\n") == "b | c | d"
    assert failure_summary("") is None and failure_summary(None) is None

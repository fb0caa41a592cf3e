"""The torchrun-style failure summary: root cause first, signals named, tracebacks shown."""

from __future__ import annotations

import json
from pathlib import Path

from kelastic.agent.multiprocessing import ProcessFailure
from kelastic.agent.summary import describe_exit, format_failure_summary, root_cause_rank


def test_root_cause_is_the_earliest_failure(tmp_path: Path) -> None:
    err = tmp_path / "error.json"
    err.write_text(
        json.dumps(
            {
                "message": "ValueError: bad batch",
                "traceback": "Traceback...\nValueError: bad batch",
                "timestamp": 100.0,
            }
        )
    )
    failures = {
        5: ProcessFailure(local_rank=1, pid=42, exitcode=1, error_file=str(err)),
        2: ProcessFailure(local_rank=0, pid=41, exitcode=-15, error_file="", timestamp=200.0),
    }
    assert root_cause_rank(failures) == 5
    text = format_failure_summary("train.py", failures, "node-a")
    root = text.split("Root Cause (first observed failure):")[1]
    assert "rank      : 5 (local_rank: 1)" in root
    assert "exitcode  : 1 (pid: 42)" in root
    assert "host      : node-a" in root
    assert "ValueError: bad batch" in root
    assert str(err) in root
    other = text.split("Root Cause")[0]
    assert "-15 (SIGTERM)" in other and "rank      : 2 (local_rank: 0)" in other
    assert text.splitlines()[1] == "train.py FAILED"


def test_single_failure_and_exit_descriptions() -> None:
    text = format_failure_summary("x", {0: ProcessFailure(0, 7, -9, "", timestamp=1.0)}, "h")
    assert "<NO_OTHER_FAILURES>" in text
    assert "-9 (SIGKILL)" in text
    assert describe_exit(3) == "3"

"""kelastic-agent as a single-node command: restarts, the failure summary, signals, health, interop."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # real agents and workers; each takes several seconds

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    c = harness.Cluster(tmp_path)
    yield c
    c.close()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("start", [[], ["--warm-start"]], ids=["python", "warm-start"])
def test_crashed_worker_is_restarted(node: Any, start: list[str]) -> None:
    agent = node.start(
        "solo",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", *start],
        ["--crash-rank", "1", "--crash-times", "1", "--steps", "1"],
        rendezvous=False,
    )
    assert agent.wait(60) == 0, agent.output()
    records = node.records()
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"1"}
    assert len(records) == 2
    run_dirs = list((node.logs / "solo").iterdir())
    assert len(run_dirs) == 1
    err = json.loads((run_dirs[0] / "attempt_0" / "1" / "error.json").read_text())
    assert "planned crash of rank 1 at restart 0" in err["message"]["message"]  # torch's layout


def test_exhausted_restarts_fail_with_the_summary(node: Any) -> None:
    # torch's c10d rendezvous backend, unchanged, drives the same agent
    agent = node.start(
        "solo",
        [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
        ],
        ["--crash-rank", "1"],
        rendezvous=False,
    )
    assert agent.wait(60) == 1
    out = agent.output()
    assert "check_worker.py FAILED" in out
    root = out.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : 1" in root
    assert "ValueError: planned crash of rank 1 at restart 1" in root
    assert "error.json" in root


def test_signal_stops_workers_with_it_and_health_endpoints(node: Any) -> None:
    agent = node.start(
        "solo",
        ["--standalone", "--nproc-per-node", "2", "--health-port", "0"],
        ["--steps", "100000", "--step-time", "0.05", "--note-signals"],
        rendezvous=False,
    )
    node.wait_for("both workers running", lambda: len(node.records()) == 2, 60)
    port = int(re.search(r"serving /healthz.* on port (\d+)", agent.output()).group(1))  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    node.wait_for("/readyz 200", lambda: _status(base + "/readyz") == 200, 10)
    assert _status(base + "/healthz") == 200
    pids = [r["pid"] for r in node.records()]
    agent.proc.send_signal(signal.SIGHUP)
    assert agent.wait(30) == 128 + signal.SIGHUP
    notes = sorted(p.read_text() for p in node.out.glob("signal_rank*.txt"))
    assert notes == ["SIGHUP", "SIGHUP"]
    deadline = time.monotonic() + 5
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_alive(p) for p in pids)


def test_logs_tee_filter_and_events_file(node: Any) -> None:
    events = node.tmp / "events.jsonl"
    agent = node.start(
        "solo",
        ["--standalone", "--warm-start", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "0"],
        ["--steps", "2"],
        rendezvous=False,
        env={"KELASTIC_EVENTS_FILE": str(events)},
    )
    assert agent.wait(60) == 0, agent.output()
    out = agent.output()
    assert "[default0]:" in out and "[default1]:" not in out  # rank 1 is filtered from the console
    (run_dir,) = (node.logs / "solo").iterdir()
    for rank in ("0", "1"):  # ...but both ranks' streams are in their log files
        assert (run_dir / "attempt_0" / rank / "stdout.log").exists()
        assert (run_dir / "attempt_0" / rank / "stderr.log").exists()
    names = [json.loads(line)["name"] for line in events.read_text().splitlines()]
    assert names[:4] == [
        "kelastic.agent.started",
        "kelastic.agent.torch_imported",
        "kelastic.agent.warm_ready",
        "kelastic.agent.rendezvous",
    ]
    assert names.count("kelastic.worker.SUCCEEDED") == 2 and names[-1] == "kelastic.agent.succeeded"


def test_static_backend_runs_unchanged(node: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = node.start(
        "solo",
        ["--rdzv-backend", "static", "--master-port", str(port), "--nproc-per-node", "2", "--warm-start"],
        ["--steps", "1"],
        rendezvous=False,
    )
    assert agent.wait(60) == 0, agent.output()
    records = node.records(2)
    assert {r["env"]["MASTER_PORT"] for r in records} == {str(port)}
    assert {r["env"]["GROUP_WORLD_SIZE"] for r in records} == {"1"}


def test_an_agent_without_log_dir_leaves_no_directory_behind(tmp_path: Path) -> None:
    """The progress files the workers write are the agent's scratch: a run without --log-dir
    removes them and the temporary directory that held them."""
    import subprocess
    import sys

    script = tmp_path / "work.py"
    script.write_text("from kelastic.agent import progress\nprogress.update(1, 1)\nprogress.flush()\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # LOGLEVEL=DEBUG: the agent names its log folder at DEBUG (a path is a detail at INFO).
    env = {**os.environ, "TMPDIR": str(scratch), "LOGLEVEL": "DEBUG"}
    cmd = [sys.executable, "-m", "kelastic.agent", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "logs=" + str(scratch) in done.stdout + done.stderr  # it did use the temporary directory
    assert not list(scratch.iterdir()), sorted(scratch.rglob("*"))

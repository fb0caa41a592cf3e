"""Hang detection: the verdict (pure), and real agents whose workers block in a collective."""

from __future__ import annotations

import runpy
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.agent.hang import judge
from kelastic.agent.progress import ProgressReport
from kelastic.agent.rendezvous import control
from kelastic.agent.rendezvous.server import ServerProcess

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "hang_worker.py"


def test_verdict_needs_every_reporting_rank_stale_and_ignores_silent_ranks() -> None:
    now = 1000.0
    assert judge({}, now=now, timeout=10) is None  # nobody reported: nobody is judged
    fresh = {0: ProgressReport(5, None, time=now - 20), 1: ProgressReport(9, None, time=now - 3)}
    assert judge(fresh, now=now, timeout=10) is None  # rank 1 still moves
    stale = {0: ProgressReport(5, None, time=now - 20), 1: ProgressReport(9, None, time=now - 12)}
    verdict = judge(stale, now=now, timeout=10)
    assert verdict is not None and verdict.local_ranks == (0, 1) and verdict.seconds == pytest.approx(12)
    assert (
        verdict.describe({0: 4, 1: 5}, 10) == "rank(s) 4, 5 reported no progress for 12s (hang timeout 10s)"
    )
    assert judge(stale, now=now, timeout=0) is None


@pytest.mark.slow
def test_workers_blocked_in_a_collective_are_restarted_and_the_store_names_the_ranks(
    tmp_path: Path, server: ServerProcess, run_id: str
) -> None:
    cluster = harness.Cluster(tmp_path, server.endpoint, run_id=run_id)
    agent_args = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "1", "--hang-timeout", "4"]
    try:
        agents = [cluster.start(name, agent_args, script=SCRIPT) for name in ("a", "b")]
        started = time.monotonic()
        assert cluster.wait_all(240) == [0, 0]
        took = time.monotonic() - started
        out = cluster.out
        # the second attempt of both ranks finished; the first never did
        assert sorted(p.name for p in out.glob("done_*")) == ["done_r1_rank0", "done_r1_rank1"]
        logs = "\n".join(a.output() for a in agents)
        assert "reported no progress for" in logs and "hang timeout 4s" in logs
        status = control.read_status(control.connect(server.endpoint), run_id)
        assert status.restarts == 1  # the hang spent one of --max-restarts
        assert status.hangs, "the agents published their verdicts"
        assert {r for h in status.hangs for r in h.ranks} <= {0, 1}
        assert all(h.seconds >= 4 for h in status.hangs)
        print(f"hang detected and recovered; the whole run took {took:.1f}s")
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_worker_that_never_reports_progress_is_never_judged(
    tmp_path: Path, server: ServerProcess, run_id: str
) -> None:
    cluster = harness.Cluster(tmp_path, server.endpoint, run_id=run_id)
    try:
        agent = cluster.start(
            "solo",
            ["--nnodes", "1:1", "--nproc-per-node", "1", "--max-restarts", "1", "--hang-timeout", "1"],
            ["--no-progress", "--hang-at", "-1", "--sleep", "4", "--steps", "2"],
            script=SCRIPT,
        )
        assert agent.wait(60) == 0
        assert "reported no progress" not in agent.output()
    finally:
        cluster.close()

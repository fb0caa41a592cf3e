"""A node's goodput record (agent/goodput.py) from its ranks' progress reports, and what the
workers put in those reports for it (progress.update's first step, progress.stalled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kelastic.agent import contract, progress
from kelastic.agent.goodput import GoodputLedger, Point, node_first, node_point
from kelastic.agent.progress import ProgressReport

T = 1_800_000_000.0


def rank(step: int, at: float, stall: float = 0.0, first: tuple[int, float] | None = None) -> ProgressReport:
    return ProgressReport(step=step, total=None, time=T + at, stall=stall, first=first)


def test_the_node_is_its_slowest_rank() -> None:
    reports = {0: rank(12, 12.0, stall=0.1), 1: rank(11, 11.5, stall=0.3), 2: rank(11, 11.4)}
    assert node_point(reports) == Point(11, T + 11.5, 0.3)
    assert node_point({}) is None
    firsts = {0: rank(3, 3.0, first=(1, T + 1.02)), 1: rank(3, 3.0, first=(1, T + 1.05)), 2: rank(3, 3.0)}
    assert node_first(firsts) == (1, T + 1.05)


def test_the_step_time_leaves_save_stalls_and_restarts_out() -> None:
    ledger = GoodputLedger(started=T)
    # One step a second; every 5th interval holds a 0.5 s save; each observation one step later.
    at, stall = 0.0, 0.0
    for step in range(1, 21):
        at += 1.0
        if step % 5 == 0:
            at += 0.5
            stall += 0.5
        ledger.observe({0: rank(step, at, stall)})
    assert ledger.step_seconds == pytest.approx(1.0)
    assert ledger.stall == pytest.approx(2.0)
    # A restart: the gap to the new attempt's first report is no step interval.
    ledger.restarted({0: rank(20, at, stall)})
    ledger.observe({0: rank(17, at + 30.0, 0.0, first=(17, T + at + 30.0))})
    assert ledger.step_seconds == pytest.approx(1.0)


def test_a_restart_is_recorded_from_the_last_step_before_to_the_first_after() -> None:
    ledger = GoodputLedger(started=T)
    ledger.observe({0: rank(49, 49.0), 1: rank(50, 50.0)})
    # The ended attempt's files as they were left: rank 0 reached step 50 too.
    ledger.restarted({0: rank(50, 50.1, stall=0.2), 1: rank(50, 50.0)})
    assert ledger.record()["resumes"] == []  # not yet: the new workers have not stepped
    ledger.observe({0: rank(47, 57.0, first=(46, T + 56.0)), 1: rank(47, 57.0, first=(46, T + 56.1))})
    record = ledger.record()
    assert record["resumes"] == [[50, T + 50.1, 46, T + 56.1]]
    assert (record["step"], record["step_time"], record["stall"]) == (47, T + 57.0, 0.2)
    assert json.loads(json.dumps(record)) == record


def test_restarts_before_the_group_stepped_again_are_one_stop() -> None:
    ledger = GoodputLedger(started=T)
    ledger.observe({0: rank(30, 30.0)})
    ledger.restarted({0: rank(30, 30.0)})
    ledger.restarted({})  # the next attempt failed before any step
    ledger.observe({0: rank(26, 40.0, first=(26, T + 40.0))})
    assert ledger.record()["resumes"] == [[30, T + 30.0, 26, T + 40.0]]


def test_a_node_that_joined_a_running_job_has_no_restart_to_tell() -> None:
    ledger = GoodputLedger(started=T)
    ledger.observe({0: rank(46, 56.0, first=(46, T + 56.0))})
    assert ledger.record()["resumes"] == []


def test_update_records_the_first_step_and_stalled_adds_to_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "0" / "progress.json"
    monkeypatch.setenv(contract.ENV_PROGRESS_FILE, str(path))
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    progress.update(7)
    progress.stalled(0.25)
    progress.stalled(-1.0)  # nonsense is ignored
    progress.update(8)
    progress.flush()
    got = progress.read_report(path)
    assert got is not None and got.step == 8 and got.stall == pytest.approx(0.25)
    assert got.first is not None and got.first[0] == 7


def test_the_work_per_step_leaves_the_waits_on_peers_out_and_restarts_clear_it() -> None:
    ledger = GoodputLedger(started=T)
    assert ledger.work_seconds is None and ledger.record()["work_seconds"] is None
    # 1 s steps of which 0.7 s waiting on a slower peer (the least waiting of the two ranks counts)
    for step in range(1, 6):
        ledger.observe(
            {
                0: ProgressReport(step=step, total=None, time=T + step, wait=0.7 * step),
                1: ProgressReport(step=step, total=None, time=T + step, wait=0.8 * step),
            }
        )
    assert ledger.work_seconds == pytest.approx(0.3) and ledger.step_seconds == pytest.approx(1.0)
    ledger.restarted({})
    assert ledger.work_seconds is None


def test_waiting_adds_to_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress.json"
    monkeypatch.setenv(contract.ENV_PROGRESS_FILE, str(path))
    before = progress._reporter.wait
    with progress.waiting():
        pass
    progress.waited(0.25)
    progress.update(7, 7)
    report = progress.read_report(path)
    assert report is not None and report.wait >= before + 0.25

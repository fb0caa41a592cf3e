"""Table tests of the job's goodput in its status (operator/goodput.py), from agents' records."""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.operator.goodput import STALE_AFTER, GoodputReport, Resume, goodput_status, report

T = 1_800_000_000.0  # an epoch instant


def rep(node: str = "a", step: int | None = 10, at: float = 0.0, **kw: Any) -> GoodputReport:
    """A record made when its step was reached (``time`` = ``step_time``) unless ``time`` says."""
    reached = T + at if step is not None else None
    base: dict[str, Any] = dict(step_time=reached, time=reached, step_seconds=1.0, started=T - 60)
    base.update(kw)
    return GoodputReport(node=node, step=step, **base)


def test_nothing_reported_is_no_goodput() -> None:
    assert goodput_status(None, [], T) is None
    assert goodput_status(None, [rep(step=None)], T) is None


def test_the_accounting_starts_at_the_slowest_members_first_step() -> None:
    g = goodput_status(None, [rep("a", 12, 2.0), rep("b", 10, 0.0, time=T + 3.0)], T + 3.5)
    assert g is not None
    assert (g["firstStep"], g["highStep"], g["keptSteps"]) == (10, 10, 0)
    assert g["since"] == "2027-01-15T08:00:00.000Z"
    assert g["elapsedSeconds"] == 3.0 and g["stepSeconds"] == 1.0
    assert "ratio" not in g  # no step kept yet


def test_steady_steps_are_all_productive_and_time_without_steps_is_not() -> None:
    g = goodput_status(None, [rep(step=10, at=0.0)], T)
    g = goodput_status(g, [rep(step=40, at=30.0)], T + 30.0)
    assert g is not None and (g["keptSteps"], g["productiveSeconds"], g["ratio"], g["percent"]) == (
        30,
        30.0,
        1.0,
        "100.0%",
    )
    # Ten seconds without a step, the agent still reporting: the ratio falls as time goes on.
    g = goodput_status(g, [rep(step=40, at=30.0, time=T + 40.0)], T + 41.0)
    assert g is not None and g["ratio"] == 0.75 and g["percent"] == "75.0%"
    # Nobody reports any more (a restart under way, a hung job): the clock runs on, STALE_AFTER behind.
    g = goodput_status(g, [rep(step=40, at=30.0, time=T + 40.0)], T + 40.0 + STALE_AFTER + 20.0)
    assert g is not None and g["elapsedSeconds"] == 60.0 and g["ratio"] == 0.5


def test_a_restart_reported_by_every_member_is_counted_once_and_steps_redone_count_once() -> None:
    g = goodput_status(None, [rep("a", 10), rep("b", 10)], T)
    # Stopped after step 50 at +40; restored step 45; first step 46 at +46 (a 5 s gap beside its own step).
    seen = (Resume(50, T + 40.0, 46, T + 46.0),)
    also = (Resume(50, T + 40.02, 46, T + 46.05),)
    reports = [rep("a", 48, 48.0, resumes=seen), rep("b", 48, 48.0, resumes=also)]
    g = goodput_status(g, reports, T + 48.0)
    assert g is not None
    assert (g["restarts"], g["restartSeconds"], g["redoneSteps"], g["redoneSeconds"]) == (1, 5.0, 5, 5.0)
    # The high-water mark stays at 50 while the redone steps 46..50 are done again.
    assert g["highStep"] == 50 and g["keptSteps"] == 40
    # Read again (the agents keep reporting their latest restarts): nothing new.
    again = goodput_status(g, reports, T + 49.0)
    assert again is not None and (again["restarts"], again["redoneSteps"]) == (1, 5)
    # A later restart is new.
    later = (*seen, Resume(70, T + 80.0, 71, T + 82.0))
    g = goodput_status(again, [rep("a", 72, 83.0, resumes=later)], T + 83.0)
    assert g is not None and (g["restarts"], g["restartSeconds"], g["redoneSteps"]) == (2, 6.0, 5)


def test_restarts_before_the_accounting_began_are_not_counted() -> None:
    old = (Resume(5, T - 20.0, 3, T - 15.0),)
    g = goodput_status(None, [rep(resumes=old)], T)
    assert g is not None and (g["restarts"], g["restartSeconds"], g["redoneSteps"]) == (0, 0.0, 0)


def test_save_stalls_are_counted_once_per_node_and_agent() -> None:
    g = goodput_status(None, [rep("a", stall=4.0), rep("b", stall=0.0)], T)
    assert g is not None and g["saveStallSeconds"] == 0.0  # before the accounting began
    g = goodput_status(g, [rep("a", 20, 10.0, stall=4.5), rep("b", 20, 10.0, stall=0.0)], T + 10)
    assert g is not None and g["saveStallSeconds"] == 0.5
    # "a" out of the reports for a while (a re-form), back with the same agent: nothing recounted.
    g = goodput_status(g, [rep("b", 21, 11.0)], T + 11)
    g = goodput_status(g, [rep("a", 30, 20.0, stall=4.75), rep("b", 30, 20.0)], T + 20)
    assert g is not None and g["saveStallSeconds"] == 0.75
    # "a" replaced by a new agent (a recreated pod of the same name): all its stall is new.
    g = goodput_status(g, [rep("a", 31, 21.0, stall=0.25, started=T + 20.5), rep("b", 31, 21.0)], T + 21)
    assert g is not None and g["saveStallSeconds"] == 1.0


def test_every_time_in_the_goodput_status_is_rfc3339() -> None:
    """kubectl describe shows the status as stored: times as RFC 3339, never epoch seconds."""
    g = goodput_status(None, [rep("a", 10, 0.0, stall=1.0, started=T - 0.25), rep("b", started=None)], T)
    assert g is not None
    assert g["nodes"] == {"a": {"started": "2027-01-15T07:59:59.750Z", "stall": 1.0}, "b": {"stall": 0.0}}
    assert (g["since"], g["lastResume"]) == ("2027-01-15T08:00:00.000Z", "2027-01-15T08:00:00.000Z")


def test_a_status_an_earlier_operator_wrote_in_epoch_seconds_is_read_and_rewritten() -> None:
    g = goodput_status(None, [rep("a", 10, 0.0, stall=1.0)], T)
    assert g is not None
    g["nodes"] = {"a": {"started": T - 60, "stall": 1.0}, "gone": {"started": T - 90, "stall": 2.0}}
    g = goodput_status(g, [rep("a", 20, 10.0, stall=1.5)], T + 10)
    assert g is not None and g["saveStallSeconds"] == 0.5  # the same agent: only its new stall
    assert g["nodes"] == {
        "a": {"started": "2027-01-15T07:59:00.000Z", "stall": 1.5},
        "gone": {"started": "2027-01-15T07:58:30.000Z", "stall": 2.0},
    }


def test_the_status_as_written_is_all_a_new_operator_needs() -> None:
    import json

    g = goodput_status(None, [rep("a", 10, 0.0, stall=1.0)], T)
    reports = [rep("a", 30, 20.0, stall=2.0, resumes=(Resume(25, T + 12.0, 21, T + 15.0),))]
    direct = goodput_status(g, reports, T + 20)
    reread = goodput_status(json.loads(json.dumps(g)), reports, T + 20)
    assert direct == reread


def test_the_step_time_is_the_median_of_the_members() -> None:
    g = goodput_status(
        None, [rep("a", step_seconds=1.0), rep("b", step_seconds=1.2), rep("c", step_seconds=5.0)], T
    )
    assert g is not None and g["stepSeconds"] == 1.2
    # Members that report no step time yet (a standby that just joined) change nothing.
    g = goodput_status(g, [rep("d", step_seconds=None)], T + 1)
    assert g is not None and g["stepSeconds"] == 1.2


@pytest.mark.parametrize(
    "record",
    [
        {},
        {"step": "12", "step_time": "soon", "step_seconds": -1, "stall": None, "resumes": "x"},
        {"resumes": [[1, 2, 3]], "started": True},
        {"resumes": [[1, 2, 3, "x"], None]},
    ],
)
def test_bad_records_read_as_not_reported(record: dict[str, Any]) -> None:
    got = report("a", record)
    assert (got.step, got.step_time, got.step_seconds, got.stall, got.resumes) == (None, None, None, 0.0, ())


def test_a_record_as_the_agent_publishes_it() -> None:
    record = {
        "started": T - 5,
        "step": 41,
        "step_time": T,
        "step_seconds": 0.998,
        "stall": 0.5,
        "resumes": [[50, T - 30, 46, T - 25]],
    }
    record["time"] = T + 0.4
    assert report("a", record) == GoodputReport(
        "a",
        step=41,
        step_time=T,
        time=T + 0.4,
        step_seconds=0.998,
        stall=0.5,
        started=T - 5,
        resumes=(Resume(50, T - 30, 46, T - 25),),
    )


def test_the_ratio_is_the_benchmarks_definition_on_a_simulated_run() -> None:
    """bench_goodput.py: steps kept in the window / window / the fault-free rate. One step a
    second from step 0; a crash after step 50 loses 5 steps (restored step 45, step 46 done at
    +56); the group steps on to step 90 at +100. Kept: the lineage 1..90."""
    timeline = [(float(s), s) for s in range(1, 51)] + [(56.0 + i, 46 + i) for i in range(45)]
    g = goodput_status(None, [rep(step=0, at=0.0)], T)
    for at, step in timeline:
        resumes = (Resume(50, T + 50.0, 46, T + 56.0),) if at >= 56.0 else ()
        g = goodput_status(g, [rep(step=step, at=at, resumes=resumes)], T + at)
    assert g is not None
    bench = 90 / 100.0 / 1.0
    assert g["ratio"] == pytest.approx(bench, abs=0.001)
    # Where the other 10 s went: 5 s restarting (the gap from step 50 to step 46 less a
    # step's own time) and 5 steps redone.
    assert (g["restartSeconds"], g["redoneSteps"], g["redoneSeconds"]) == (5.0, 5, 5.0)
    assert g["elapsedSeconds"] == g["productiveSeconds"] + g["restartSeconds"] + g["redoneSeconds"]

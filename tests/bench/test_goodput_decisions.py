"""The decisions bench/bench_goodput.py prints figures from: the checkpoint interval each
configuration takes and which step completions count as kept."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "bench_goodput", Path(__file__).parents[2] / "bench" / "bench_goodput.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_a_costly_save_takes_the_young_daly_interval_in_whole_steps() -> None:
    # 2 s saves, a fault every 120 s: sqrt(2*2*120) = 21.9 s, 21 or 22 one-second steps
    interval = bench.choose_interval(2.0, 1.0, 120.0)
    assert interval.steps in (21, 22)
    assert "every 2" in interval.reason
    other = 43 - interval.steps
    assert bench.waste(2.0, interval.steps, 120.0) <= bench.waste(2.0, other, 120.0)


def test_a_save_cheaper_than_the_optimum_of_one_step_saves_every_step() -> None:
    interval = bench.choose_interval(0.001, 1.0, 120.0)  # sqrt(0.24) = 0.49 s < one step
    assert interval.steps == 1
    assert "every step" in interval.reason


def test_the_interval_never_beats_every_step_when_every_step_wastes_less() -> None:
    for save in (0.0, 0.01, 0.1, 0.5, 1.0, 5.0):
        for step in (0.1, 1.0):
            k = bench.choose_interval(save, step, 120.0).steps
            assert k >= 1
            assert bench.waste(save, k * step, 120.0) <= bench.waste(save, step, 120.0) + 1e-12
            best = min(range(1, 2000), key=lambda n: bench.waste(save, n * step, 120.0))
            assert math.isclose(
                bench.waste(save, k * step, 120.0), bench.waste(save, best * step, 120.0), rel_tol=1e-9
            )


def test_steps_redone_after_a_restore_supersede_the_lost_ones() -> None:
    # steps 1..5, a fault, restore from step 3, steps 4..7 redone and continued
    steps = [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (5.0, 5), (8.0, 4), (9.0, 5), (10.0, 6), (11.0, 7)]
    kept = bench.lineage(steps)
    assert kept == [(1.0, 1), (2.0, 2), (3.0, 3), (8.0, 4), (9.0, 5), (10.0, 6), (11.0, 7)]


def test_a_job_that_restarted_from_nothing_keeps_only_its_new_lineage() -> None:
    steps = [(1.0, 1), (2.0, 2), (3.0, 1), (4.0, 2), (5.0, 3)]
    assert bench.lineage(steps) == [(3.0, 1), (4.0, 2), (5.0, 3)]
    assert bench.lineage([]) == []


def test_a_fault_costs_the_steps_redone_since_the_checkpoint_and_the_restart() -> None:
    # steps 1..10 one a second, a save at step 5, a crash at 10.5; the restarted group
    # (began 11.0) restores step 5 at 12.0 and redoes 6..10, reaching 15 at 22.0
    events = [{"e": "step", "t": float(s), "step": s, "began": 0.0} for s in range(1, 11)]
    events.append({"e": "saved", "t": 5.1, "step": 5, "seconds": 0.1})
    events.append(
        {"e": "restored", "t": 12.0, "step": 5, "source": "memory", "check": True, "seconds": 0.4, "world": 3}
    )
    events += [{"e": "step", "t": 7.0 + s, "step": s, "began": 11.0} for s in range(6, 16)]
    fig = bench.Figures("x", faults=[bench.Fault("crash", "node1", 10.5)])
    bench.analyse(fig, events, 0.5, 22.5, 1.0)
    assert fig.kept == 15
    assert fig.redone == 5
    assert fig.restores == [2.5]
    assert fig.stalls == [0.1]
    assert fig.goodput is not None and math.isclose(fig.goodput, 15 / 22)
    assert fig.lost_per_fault is not None and math.isclose(fig.lost_per_fault, 22 - 15 - 0.1)
    assert fig.checks == (1, 1) and fig.sources == {"memory": 1}
    assert fig.faults[0].restarts == ["+1.5 s: step 5 from memory in 0.40 s at world 3, 5 redone"]


def test_a_roll_forward_keeps_the_step_the_survivors_completed_that_rank_0_never_wrote() -> None:
    # rank 0 wrote steps 1..9 and was lost; the survivors had completed step 10, which the
    # new group (its rank 0 another node) rolls forward to and goes on from
    events = [{"e": "step", "t": float(s), "step": s, "began": 0.0} for s in range(1, 10)]
    events.append(
        {"e": "restored", "t": 10.8, "step": 10, "source": "live", "check": True, "seconds": 0.2, "world": 3}
    )
    events += [{"e": "step", "t": 1.0 + s, "step": s, "began": 10.6} for s in range(11, 15)]
    fig = bench.Figures("x", faults=[bench.Fault("crash", "node0", 10.5)])
    bench.analyse(fig, events, 0.5, 15.5, 1.0)
    assert fig.kept == 14 and fig.redone == 0
    assert fig.sources == {"live": 1}


def test_a_failed_job_keeps_only_its_last_checkpoint() -> None:
    events = [{"e": "step", "t": float(s), "step": s, "began": 0.0} for s in range(1, 11)]
    events.append({"e": "saved", "t": 4.1, "step": 4, "seconds": 0.1})
    fig = bench.Figures("x", faults=[bench.Fault("crash", "node1", 10.5)], failed="job failed after fault 1")
    bench.analyse(fig, events, 0.5, 20.5, 1.0)
    assert fig.kept == 4
    assert fig.redone == 6  # steps 5..10 are lost for good
    assert fig.restores == [None]


def test_the_straggler_step_time_is_the_median_within_one_incarnation() -> None:
    # rank 0's steps: (time, step, when its incarnation began); a restart starts a new one
    steps = [
        (10.0, 1, 0.0),
        (11.0, 2, 0.0),
        (12.5, 3, 0.0),
        (13.0, 3, 12.8),
        (13.2, 4, 12.8),
        (13.4, 5, 12.8),
    ]
    assert bench.step_seconds(steps, 0.0, 12.6) == 1.25
    assert abs(bench.step_seconds(steps, 12.9, 20.0) - 0.2) < 1e-9
    assert bench.step_seconds(steps, 20.0, 30.0) is None


def _phases() -> object:
    spec = importlib.util.spec_from_file_location(
        "goodput_phases", Path(__file__).parents[2] / "bench" / "goodput_phases.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_breakdown_takes_the_first_node_to_notice_and_the_last_to_be_ready() -> None:
    phases: Any = _phases()
    records = [
        {"e": "fault_noticed", "t": 100.2, "node": "node1"},
        {"e": "fault_noticed", "t": 100.1, "node": "node2"},
        {"e": "restart", "t": 100.3, "node": "node2"},
        {"e": "workers_stopped", "t": 100.7, "node": "node2", "stopped_at": 100.65},
        {"e": "rendezvous", "t": 100.6, "node": "node2", "rdzv_joined": 100.4, "rdzv_closed": 100.5},
        {"e": "rendezvous", "t": 100.7, "node": "standby0", "rdzv_joined": 100.45, "rdzv_closed": 100.55},
        {"e": "workers_started", "t": 100.8, "node": "node2"},
        {"e": "pg", "t": 101.0, "node": "node2"},
        {"e": "pg", "t": 101.1, "node": "standby0"},
        {"e": "restored", "t": 101.3, "node": "standby0"},
        {"e": "step", "t": 102.0, "node": "node2"},
        {"e": "step", "t": 102.1, "node": "standby0"},
        # the lost node's replacement: it starts its workers to wait as a standby, outside the group
        {"e": "workers_started", "t": 104.7, "node": "node1"},
        {"e": "began", "t": 104.8, "node": "node1"},
        # before the fault, and after the next one: neither counts for the first
        {"e": "pg", "t": 99.0, "node": "node0"},
        {"e": "pg", "t": 130.5, "node": "node0"},
    ]
    rows = phases.breakdown(records, [100.0, 130.0], 200.0)
    first = rows[0]
    assert first["noticed"] == 100 and first["re-form"] == 300
    assert (
        first["stopped"] == 650
        and first["joined"] == 450
        and first["decided"] == 550
        and first["ranks"] == 700
    )
    assert first["pg ready"] == 1100 and first["restored"] == 1300 and first["step"] == 2000
    assert first["main"] is None  # not recorded by the group's nodes: shown as '-'
    assert first["started"] == 800  # the replacement's start, at 4700, is not the group's
    assert rows[1]["pg ready"] == 500 and rows[1]["noticed"] is None
    lines = phases.table(["crash", "node kill"], rows)
    assert len(lines) == 3 and "1 crash" in lines[1] and "-" in lines[2]

"""The straggler rule (kelastic.agent.straggler): ratio, window, hysteresis, settings."""

from __future__ import annotations

import pytest

from kelastic.agent.straggler import Policy, StragglerRule, StragglerState, judge, parse_rule, ratios

RULE = StragglerRule(policy=Policy.REPLACE, ratio=1.5, window=10.0)


def run(
    observations: list[tuple[float, dict[str, float]]], rule: StragglerRule = RULE
) -> list[StragglerState]:
    state, seen = StragglerState(), []
    for now, work in observations:
        state = judge(state, work, now, rule)
        seen.append(state)
    return seen


def test_ratio_is_own_work_over_the_median_of_the_others() -> None:
    assert ratios({"a": 3.0, "b": 1.0, "c": 1.0}) == {"a": 3.0, "b": 0.5, "c": 0.5}
    assert ratios({"a": 1.0}) == {}
    assert ratios({"a": 1.0, "b": 0.0}) == {}


def test_a_member_consistently_slower_for_the_window_is_the_straggler() -> None:
    slow = {"a": 1.0, "b": 1.0, "c": 3.0}
    seen = run([(t, slow) for t in range(0, 12)])
    assert [s.straggler for s in seen[:10]] == [None] * 10
    assert seen[10].straggler == "c" and seen[10].declared == 10 and seen[10].suspect_since == 0
    assert seen[11].straggler == "c" and seen[11].declared == 10


def test_one_slow_observation_does_not_make_a_straggler() -> None:
    fine, slow = {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 3.0}
    seen = run([(t, slow if t % 5 == 4 else fine) for t in range(0, 40)])
    assert all(s.straggler is None for s in seen)


def test_the_suspicion_starts_again_when_another_member_is_slowest() -> None:
    seen = run([(0, {"a": 1.0, "b": 2.0}), (6, {"a": 2.0, "b": 1.0}), (12, {"a": 2.0, "b": 1.0})])
    assert seen[1].suspect == "a" and seen[1].suspect_since == 6
    assert seen[2].straggler is None


def test_hysteresis_a_straggler_stays_one_until_below_the_clear_ratio() -> None:
    start = [(t, {"a": 1.0, "b": 1.0, "c": 3.0}) for t in range(0, 11)]
    seen = run([*start, (11, {"a": 1.0, "b": 1.0, "c": 1.3}), (12, {"a": 1.0, "b": 1.0, "c": 1.2})])
    assert seen[10].straggler == "c"
    assert seen[11].straggler == "c"  # 1.3 >= clear ratio 1.25
    assert seen[12].straggler is None and seen[12].suspect is None


def test_fewer_than_two_members_reporting_suspects_nobody() -> None:
    seen = run([(t, {"a": 1.0, "c": 3.0}) for t in range(0, 11)] + [(11, {"c": 3.0})])
    assert seen[10].straggler == "c"
    assert seen[11] == StragglerState()


def test_parse_rule_and_its_errors() -> None:
    assert parse_rule("policy=Replace,ratio=2,window=5") == StragglerRule(Policy.REPLACE, 2.0, 5.0)
    assert parse_rule("") == StragglerRule()
    assert parse_rule(RULE.to_text()) == RULE
    for bad in ("policy=Kill", "ratio=1", "ratio=x", "window=-1", "speed=2", "ratio"):
        with pytest.raises(ValueError, match="straggler"):
            parse_rule(bad)


def test_work_figures_take_fresh_records_only() -> None:
    from kelastic.agent.straggler_watch import STALE_RECORD, work_figures

    records = {
        "a": {"work_seconds": 1.0, "time": 100.0},
        "b": {"work_seconds": 3.0, "time": 100.0 - STALE_RECORD - 1},  # its agent stopped publishing
        "c": {"work_seconds": None, "time": 100.0},  # no interval yet
        "d": {"time": 100.0},
    }
    assert work_figures(records, 100.0) == {"a": 1.0}


def test_the_agent_metrics_show_the_verdict_for_this_node() -> None:
    from kelastic.agent.events import Event, EventSource
    from kelastic.agent.telemetry import AgentTelemetry

    verdict: dict[str, object] = {"node": "b", "ratio": 2.5, "action": "replace"}
    telemetry = AgentTelemetry()
    telemetry.watch_straggler(lambda: verdict, node="b")
    text = telemetry.render()
    assert "kelastic_agent_straggler 1" in text and "kelastic_agent_straggler_ratio 2.5" in text
    telemetry.record(Event("kelastic.agent.straggler", EventSource.AGENT, metadata={}))
    verdict["action"] = "replaced"
    text = telemetry.render()
    assert "kelastic_agent_straggler 0" in text and "kelastic_agent_straggler_steps_aside_total 1" in text

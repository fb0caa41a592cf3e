"""spec.stragglers: the agents' flag, its validation, and status.straggler with its Events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kelastic.agent import contract
from kelastic.agent.stragglerrule import Policy, parse_rule
from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import Emit, reconcile
from kelastic.operator.spec import RdzvBackend, parse_job
from kelastic.operator.straggler import EVENT_RECOVERED, EVENT_REPLACED, EVENT_STRAGGLER, straggler_status


def test_the_agents_get_the_rule_only_when_it_is_set(kit: SimpleNamespace) -> None:
    def command(**spec: object) -> list[str]:
        pod = worker_pod(parse_job(kit.job_body(**spec)), 0, endpoint="h:1", config=BuildConfig())
        c = pod["spec"]["containers"][0]
        return list(c["command"]) + list(c.get("args") or [])

    assert contract.FLAG_STRAGGLERS not in command()
    cmd = command(stragglers={"policy": "Replace", "ratio": 2, "windowSeconds": 5})
    assert cmd[cmd.index(contract.FLAG_STRAGGLERS) + 1] == "policy=Replace,ratio=2,window=5"
    spec = parse_job(kit.job_body(stragglers={})).spec
    assert spec is not None and spec.stragglers is not None
    assert (spec.stragglers.policy, spec.stragglers.ratio, spec.stragglers.window) == (
        Policy.REPORT,
        1.5,
        10.0,
    )
    # One type at both ends: what the operator writes, the agent reads back as the same rule.
    assert (
        parse_rule(cmd[cmd.index(contract.FLAG_STRAGGLERS) + 1])
        == parse_job(
            kit.job_body(stragglers={"policy": "Replace", "ratio": 2, "windowSeconds": 5})
        ).spec.stragglers
    )


@pytest.mark.parametrize(
    ("rule", "field", "hint"),
    [
        ({"policy": "Kill"}, "spec.stragglers.policy", "Report"),
        ({"ratio": 1}, "spec.stragglers.ratio", "above 1"),
        ({"ratio": "fast"}, "spec.stragglers.ratio", "number"),
        ({"windowSeconds": -1}, "spec.stragglers.windowSeconds", "at least 0"),
        ("Replace", "spec.stragglers", "object"),
    ],
)
def test_bad_rules_name_the_field(kit: SimpleNamespace, rule: object, field: str, hint: str) -> None:
    job = parse_job(kit.job_body(stragglers=rule))
    assert job.spec is None and job.error is not None and job.error.field == field and hint in str(job.error)


def test_the_rule_needs_the_kelastic_backend(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body(stragglers={}, rdzvBackend=RdzvBackend.C10D.value))
    assert job.error is not None and "kelastic" in str(job.error)


def test_status_and_events_follow_the_verdict_once_each() -> None:
    named = {"node": "w-2", "ratio": 3.1, "since": 1.0e9, "policy": "Replace", "action": "replace"}
    shown, event = straggler_status(None, named)
    assert shown == {
        "node": "w-2", "action": "replace", "policy": "Replace", "ratio": 3.1, "since": "2001-09-09T01:46:40Z"
    }  # fmt: skip
    assert event is not None and event[0] == EVENT_STRAGGLER and "pod w-2" in event[1] and "3.1x" in event[1]
    assert straggler_status(shown, named) == (shown, None)  # read again: no second Event
    shown, event = straggler_status(shown, {**named, "action": "replaced"})
    assert event is not None and event[0] == EVENT_REPLACED and shown is not None
    shown, event = straggler_status(shown, {"node": None, "round": 3})
    assert (
        shown == {"node": "w-2", "action": "recovered"} and event is not None and event[0] == EVENT_RECOVERED
    )
    assert straggler_status(shown, {"node": None}) == (None, None)
    assert straggler_status(shown, None) == (None, None)
    assert straggler_status(None, {"node": "w-1", "action": "bogus"}) == (None, None)


def test_reconcile_shows_the_straggler_and_warns_once(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        stragglers={"policy": "Replace"}, status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}
    )
    verdict = {"node": "demo-worker-1", "ratio": 2.5, "since": kit.T0.timestamp(), "action": "report"}
    view = RendezvousView(world_size=3, restarts=0, round=1, straggler=verdict)
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))
    first = reconcile(parse_job(body), kit.observed(*pods, at=10, rendezvous=view))
    assert first.status["straggler"]["node"] == "demo-worker-1"
    warned = [a for a in first.actions if isinstance(a, Emit) and a.reason == EVENT_STRAGGLER]
    assert len(warned) == 1 and warned[0].warning and "demo-worker-1" in warned[0].message
    again = reconcile(
        parse_job({**body, "status": first.status}), kit.observed(*pods, at=12, rendezvous=view)
    )
    assert not [a for a in again.actions if isinstance(a, Emit) and a.reason == EVENT_STRAGGLER]

"""spec.hangTimeoutSeconds: the agents' flag, and the Stalled condition from their verdicts."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

from kelastic.agent import contract
from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import Emit, reconcile
from kelastic.operator.spec import parse_job
from kelastic.operator.stall import CONDITION_STALLED, remembered_for, summarize
from kelastic.operator.status import find_condition


def test_summarize_takes_the_latest_hang_across_nodes() -> None:
    hangs = [("w-0", (0,), 31.0, 1000.0), ("w-1", (1,), 30.5, 1000.4), ("w-0", (0,), 30.0, 500.0)]
    s = summarize(hangs, 30)
    assert s is not None and (s.ranks, s.nodes, s.seconds, s.at) == ((0, 1), ("w-0", "w-1"), 31.0, 1000.4)
    assert summarize([], 30) is None
    assert (
        "rank(s) 0, 1 (on w-0, w-1) reported no progress for 31s (spec.hangTimeoutSeconds=30)"
        in s.message(30)
    )


def test_the_agents_get_the_timeout_only_when_it_is_set(kit: SimpleNamespace) -> None:
    def command(**spec: object) -> list[str]:
        pod = worker_pod(parse_job(kit.job_body(**spec)), 0, endpoint="h:1", config=BuildConfig())
        return list(pod["spec"]["containers"][0]["command"]) + list(
            pod["spec"]["containers"][0].get("args") or []
        )

    assert contract.FLAG_HANG_TIMEOUT not in command()
    cmd = command(hangTimeoutSeconds=45)
    assert cmd[cmd.index(contract.FLAG_HANG_TIMEOUT) + 1] == "45"
    assert parse_job(kit.job_body(hangTimeoutSeconds=0)).error is not None


def test_stalled_condition_names_the_ranks_once_then_clears(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        hangTimeoutSeconds=30, status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}
    )
    at = (kit.T0 + timedelta(seconds=100)).timestamp()
    view = RendezvousView(
        world_size=3,
        restarts=1,
        hangs=(("demo-worker-1", (1,), 31.0, at), ("demo-worker-0", (0,), 30.2, at - 0.3)),
    )
    pods = (kit.store(), kit.worker(0), kit.worker(1), kit.worker(2))

    def run(status: dict[str, object], seconds: float) -> object:
        return reconcile(
            parse_job({**body, "status": status}), kit.observed(*pods, at=seconds, rendezvous=view)
        )

    first = run(body["status"], 101)
    cond = find_condition(first.status["conditions"], CONDITION_STALLED)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "NoProgress"
    assert "rank(s) 0, 1 (on demo-worker-0, demo-worker-1)" in cond["message"]
    assert [a for a in first.actions if isinstance(a, Emit) and a.reason == "NoProgress" and a.warning]
    again = run(first.status, 105)
    assert not [a for a in again.actions if isinstance(a, Emit) and a.reason == "NoProgress"]
    later = run(again.status, 100 + remembered_for(30) + 1)
    cond = find_condition(later.status["conditions"], CONDITION_STALLED)
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "ProgressResumed"


def test_without_the_timeout_no_condition(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    view = RendezvousView(
        world_size=3, restarts=0, hangs=(("demo-worker-1", (1,), 31.0, kit.T0.timestamp()),)
    )
    decision = reconcile(parse_job(body), kit.observed(kit.store(), kit.worker(0), at=1, rendezvous=view))
    assert find_condition(decision.status.get("conditions") or [], CONDITION_STALLED) is None

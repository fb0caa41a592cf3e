"""Table tests of reconcile's figures every pass writes: what the rendezvous store reports reaches
the status (operator/reconcile/figures.py).
"""

from __future__ import annotations

import runpy
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import Emit

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_rendezvous_figures_reach_status(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "backoffCount": 1, "restarts": 1})
    rdzv = RendezvousView(world_size=6, restarts=2, members=("a", "b"), step=120, total=500)
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), rendezvous=rdzv))
    assert d.status["worldSize"] == 6
    assert d.status["progress"] == "120/500 (24%)"
    assert d.status["restarts"] == 3
    # the store unreachable: the last known figures stay
    body["status"] = d.status
    d2 = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert (
        d2.status["worldSize"] == 6
        and d2.status["progress"] == "120/500 (24%)"
        and d2.status["restarts"] == 3
    )


def test_restarts_count_every_group_restart_whatever_its_cause(kit: SimpleNamespace) -> None:
    """A scale and a deleted pod restart the group without any agent failure: every rendezvous
    round after the first counts (the agents' restart counts and recreated pods are a floor)."""
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "restarts": 0})
    workers = [kit.worker(i) for i in range(3)]
    first = RendezvousView(world_size=3, restarts=0, members=("a", "b", "c"), round=1)
    d = harness.run(body, kit.observed(kit.store(), *workers, rendezvous=first))
    assert d.status["restarts"] == 0  # the group's first start
    fourth = replace(first, round=5)  # scaled up, down, and a pod deleted twice
    body["status"] = harness.run(body, kit.observed(kit.store(), *workers, rendezvous=fourth)).status
    assert body["status"]["restarts"] == 4
    # a recreated store counts rounds from 1 again: the count never goes back
    again = harness.run(body, kit.observed(kit.store(), *workers, rendezvous=replace(first, round=2)))
    assert again.status["restarts"] == 4


def test_a_restart_after_a_failure_is_said_once_with_the_agents_reason(kit: SimpleNamespace) -> None:
    """An agent's reason for restarting its workers (a rank OOM-killed) becomes a Warning Event
    and status.lastFailure, once: a later pass, or another operator, does not say it again."""
    reason = (
        "workers FAILED (rank 1 was OOM-killed (its container reached its memory limit)); 0/1 restarts left"
    )
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    rdzv = RendezvousView(
        world_size=3, restarts=1, members=("a", "b"), failures=(("b", reason, 1700000000.25),)
    )
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), rendezvous=rdzv))
    assert d.status["lastFailure"] == {"node": "b", "reason": reason, "time": "2023-11-14T22:13:20.250Z"}
    said = [e for e in harness.kinds(d, Emit) if e.reason == "WorkersRestarted"]
    assert [e.message for e in said] == [f"b restarted its workers: {reason}"] and said[0].warning
    body["status"] = d.status
    again = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), rendezvous=rdzv))
    assert not [e for e in harness.kinds(again, Emit) if e.reason == "WorkersRestarted"]
    assert again.status["lastFailure"] == d.status["lastFailure"]

"""The agent's restart rule (kelastic.agent.restart_policy), as tables: no store, no workers."""

from __future__ import annotations

import pytest

from kelastic.agent.restart_policy import (
    Action,
    Failure,
    Healthy,
    JoinDeferral,
    LossQuestion,
    Verdict,
    Watching,
    decide_after_failure,
    decide_while_healthy,
    defer_join,
    loss_question,
)

N, M, L = Watching.NOTHING, Watching.MEMBERSHIP, Watching.LOSSES


@pytest.mark.parametrize(
    ("watching", "changed", "alone", "question"),
    [
        # torch's handlers: no failure is ever the group's
        (N, False, False, LossQuestion.NO),
        (N, True, False, LossQuestion.NO),
        (N, True, True, LossQuestion.NO),
        # a membership watcher: a change seen before the failure settles it; else ask and wait
        (M, True, False, LossQuestion.YES),
        (M, True, True, LossQuestion.YES),
        (M, False, False, LossQuestion.CHANGED_OR_WAIT),
        (M, False, True, LossQuestion.NO),
        # a loss watcher: only a lost member counts, whatever changed; none to lose when alone
        (L, True, False, LossQuestion.WAIT_MEMBER_LOST),
        (L, False, False, LossQuestion.WAIT_MEMBER_LOST),
        (L, True, True, LossQuestion.NO),
        (L, False, True, LossQuestion.NO),
    ],
)
def test_loss_question_with_no_restart_left(
    watching: Watching, changed: bool, alone: bool, question: LossQuestion
) -> None:
    assert loss_question(watching, changed=changed, alone=alone, final=True) is question


@pytest.mark.parametrize("changed", [False, True])
def test_a_loss_watcher_settles_the_question_after_the_restart_while_restarts_remain(changed: bool) -> None:
    assert loss_question(L, changed=changed, alone=False) is LossQuestion.AFTER_REJOIN
    assert loss_question(L, changed=changed, alone=True) is LossQuestion.NO
    # the others' answers do not depend on restarts left
    assert loss_question(M, changed=changed, alone=False) is loss_question(
        M, changed=changed, alone=False, final=True
    )


FREE = "a peer was lost or the membership changed as workers failed; no restart spent"


@pytest.mark.parametrize(
    ("failure", "verdict"),
    [
        # a lost member: free, also with no restart left
        (Failure("FAILED", True, 3, 3), Verdict(Action.RESTART_FREE, FREE)),
        (Failure("FAILED", True, 0, 3), Verdict(Action.RESTART_FREE, FREE)),
        # its own failure: spend one while some remain
        (
            Failure("FAILED", False, 3, 3),
            Verdict(Action.RESTART_SPEND, "workers FAILED; 2/3 restarts left after this"),
        ),
        (
            Failure("UNHEALTHY", False, 1, 3),
            Verdict(Action.RESTART_SPEND, "workers UNHEALTHY; 0/3 restarts left after this"),
        ),
        # spent before the cause is settled: said so
        (
            Failure("FAILED", False, 2, 3, settled=False),
            Verdict(
                Action.RESTART_SPEND,
                "workers FAILED; 1/3 restarts left after this (given back if a member of the round turns out lost)",
            ),
        ),
        # none left: fail
        (Failure("FAILED", False, 0, 3), Verdict(Action.FAIL, "")),
        (Failure("FAILED", False, 0, 0), Verdict(Action.FAIL, "")),
    ],
)
def test_decide_after_failure(failure: Failure, verdict: Verdict) -> None:
    assert decide_after_failure(failure) == verdict


@pytest.mark.parametrize(
    ("healthy", "verdict"),
    [
        (Healthy(L, True, 0), Verdict(Action.RESTART_FREE, "rendezvous membership changed")),
        (Healthy(M, True, 0), Verdict(Action.RESTART_FREE, "rendezvous membership changed")),
        (Healthy(L, False, 0), Verdict(Action.CONTINUE, "")),
        # a watching handler is never asked for waiting nodes: a count there decides nothing
        (Healthy(M, False, 5), Verdict(Action.CONTINUE, "")),
        # torch's handlers: nodes waiting to join restart the group, free
        (Healthy(N, False, 2), Verdict(Action.RESTART_FREE, "2 node(s) waiting to join")),
        (Healthy(N, True, 0), Verdict(Action.CONTINUE, "")),
    ],
)
def test_decide_while_healthy(healthy: Healthy, verdict: Verdict) -> None:
    assert decide_while_healthy(healthy) == verdict


@pytest.mark.parametrize(
    ("latest", "age", "interval", "expected"),
    [
        # a steady pace: wait for the next save, plus half an interval of slack
        (7, 1.0, 3.0, JoinDeferral(after=7, within=3.5)),
        (7, 0.0, 3.0, JoinDeferral(after=7, within=4.5)),
        # overdue but not stopped: the slack only
        (7, 4.0, 3.0, JoinDeferral(after=7, within=1.5)),
        # saves stopped (none for two intervals): at once
        (7, 6.5, 3.0, None),
        # pace unknown: no save yet, or only one since the agent started
        (None, None, None, None),
        (7, 1.0, None, None),
        # the joiner would wait longer than the cap: at once
        (7, 0.0, 40.0, None),
    ],
)
def test_defer_join(latest: int | None, age: float | None, interval: float | None, expected: object) -> None:
    assert defer_join(latest, age, interval) == expected


def test_defer_join_respects_its_cap() -> None:
    assert defer_join(1, 0.0, 4.0, cap=5.0) is None
    assert defer_join(1, 0.0, 4.0, cap=6.0) == JoinDeferral(after=1, within=6.0)

"""The agent's restart rule (kelastic.agent.restart_policy), as tables: no store, no workers."""

from __future__ import annotations

import pytest

from kelastic.agent.restart_policy import (
    Action,
    Failure,
    Healthy,
    LossQuestion,
    Verdict,
    Watching,
    decide_after_failure,
    decide_while_healthy,
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
def test_loss_question(watching: Watching, changed: bool, alone: bool, question: LossQuestion) -> None:
    assert loss_question(watching, changed=changed, alone=alone) is question


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

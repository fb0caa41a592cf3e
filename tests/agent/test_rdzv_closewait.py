"""The close-wait state machine (``rendezvous.closewait``), step by step, without a store.

Each case is a script: the view the handler would gather before a step (the
watcher's generation and epoch, the close event, the job's closed flag, and the
answer to the previous action), the instant, and the action the step must return.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kelastic.agent.rendezvous.closewait import (
    FALLBACK_EVALUATION,
    SUPERSEDED,
    AnnounceMin,
    Close,
    CloseWait,
    Fail,
    FailReason,
    Observe,
    Phase,
    ReadClose,
    ReadOpen,
    Return,
    Wait,
    WaitAction,
    WaitView,
    start,
    step,
)
from kelastic.agent.rendezvous.protocol import RoundClose, RoundView, TimerKind

TIMEOUTS = {TimerKind.LAST_CALL: 1.0, TimerKind.REJOIN: 3.0, TimerKind.CONTROLLER: 7.0}
DEADLINE = 100.0
CLOSED = RoundClose(2, "a", "t", "h", 5)


def wait_in(slot: int, epoch: int | None = 1, r: int = 1) -> CloseWait:
    return start(r, slot, DEADLINE, epoch, TIMEOUTS)


def look(generation: int = 0, epoch: int | None = 1, **kw: object) -> WaitView:
    """The view at the start of a pass (``kw``: the close event, job closed, an answer)."""
    base: dict[str, object] = dict(generation=generation, epoch=epoch, close=None, job_closed=False)
    base.update(kw)
    return WaitView(**base)  # type: ignore[arg-type]


#: Round 1 of a job with min 2 and max 4, nobody joined yet (fields in RoundView's order:
#: joined, min, max, previous size, previous accounted, controlled, listed all joined).
EMPTY = RoundView(0, 2, 4, 0, 0, False, False)


def round_view(joined: int, **kw: object) -> RoundView:
    return replace(EMPTY, joined=joined, **kw)  # type: ignore[arg-type]


def play(state: CloseWait, script: list[tuple[WaitView, float, WaitAction]]) -> CloseWait:
    for i, (view, now, expected) in enumerate(script):
        state, action = step(state, view, now)
        assert action == expected, f"step {i}: {action} != {expected}"
    return state


# Each case: (the wait's start, [(view, now, expected action), ...]).
CASES: dict[str, tuple[CloseWait, list[tuple[WaitView, float, WaitAction]]]] = {
    # The first evaluation right after the join reads no size key while the watcher's epoch
    # holds, checks the listed nodes against its own count, and a decider then waits for
    # the next event until the deadline.
    "first evaluation, below min, decider": (
        wait_in(0),
        [
            (look(), 0.0, Observe(1, True)),
            (look(observed=round_view(1)), 0.1, Wait(DEADLINE, 0)),
        ],
    ),
    # A non-decider wakes again for its fall-back evaluation.
    "first evaluation, below min, not a decider": (
        wait_in(5),
        [
            (look(generation=4), 0.0, Observe(6, True)),
            (look(observed=round_view(1, min_nodes=8, max_nodes=9)), 0.1, Wait(FALLBACK_EVALUATION, 4)),
        ],
    ),
    # The watcher reconnected since the open round was read: the close event may have been
    # missed, so the size key is read first; there it is.
    "epoch changed: read the size key": (
        wait_in(5),
        [
            (look(epoch=2), 0.0, ReadClose()),
            (look(epoch=2, stored_close=CLOSED), 0.1, Return(CLOSED)),
        ],
    ),
    "watcher disconnected: read the size key": (
        wait_in(0),
        [
            (look(epoch=None), 0.0, ReadClose()),
            (look(epoch=None), 0.1, Observe(1, True)),
        ],
    ),
    "close event seen: nothing read": (
        wait_in(7),
        [(look(close=CLOSED), 0.0, Return(CLOSED))],
    ),
    "job closed": (
        wait_in(0),
        [(look(job_closed=True), 0.0, Fail(FailReason.JOB_CLOSED))],
    ),
    # The join that reaches max closes the round, then reads the outcome (its own close
    # or another node's) from the size key.
    "close at max": (
        wait_in(3),
        [
            (look(), 0.0, Observe(4, True)),
            (look(observed=round_view(4)), 0.1, Close(4)),
            (look(generation=1), 0.2, ReadClose()),
            (look(generation=1, stored_close=CLOSED), 0.3, Return(CLOSED)),
        ],
    ),
    # The join that reaches min tells the deciders (they start their timers) and starts the
    # last call itself; the decider closes when it runs out with whoever joined.
    "min reached: announce, last call, close on expiry": (
        wait_in(1),
        [
            (look(), 0.0, Observe(2, True)),
            (look(observed=round_view(2)), 0.5, AnnounceMin()),
            (look(), 0.6, Wait(1.5, 0)),
            (look(generation=1), 1.6, ReadClose()),
            (look(generation=1), 1.6, ReadOpen()),
            (look(generation=1, open_round=0), 1.6, Observe(None, True)),
            (look(generation=1, observed=round_view(3)), 1.7, Close(3)),
            (look(generation=2), 1.8, ReadClose()),
            (look(generation=2, stored_close=CLOSED), 1.9, Return(CLOSED)),
        ],
    ),
    # A timer is kept across evaluations of the same kind, and dropped when the rule waits.
    "timer kept, then dropped": (
        wait_in(0, r=2),
        [
            (look(), 0.0, Observe(1, True)),
            (look(observed=round_view(3, prev_size=4, prev_accounted=2)), 0.0, Wait(3.0, 0)),
            (look(generation=1), 1.0, ReadClose()),
            (look(generation=1), 1.0, ReadOpen()),
            (look(generation=1, open_round=1), 1.0, Observe(None, True)),
            (look(generation=1, observed=round_view(3, prev_size=4, prev_accounted=3)), 1.0, Wait(3.0, 1)),
            (look(generation=2), 2.0, ReadClose()),
            (look(generation=2), 2.0, ReadOpen()),
            (look(generation=2, open_round=1), 2.0, Observe(None, True)),
            (
                look(generation=2, observed=round_view(1, prev_size=4, prev_accounted=3)),
                2.0,
                Wait(DEADLINE, 2),
            ),
        ],
    ),
    # A non-decider between its fall-back evaluations reads nothing and waits on.
    "not a decider: nothing read between evaluations": (
        wait_in(5),
        [
            (look(), 0.0, Observe(6, True)),
            (look(observed=round_view(3, min_nodes=8, max_nodes=9)), 0.0, Wait(FALLBACK_EVALUATION, 0)),
            (look(generation=1), 1.0, Wait(FALLBACK_EVALUATION, 1)),
            (look(generation=1), FALLBACK_EVALUATION, ReadClose()),
            (look(generation=1), FALLBACK_EVALUATION, ReadOpen()),
            (look(generation=1, open_round=0), FALLBACK_EVALUATION, Observe(None, False)),
        ],
    ),
    # ``open`` passed the round that never closed: the store restarted and an earlier group
    # re-established its round there; this joiner is no member and goes on.
    "open passed the round: superseded": (
        wait_in(0, r=3),
        [
            (look(), 0.0, Observe(1, True)),
            (look(observed=round_view(1)), 0.0, Wait(DEADLINE, 0)),
            (look(generation=1), 1.0, ReadClose()),
            (look(generation=1), 1.0, ReadOpen()),
            (look(generation=1, open_round=3), 1.0, ReadClose()),
            (look(generation=1), 1.0, Return(SUPERSEDED)),
        ],
    ),
    "open passed the round: closed meanwhile": (
        wait_in(0, r=3),
        [
            (look(), 0.0, Observe(1, True)),
            (look(observed=round_view(1)), 0.0, Wait(DEADLINE, 0)),
            (look(generation=1), 1.0, ReadClose()),
            (look(generation=1), 1.0, ReadOpen()),
            (look(generation=1, open_round=4), 1.0, ReadClose()),
            (look(generation=1, stored_close=CLOSED), 1.0, Return(CLOSED)),
        ],
    ),
    "deadline passed": (
        wait_in(0),
        [
            (look(), 0.0, Observe(1, True)),
            (look(observed=round_view(1)), DEADLINE, Fail(FailReason.TIMED_OUT)),
        ],
    ),
    # A controller lists a node that has not joined: its timer, then a close with whoever
    # joined.
    "controller timer": (
        wait_in(2),
        [
            (look(), 0.0, Observe(3, True)),
            (look(observed=round_view(3, controlled=True)), 0.0, Wait(7.0, 0)),
            (look(generation=1), 7.0, ReadClose()),
            (look(generation=1), 7.0, ReadOpen()),
            (look(generation=1, open_round=0), 7.0, Observe(None, True)),
            (look(generation=1, observed=round_view(5, max_nodes=8, controlled=True)), 7.0, Close(5)),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_close_wait(name: str) -> None:
    state, script = CASES[name]
    play(state, script)


def test_min_announced_with_an_expired_timer_closes_after_the_announcement() -> None:
    state = replace(wait_in(1), timeouts={**TIMEOUTS, TimerKind.LAST_CALL: 0.0})
    play(
        state,
        [
            (look(), 0.0, Observe(2, True)),
            (look(observed=round_view(2)), 0.0, AnnounceMin()),
            (look(), 0.0, Close(2)),
        ],
    )


def test_no_step_after_the_wait_ended() -> None:
    state, _ = step(wait_in(0), look(close=CLOSED), 0.0)
    assert state.phase is Phase.DONE
    with pytest.raises(ValueError, match="over"):
        step(state, look(), 0.0)


def test_the_step_after_observe_needs_the_round() -> None:
    state, _ = step(wait_in(0), look(), 0.0)
    with pytest.raises(ValueError, match="observed"):
        step(state, look(), 0.0)


def test_a_new_wait_starts_with_no_timer() -> None:
    state = wait_in(0)
    assert (state.timer, state.timer_deadline, state.first) == (None, math.inf, True)

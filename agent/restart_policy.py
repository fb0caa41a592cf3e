"""The agent's restart rule (pure): what to do after a turn of the monitor loop.

The agent's loop (:meth:`kelastic.agent.api.SimpleElasticAgent._invoke_run`) watches
its workers; this module decides, from what the loop saw, whether it goes on,
restarts the workers (spending one of ``--max-restarts`` or not) or fails. The
loop does the I/O (it waits on the rendezvous, asks the handler, stops and starts
workers) and applies the :class:`Verdict`.

The rule a caller may rely on:

* workers that failed because the group changed around them (a member of the
  round was lost) are restarted *without* spending a restart;
* any other failure spends one while some remain, and fails the agent when none
  does;
* healthy workers are restarted, without spending one, when the membership
  changed (a handler that watches it) or nodes wait to join (one that does not);
  when only nodes joining changed it and the job saves memory checkpoints at a
  steady pace, right after the next checkpoint (:func:`defer_join`), so that the
  re-formed group redoes no step.

Whether a member was lost is asked of the rendezvous handler, which may have to
wait for the answer: :func:`loss_question` says which question to ask, if any.
With kelastic's handler the agent does not wait before restarting: a crash's
verdict ("no member was lost") comes from the peers re-joining, which they do
only once they restart, so waiting for it first cost every crash the whole grace.
It restarts at once, spending a restart, and gives it back once the round it
left turns out to have lost a member (:attr:`LossQuestion.AFTER_REJOIN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "MAX_JOIN_DEFERRAL",
    "Action",
    "Failure",
    "Healthy",
    "JoinDeferral",
    "LossQuestion",
    "Verdict",
    "Watching",
    "decide_after_failure",
    "decide_while_healthy",
    "defer_join",
    "loss_question",
]


class Watching(str, Enum):
    """What the rendezvous handler lets the agent watch."""

    NOTHING = "nothing"
    """Neither membership nor losses (torch's ``c10d`` and ``static``): the agent polls
    ``num_nodes_waiting()``."""
    MEMBERSHIP = "membership"
    """The membership (a ``MembershipWatcher``): any change near a failure excuses it."""
    LOSSES = "losses"
    """The membership and lost members (a ``MembershipWatcher`` and a ``LossWatcher``,
    kelastic's): only a lost member excuses a failure."""


class LossQuestion(str, Enum):
    """How the agent learns whether a failure was caused by the group changing."""

    NO = "no"
    """It was not (nothing is watched, or no peer could have caused it): ask nothing."""
    YES = "yes"
    """It was: the membership was seen changed just before the failure."""
    WAIT_MEMBER_LOST = "wait_member_lost"
    """Ask ``wait_member_lost(grace)``: a peer's death often shows first as a failed
    collective, so its loss may show only later."""
    CHANGED_OR_WAIT = "changed_or_wait"
    """Ask ``membership_changed()``, then ``wait_membership_change(grace)``."""
    AFTER_REJOIN = "after_rejoin"
    """Ask ``wait_member_lost(0)`` (what is known now); when no loss shows yet, restart
    at once spending a restart, and after re-joining ask
    ``wait_previous_round_lost(what is left of the grace)``: a member of the round
    left lost gives the restart back."""


def loss_question(watching: Watching, *, changed: bool, alone: bool, final: bool = False) -> LossQuestion:
    """Which question tells whether the workers' failure was the group changing.

    ``changed``: the membership was seen changed in the wait before the failure was
    seen. ``alone``: this node is the only one of its round (no peer could have
    caused it). ``final``: no restart is left, so spending one is failing the job.
    With :attr:`Watching.LOSSES` only a lost member counts (a peer that re-joined
    after its own failure spends a restart on every agent alike), so ``changed``
    alone settles nothing; the answer is settled after the restart unless the
    restart would be the job's end, which waits for the answer first.
    """
    if watching is Watching.NOTHING:
        return LossQuestion.NO
    if watching is Watching.LOSSES:
        if alone:
            return LossQuestion.NO
        return LossQuestion.WAIT_MEMBER_LOST if final else LossQuestion.AFTER_REJOIN
    if changed:
        return LossQuestion.YES
    return LossQuestion.NO if alone else LossQuestion.CHANGED_OR_WAIT


class Action(str, Enum):
    """What the loop does after a turn."""

    CONTINUE = "continue"
    """Nothing: watch the workers again."""
    RESTART_FREE = "restart_free"
    """Restart the workers in a new round without spending a restart."""
    RESTART_SPEND = "restart_spend"
    """Spend one restart, then restart the workers in a new round."""
    FAIL = "fail"
    """Stop the workers; the agent fails with the workers' result."""


@dataclass(frozen=True)
class Verdict:
    """The decision: ``action`` and the ``reason`` the restart is logged and recorded with
    (empty for CONTINUE and FAIL). RESTART_SPEND's reason counts the restart as spent."""

    action: Action
    reason: str


@dataclass(frozen=True)
class Failure:
    """What the loop knows once workers failed.

    ``state``: the workers' state as the reason names it (``FAILED``, ``UNHEALTHY``);
    ``member_lost``: the answer to :func:`loss_question`'s question; ``settled``:
    False when a loss may still show after the restart
    (:attr:`LossQuestion.AFTER_REJOIN`), which then gives a spent restart back.
    ``cause``: what is known of why, for the reason (``kelastic.agent.oom``: ``"rank 1 was
    OOM-killed (...)"``), empty when nothing more than the state is.
    """

    state: str
    member_lost: bool
    remaining_restarts: int
    max_restarts: int
    settled: bool = True
    cause: str = ""


def decide_after_failure(failure: Failure) -> Verdict:
    """Free restart when a member was lost; else spend one while some remain; else fail."""
    if failure.member_lost:
        return Verdict(
            Action.RESTART_FREE,
            "a peer was lost or the membership changed as workers failed; no restart spent",
        )
    if failure.remaining_restarts > 0:
        left = failure.remaining_restarts - 1
        unless = "" if failure.settled else " (given back if a member of the round turns out lost)"
        return Verdict(
            Action.RESTART_SPEND,
            f"workers {failure.state}{f' ({failure.cause})' if failure.cause else ''}; "
            f"{left}/{failure.max_restarts} restarts left after this{unless}",
        )
    return Verdict(Action.FAIL, "")


@dataclass(frozen=True)
class Healthy:
    """What the loop knows while workers run.

    ``changed``: the membership changed during the turn's wait (a watching handler);
    ``nodes_waiting``: ``num_nodes_waiting()`` of a handler that watches nothing
    (0 for one that watches, which is not asked).
    """

    watching: Watching
    changed: bool
    nodes_waiting: int


def decide_while_healthy(healthy: Healthy) -> Verdict:
    """Restart without spending when the group changed; else go on."""
    if healthy.watching is not Watching.NOTHING:
        if healthy.changed:
            return Verdict(Action.RESTART_FREE, "rendezvous membership changed")
    elif healthy.nodes_waiting > 0:
        return Verdict(Action.RESTART_FREE, f"{healthy.nodes_waiting} node(s) waiting to join")
    return Verdict(Action.CONTINUE, "")


#: The longest a joining node is kept waiting for the group's next checkpoint, seconds:
#: a job that saves less often re-forms at once and redoes its steps since the last one.
MAX_JOIN_DEFERRAL = 30.0


@dataclass(frozen=True)
class JoinDeferral:
    """Restart for the joining nodes once a checkpoint newer than ``after`` is committed,
    or after ``within`` seconds, whichever comes first."""

    after: int
    within: float


def defer_join(
    latest: int | None, age: float | None, interval: float | None, cap: float = MAX_JOIN_DEFERRAL
) -> JoinDeferral | None:
    """When nodes wait to join a healthy group: wait for its next checkpoint, or not (None).

    ``latest``, ``age``, ``interval``: the newest committed checkpoint, seconds since
    its commit and seconds between the two latest commits (the checkpoint memory's
    cadence; None where unknown). A group re-formed right after a checkpoint restores
    it and redoes no step; re-formed at once it redoes every step since the last one,
    on every node, while the joiner's wait costs only its own share. The wait is the
    time to the next expected commit plus half an interval of slack, and is not taken
    when the pace is unknown, when saves have stopped (none for two intervals), or
    when it would exceed ``cap``.
    """
    if latest is None or age is None or interval is None or interval <= 0:
        return None
    if age > 2 * interval:
        return None
    within = max(0.0, interval - age) + 0.5 * interval
    if within > cap:
        return None
    return JoinDeferral(after=latest, within=within)

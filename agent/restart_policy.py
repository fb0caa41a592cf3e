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
  changed (a handler that watches it) or nodes wait to join (one that does not).

Whether a member was lost is asked of the rendezvous handler, which may have to
wait for the answer: :func:`loss_question` says which question to ask, if any.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Action",
    "Failure",
    "Healthy",
    "LossQuestion",
    "Verdict",
    "Watching",
    "decide_after_failure",
    "decide_while_healthy",
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


def loss_question(watching: Watching, *, changed: bool, alone: bool) -> LossQuestion:
    """Which question tells whether the workers' failure was the group changing.

    ``changed``: the membership was seen changed in the wait before the failure was
    seen. ``alone``: this node is the only one of its round (no peer could have
    caused it). With :attr:`Watching.LOSSES` only a lost member counts (a peer that
    re-joined after its own failure spends a restart on every agent alike), so
    ``changed`` alone settles nothing.
    """
    if watching is Watching.NOTHING:
        return LossQuestion.NO
    if watching is Watching.LOSSES:
        return LossQuestion.NO if alone else LossQuestion.WAIT_MEMBER_LOST
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
    ``member_lost``: the answer to :func:`loss_question`'s question.
    """

    state: str
    member_lost: bool
    remaining_restarts: int
    max_restarts: int


def decide_after_failure(failure: Failure) -> Verdict:
    """Free restart when a member was lost; else spend one while some remain; else fail."""
    if failure.member_lost:
        return Verdict(
            Action.RESTART_FREE,
            "a peer was lost or the membership changed as workers failed; no restart spent",
        )
    if failure.remaining_restarts > 0:
        left = failure.remaining_restarts - 1
        return Verdict(
            Action.RESTART_SPEND,
            f"workers {failure.state}; {left}/{failure.max_restarts} restarts left after this",
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

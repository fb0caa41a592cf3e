"""The close-wait of a joiner as a pure state machine: what to read, when to close, how long to wait.

After a node took slot ``slot`` of round ``r`` it waits until the round is closed,
closing it itself when it sees the close rule (``protocol.decide_close``) true.
This module decides every move of that wait; the handler only does the I/O:

    state = start(r, slot, deadline, epoch, timeouts)
    while True:
        state, action = step(state, view, time.monotonic())
        ... apply action, gather the next view with its answer ...

``step(state, view, now)`` is pure: the same state, view and instant give the same
next state and action. The handler gathers a :class:`WaitView` before every step
(the watcher's generation and epoch, the round's close as its event told, whether
the job is closed) plus the answer to the action it just applied, and applies the
action the step returns:

- :class:`ReadClose`: read the round's size key (answer ``stored_close``);
- :class:`ReadOpen`: read the ``open`` counter (answer ``open_round``);
- :class:`Observe`: read the close rule's inputs (answer ``observed``);
- :class:`Close`: try to close the round with ``size`` members (first writer wins);
- :class:`AnnounceMin`: push the ``min <r>`` event (the deciders start their timers);
- :class:`Wait`: block until an event newer than ``generation`` or until ``until``;
- :class:`Return`: the round closed so (a member if ``slot < close.size``);
- :class:`Fail`: raise (the job was closed, or ``deadline`` passed).

The rules it encodes (see the handler's module docstring): every joiner evaluates
the close rule once right after its join; afterwards only the *deciders* (slots
below :data:`DECIDERS`) evaluate it on every event and run its timers, the others
every :data:`FALLBACK_EVALUATION` seconds in case every decider died. The size key
is read only when the close event may have been missed (the watcher's epoch
changed or it is disconnected) and on each evaluation but the first.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .protocol import CloseAction, RoundClose, RoundView, TimerKind, decide_close

__all__ = [
    "DECIDERS",
    "FALLBACK_EVALUATION",
    "SUPERSEDED",
    "AnnounceMin",
    "Close",
    "CloseWait",
    "Fail",
    "FailReason",
    "Observe",
    "Phase",
    "ReadClose",
    "ReadOpen",
    "Return",
    "Wait",
    "WaitAction",
    "WaitView",
    "start",
    "step",
]

#: Slots of an open round whose nodes evaluate the close rule on every event, run its
#: timers and sweep the previous round's heartbeats (the *deciders*).
DECIDERS = 3
#: Other waiters evaluate the close rule this often, in case every decider died.
FALLBACK_EVALUATION = 5.0
#: What a joiner returns when ``open`` passed its round while the round never closed:
#: the store restarted and an earlier group re-established a round of that number or
#: later. Size 0, so the joiner is no member and goes on to the next round.
SUPERSEDED = RoundClose(0, "", "")


class Phase(enum.Enum):
    """Which answer the next step expects."""

    LOOK = "look"  # a new pass: the view's cheap facts only
    READ_CLOSE = "read_close"  # ReadClose applied: ``stored_close``
    READ_OPEN = "read_open"  # ReadOpen applied: ``open_round``
    REREAD_CLOSE = "reread_close"  # ReadClose applied after ``open`` passed the round
    OBSERVE = "observe"  # Observe applied: ``observed``
    ANNOUNCED = "announced"  # AnnounceMin applied
    DONE = "done"  # Return or Fail was returned: no further step


class FailReason(enum.Enum):
    JOB_CLOSED = "job_closed"  # RendezvousClosedError
    TIMED_OUT = "timed_out"  # RendezvousTimeoutError: the round did not close by the deadline


@dataclass(frozen=True)
class CloseWait:
    """The state of one close-wait (monotonic instants; see :func:`start`)."""

    round: int
    slot: int
    deadline: float
    timeouts: Mapping[TimerKind, float]
    # The watcher's epoch when the size key was last read, or when the open round was
    # read (then no read is needed while it holds: the close event cannot be missed).
    synced_epoch: int | None
    phase: Phase = Phase.LOOK
    first: bool = True  # the evaluation right after the join is still to come
    timer: TimerKind | None = None
    timer_deadline: float = math.inf
    next_full: float = -math.inf  # when a non-decider evaluates the close rule next
    full: bool = False  # this pass evaluates the close rule
    generation: int = 0  # the watcher's generation at the start of this pass
    expired: int | None = None  # the size to close with after AnnounceMin (a timer ran out)

    @property
    def decider(self) -> bool:
        return self.slot < DECIDERS


@dataclass(frozen=True)
class WaitView:
    """What the handler knows before a step: local facts, and the answer to its last action."""

    generation: int  # the event generation, read first
    epoch: int | None  # the watcher's epoch; None while it is disconnected
    close: RoundClose | None  # the round's close, as its event told (None: not seen)
    job_closed: bool
    stored_close: RoundClose | None = None  # answer to ReadClose
    open_round: int | None = None  # answer to ReadOpen
    observed: RoundView | None = None  # answer to Observe


@dataclass(frozen=True)
class ReadClose:
    """Read the round's size key."""


@dataclass(frozen=True)
class ReadOpen:
    """Read the ``open`` counter."""


@dataclass(frozen=True)
class Observe:
    """Read the close rule's inputs (``own_count`` set: the first evaluation, right after joining)."""

    own_count: int | None
    deep: bool  # make the O(N) check that every listed node joined when the count is complete


@dataclass(frozen=True)
class Close:
    """Try to close the round with ``size`` members."""

    size: int


@dataclass(frozen=True)
class AnnounceMin:
    """Push the round's ``min`` event: this join reached ``min``."""


@dataclass(frozen=True)
class Wait:
    """Block until the event generation differs from ``generation``, or until ``until``."""

    until: float
    generation: int


@dataclass(frozen=True)
class Return:
    close: RoundClose


@dataclass(frozen=True)
class Fail:
    reason: FailReason


WaitAction = ReadClose | ReadOpen | Observe | Close | AnnounceMin | Wait | Return | Fail


def start(
    round: int, slot: int, deadline: float, epoch: int | None, timeouts: Mapping[TimerKind, float]
) -> CloseWait:
    """The wait of the node in ``slot`` of round ``round``.

    ``epoch``: the watcher's epoch when the node read the open round (None: the
    watcher was not connected). ``timeouts``: each timer's length in seconds.
    """
    return CloseWait(round=round, slot=slot, deadline=deadline, timeouts=timeouts, synced_epoch=epoch)


def step(state: CloseWait, view: WaitView, now: float) -> tuple[CloseWait, WaitAction]:
    """The next state and the action to apply (pure). ValueError after Return or Fail."""
    phase = state.phase
    if phase is Phase.LOOK:
        full = state.decider or state.timer is not None or now >= state.next_full
        state = replace(state, generation=view.generation, full=full)
        if view.close is None and (
            (full and not state.first) or view.epoch is None or view.epoch != state.synced_epoch
        ):
            # The close event may have been missed (the watcher was or is disconnected),
            # or this pass evaluates the rule: read the size key.
            return replace(state, synced_epoch=view.epoch, phase=Phase.READ_CLOSE), ReadClose()
        return _settle(state, view.close, view, now)
    if phase is Phase.READ_CLOSE:
        if view.stored_close is None and state.full and not state.first:
            return replace(state, phase=Phase.READ_OPEN), ReadOpen()
        return _settle(state, view.stored_close, view, now)
    if phase is Phase.READ_OPEN:
        if view.open_round is not None and view.open_round >= state.round:
            # ``open`` passed the round with the round not closed: the store restarted, and
            # the members of an earlier group re-established their round there.
            return replace(state, phase=Phase.REREAD_CLOSE), ReadClose()
        return _settle(state, None, view, now)
    if phase is Phase.REREAD_CLOSE:
        return _settle(state, view.stored_close or SUPERSEDED, view, now)
    if phase is Phase.OBSERVE:
        if view.observed is None:
            raise ValueError("the step after Observe needs the observed round")
        return _decide(state, view.observed, now)
    if phase is Phase.ANNOUNCED:
        return _after_timer(replace(state, expired=None), state.expired, now)
    raise ValueError("the close-wait is over (it returned or failed)")


def _settle(
    state: CloseWait, close: RoundClose | None, view: WaitView, now: float
) -> tuple[CloseWait, WaitAction]:
    """The close is known (or known not to be there yet): return, fail, evaluate, or wait."""
    if close is not None:
        return replace(state, phase=Phase.DONE), Return(close)
    if view.job_closed:
        return replace(state, phase=Phase.DONE), Fail(FailReason.JOB_CLOSED)
    if state.full:
        observe = Observe(state.slot + 1, True) if state.first else Observe(None, state.decider)
        return replace(state, next_full=now + FALLBACK_EVALUATION, phase=Phase.OBSERVE), observe
    return _wait_or_fail(state, now)


def _decide(state: CloseWait, view: RoundView, now: float) -> tuple[CloseWait, WaitAction]:
    decision = decide_close(view)
    if decision.action is CloseAction.CLOSE:
        # Then read the outcome (this node's close or another's) on the next pass.
        return replace(state, synced_epoch=None, first=False, phase=Phase.LOOK), Close(decision.size)
    announce = state.first and state.slot + 1 == view.min_nodes
    state = replace(state, first=False)
    expired: int | None = None
    if decision.action is CloseAction.TIMER:
        assert decision.timer is not None
        if state.timer is not decision.timer:
            state = replace(state, timer=decision.timer, timer_deadline=now + state.timeouts[decision.timer])
        if now >= state.timer_deadline:
            expired = min(view.joined, view.max_nodes)
    else:
        state = replace(state, timer=None, timer_deadline=math.inf)
    if announce:
        return replace(state, phase=Phase.ANNOUNCED, expired=expired), AnnounceMin()
    return _after_timer(state, expired, now)


def _after_timer(state: CloseWait, expired: int | None, now: float) -> tuple[CloseWait, WaitAction]:
    if expired is not None:
        return replace(state, synced_epoch=None, phase=Phase.LOOK), Close(expired)
    return _wait_or_fail(state, now)


def _wait_or_fail(state: CloseWait, now: float) -> tuple[CloseWait, WaitAction]:
    if now >= state.deadline:
        return replace(state, phase=Phase.DONE), Fail(FailReason.TIMED_OUT)
    # Woken by the event watcher, which has already read the close event's value.
    until = min(state.deadline, state.timer_deadline)
    if not state.decider:
        until = min(until, state.next_full)
    return replace(state, phase=Phase.LOOK), Wait(until, state.generation)

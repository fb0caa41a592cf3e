"""Pure parts of the rendezvous protocol: the close rule, endpoints, heartbeat judgement, settings."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kelastic.agent.rendezvous import settings_from_params
from kelastic.agent.rendezvous.liveness import HeartbeatTracker
from kelastic.agent.rendezvous.protocol import (
    CloseAction,
    CloseDecision,
    ControllerBounds,
    RoundClose,
    RoundView,
    TimerKind,
    close_event,
    decide_close,
    parse_close_event,
    parse_endpoint,
)


def view(**kw: object) -> RoundView:
    base: dict[str, object] = dict(
        joined=0,
        min_nodes=2,
        max_nodes=4,
        prev_size=0,
        prev_accounted=0,
        controlled=False,
        listed_all_joined=False,
    )
    base.update(kw)
    return RoundView(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (dict(joined=0), CloseDecision(CloseAction.WAIT)),
        (dict(joined=1), CloseDecision(CloseAction.WAIT)),
        # First round: a short last call once min is reached, at once at max.
        (dict(joined=2), CloseDecision(CloseAction.TIMER, timer=TimerKind.LAST_CALL)),
        (dict(joined=4), CloseDecision(CloseAction.CLOSE, size=4)),
        (dict(joined=6), CloseDecision(CloseAction.CLOSE, size=4)),
        # The previous round is intact: arrivals are spares, even at max.
        (dict(joined=5, prev_size=4), CloseDecision(CloseAction.WAIT)),
        # Every old member accounted for: close with whoever is here.
        (dict(joined=3, prev_size=4, prev_accounted=4), CloseDecision(CloseAction.CLOSE, size=3)),
        (
            dict(joined=3, prev_size=4, prev_accounted=2),
            CloseDecision(CloseAction.TIMER, timer=TimerKind.REJOIN),
        ),
        (dict(joined=1, prev_size=4, prev_accounted=4), CloseDecision(CloseAction.WAIT)),
        # A controller: close as soon as its listed nodes joined, no last call.
        (dict(joined=3, controlled=True, listed_all_joined=True), CloseDecision(CloseAction.CLOSE, size=3)),
        (dict(joined=3, controlled=True), CloseDecision(CloseAction.TIMER, timer=TimerKind.CONTROLLER)),
        # A controlled node without the controller's bounds (a store restarted under it):
        # nothing closes, not even at its own max.
        (dict(joined=4, controlled=True, awaiting_controller=True), CloseDecision(CloseAction.WAIT)),
        (
            dict(joined=3, prev_size=4, prev_accounted=4, controlled=True, awaiting_controller=True),
            CloseDecision(CloseAction.WAIT),
        ),
    ],
)
def test_close_rule(kw: dict[str, object], expected: CloseDecision) -> None:
    assert decide_close(view(**kw)) == expected


LOSS = dict(joined=2, max_nodes=3, prev_size=3, prev_accounted=3, prev_gone=1)
HOLD = CloseDecision(CloseAction.TIMER, timer=TimerKind.REJOIN)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # The survivors are back before the standby parked for this round claimed the lost
        # member's place: the round waits for it (the same loss woke it).
        (dict(parked=1), HOLD),
        # It claimed and has not taken its slot yet: still on its way.
        (dict(parked=1, claimed=1), HOLD),
        # It took its slot: the round is at max and closes at once.
        (dict(parked=1, claimed=1, arrived=1, joined=3), CloseDecision(CloseAction.CLOSE, size=3)),
        # No standby parked: the survivors close at once, one smaller.
        (dict(), CloseDecision(CloseAction.CLOSE, size=2)),
        # No member lost (a failure of the group's own): nobody to replace.
        (dict(prev_gone=0, parked=1, joined=3), CloseDecision(CloseAction.CLOSE, size=3)),
        # Two lost, one standby: once it arrived the round closes one smaller than before.
        (dict(prev_gone=2, parked=1, claimed=1, arrived=1), CloseDecision(CloseAction.CLOSE, size=2)),
        # With a controller the listed standby that has not joined holds the round instead.
        (dict(parked=1, controlled=True), CloseDecision(CloseAction.TIMER, timer=TimerKind.CONTROLLER)),
        (dict(parked=1, controlled=True, listed_all_joined=True), CloseDecision(CloseAction.CLOSE, size=2)),
    ],
)
def test_a_round_that_replaces_lost_members_waits_for_the_standbys(
    kw: dict[str, object], expected: CloseDecision
) -> None:
    assert decide_close(view(**{**LOSS, **kw})) == expected


def test_parse_endpoint() -> None:
    assert parse_endpoint("10.0.0.1:1234", 29400) == ("10.0.0.1", 1234)
    assert parse_endpoint("store", 29400) == ("store", 29400)
    assert parse_endpoint("[::1]:5", 29400) == ("::1", 5)
    with pytest.raises(ValueError, match="not a number"):
        parse_endpoint("host:abc", 1)
    with pytest.raises(ValueError, match="outside"):
        parse_endpoint("host:70000", 1)
    with pytest.raises(ValueError, match="empty"):
        parse_endpoint(" ", 1)


def test_heartbeat_tracker_uses_the_observers_clock() -> None:
    tracker = HeartbeatTracker(timeout=1.5)
    assert not tracker.observe("a", 7, now=100.0)
    assert not tracker.observe("a", 7, now=101.0)
    assert not tracker.observe("a", 8, now=101.4)  # moved: the timer restarts
    assert not tracker.observe("a", 8, now=102.8)
    assert tracker.observe("a", 8, now=102.9)
    tracker.retain(set())
    assert not tracker.observe("a", 8, now=200.0)


def test_heartbeat_tracker_judges_nobody_on_a_stalled_observers_few_readings() -> None:
    tracker = HeartbeatTracker(timeout=1.5, min_readings=3)
    assert not tracker.observe("a", 7, now=100.0)
    assert not tracker.observe("a", 7, now=104.0)  # the observer itself stalled for 4 s
    assert not tracker.observe("a", 8, now=104.5)  # the peer was alive all along
    assert not tracker.observe("a", 8, now=105.0)
    assert not tracker.observe("a", 8, now=105.5)
    assert tracker.observe("a", 8, now=106.0)  # four readings over 1.5 s: dead


def test_settings_defaults_and_conf() -> None:
    params = RendezvousParameters(
        "kelastic", "h:1", "run", 1, 3, node_name="me", keep_alive_interval="0.25", keep_alive_max_attempt="4"
    )
    s = settings_from_params(params)
    assert (s.host, s.port, s.node_name, s.node_timeout) == ("h", 1, "me", 1.0)
    assert s.last_call_timeout == 2.0 and s.join_timeout == 600.0
    with pytest.raises(ValueError, match="keep_alive_max_attempt"):
        settings_from_params(RendezvousParameters("kelastic", "h:1", "run", 1, 3, keep_alive_max_attempt="0"))
    with pytest.raises(ValueError, match="join_timeout"):
        settings_from_params(RendezvousParameters("kelastic", "h:1", "run", 1, 3, join_timeout="-1"))


def test_round_close_round_trips_through_its_value_and_its_event() -> None:
    close = RoundClose(4096, "node7", "abc", "fd00::1", 29500)
    assert RoundClose.from_value(close.to_value().encode()) == close
    assert parse_close_event(close_event(12, close).encode()) == (12, close)
    # A size written without the worker store (port 0: members read rank 0's record).
    assert RoundClose.from_value(b"3|n0|tok") == RoundClose(3, "n0", "tok", "", 0)
    for other in (b"closed-job", b"min 3", b"dead 2 n1", b"closed x y"):
        assert parse_close_event(other) is None


@pytest.mark.parametrize(
    ("controlled", "published", "expected"),
    [
        # No controller: the node's own --nnodes.
        (False, None, (2, 3)),
        # The controller's bounds, once published, whatever --nnodes says.
        (False, ControllerBounds(2, 2, 3), (2, 2)),
        (True, ControllerBounds(2, 2, 3), (2, 2)),
        # Controlled, nothing published in this store yet: unknown (the node waits), never
        # --nnodes' maximum, which may be above the controller's (maxReplicas vs replicas).
        (True, None, None),
    ],
)
def test_the_bounds_a_node_acts_on(
    controlled: bool, published: ControllerBounds | None, expected: tuple[int, int] | None
) -> None:
    conf = {"controlled": "1"} if controlled else {}
    s = settings_from_params(RendezvousParameters("kelastic", "h:1", "run", 2, 3, **conf))
    assert s.controlled is controlled
    assert s.bounds(published) == expected


def test_controlled_is_a_boolean() -> None:
    with pytest.raises(ValueError, match="rdzv-conf controlled='maybe' must be one of"):
        settings_from_params(RendezvousParameters("kelastic", "h:1", "run", 1, 3, controlled="maybe"))

"""Lease leader election against a real API server (no kubelet needed); the Lease's time passes on a fake clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from kelastic.operator.clock import SYSTEM, Clock, FakeClock
from kelastic.operator.kube import Kube
from kelastic.operator.leader import LeaderElector


def elector(kube: Kube, identity: str, lease_seconds: int = 15, clock: Clock = SYSTEM) -> LeaderElector:
    short = lease_seconds < 6  # short leases for fast tests: the margins shrink with them
    return LeaderElector(
        kube,
        namespace="default",
        name="kelastic-operator",
        identity=identity,
        lease_seconds=lease_seconds,
        safety_margin=lease_seconds / 4 if short else 2.0,
        renew_every=lease_seconds / 4 if short else 1.5,
        retry_every=0.1 if short else 1.0,
        clock=clock,
    )


def holder(kube: Kube) -> str:
    return kube.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/kelastic-operator")[
        "spec"
    ]["holderIdentity"]


def test_one_holder_at_a_time_and_renewal(kube: Kube) -> None:
    a, b = elector(kube, "a"), elector(kube, "b")
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert a.try_acquire() is True  # renewal
    assert holder(kube) == "a"
    lease = kube.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/kelastic-operator")
    assert lease["spec"]["leaseDurationSeconds"] == 15 and lease["spec"]["renewTime"].endswith("Z")


def test_expired_lease_is_taken_over(kube: Kube) -> None:
    clock = FakeClock()
    a, b = elector(kube, "a", lease_seconds=1, clock=clock), elector(kube, "b", lease_seconds=1, clock=clock)
    assert a.try_acquire()
    clock.advance(1.0)
    assert b.try_acquire() is False  # a Lease of 1 s is not taken at 1 s
    clock.advance(0.1)
    assert b.try_acquire() is True
    assert holder(kube) == "b"
    lease = kube.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/kelastic-operator")
    assert lease["spec"]["leaseTransitions"] == 1


def test_stop_releases_for_a_fast_takeover(kube: Kube) -> None:
    changes: list[bool] = []

    async def scenario() -> None:
        a = elector(kube, "a")
        a.on_change = changes.append
        a.start()
        deadline = time.monotonic() + 10
        while not a.is_leader and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert a.is_leader
        await a.stop()
        assert not a.is_leader

    asyncio.run(scenario())
    assert changes == [True, False]
    assert elector(kube, "b").try_acquire() is True


def test_a_crashed_holder_stops_acting_before_a_candidate_can_take_over(kube: Kube) -> None:
    """No renewals any more (the holder was SIGKILLed): the candidate waits for the Lease to
    expire, and by then the old holder (were it only cut off) no longer trusts its leadership."""
    clock = FakeClock()
    a, b = elector(kube, "a", lease_seconds=2, clock=clock), elector(kube, "b", lease_seconds=2, clock=clock)
    assert a.try_acquire()
    a._set(True)  # what its election loop does with the answer
    assert a.is_leader
    while not b.try_acquire():
        assert clock.monotonic() < 10, "the candidate never took over"
        clock.advance(b.retry_every)
        assert a.is_leader or clock.monotonic() >= 2 - 0.5, "the holder stopped trusting too early"
    assert clock.monotonic() > 2, f"the Lease of 2s was taken over after {clock.monotonic():.2f}s"
    assert not a.is_leader, "two leaders: the old holder still trusted its leadership"
    assert holder(kube) == "b"


def test_default_numbers_take_over_within_seconds_and_keep_a_margin() -> None:
    e = LeaderElector(None, namespace="default", name="x", identity="a")  # type: ignore[arg-type]
    assert e.lease_seconds + e.retry_every <= 8, "a crashed operator's successor waits too long"
    assert e.lease_seconds - e.safety_margin > e.renew_every, "a renewal must fit before trust ends"
    with pytest.raises(ValueError, match="safety margin"):
        LeaderElector(None, namespace="d", name="x", identity="a", lease_seconds=2, safety_margin=2)  # type: ignore[arg-type]

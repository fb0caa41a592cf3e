"""Lease leader election against a real API server (no kubelet needed)."""

from __future__ import annotations

import asyncio
import time

from kelastic.operator.kube import Kube
from kelastic.operator.leader import LeaderElector


def elector(kube: Kube, identity: str, lease_seconds: int = 15) -> LeaderElector:
    return LeaderElector(
        kube, namespace="default", name="kelastic-operator", identity=identity, lease_seconds=lease_seconds
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
    a, b = elector(kube, "a", lease_seconds=1), elector(kube, "b", lease_seconds=1)
    assert a.try_acquire()
    time.sleep(1.6)
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

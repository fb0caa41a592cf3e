"""The rendezvous's heartbeat defaults tolerate the stalls of a real cluster.

A live node whose heartbeat stalls for a few seconds (a CPU-throttled pod, a GC
pause, a kube-proxy hiccup) must not be declared dead: that restarts the whole
job. Crashes do not need a short heartbeat, the peer TCP link reports them at once.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters

from kelastic.agent.rendezvous import settings_from_params
from kelastic.agent.rendezvous.liveness import HeartbeatTracker


def test_a_three_second_stall_is_not_a_death_but_a_frozen_node_is_noticed() -> None:
    settings = settings_from_params(RendezvousParameters("kelastic", "h:1", "run", 1, 3))
    assert (settings.keep_alive_interval, settings.keep_alive_max_attempt) == (1.0, 5)
    tracker = HeartbeatTracker(timeout=settings.node_timeout)
    assert not tracker.observe("stalled", 4, now=100.0)
    assert not tracker.observe("stalled", 4, now=103.0)  # three seconds without a beat: alive
    assert not tracker.observe("stalled", 5, now=103.5)  # beats again
    assert not tracker.observe("frozen", 9, now=100.0)
    assert tracker.observe("frozen", 9, now=100.0 + settings.node_timeout + 0.1)
    assert settings.node_timeout <= 10.0  # a frozen or lost node still goes within seconds

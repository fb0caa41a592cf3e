"""A real node that dies: its containerd, kubelet, kube-router, kube-proxy and containers killed
with SIGKILL at once. The node goes NotReady while the other node's pods go on serving, and
the lane still leaves nothing on the host when it stops.

Needs root, ``make node``, ``make control-plane`` and the netfilter tools; skipped otherwise,
with a reason that says what is missing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .realnode_harness import (
    LISTENER,
    PROBE,
    debian_pod,
    host_snapshot,
    left_behind,
    narrow,
    node_dir_or_skip,
    pod_ip,
    running_lane,
    wait_pods_ready,
)

pytestmark = pytest.mark.slow

#: The control plane's grace for a silent node in this lane (``--node-monitor-grace-period``).
GRACE_S = 20.0


def test_a_killed_node_goes_not_ready_and_is_removed_with_the_lane(
    control_plane_bin: Path, tmp_path: Path
) -> None:
    node_dir = node_dir_or_skip()
    before = host_snapshot(node_dir)
    # A node silent for 20 s reads NotReady (the lane's default waits 60 s): the kubelets post
    # their status every 5 s, so a live node misses four in a row first; one that did would
    # still run its pods, and the probe below goes to them directly.
    with running_lane(control_plane_bin, tmp_path, node_monitor_grace=GRACE_S) as lane:
        n1, n2 = lane.node_names()
        assert lane.nodes.plan is not None
        slot = lane.nodes.plan.slot
        lane.apply(
            debian_pod("a", "default", n1, {"app": "a"}, LISTENER, ["8080"]),
            debian_pod("b", "default", n1, {"app": "b"}, LISTENER),
            debian_pod("c", "default", n2, {"app": "c"}, LISTENER, ["8080"]),
        )
        wait_pods_ready(lane, ["default"])
        a, c = pod_ip(lane, "default", "a"), pod_ip(lane, "default", "c")
        killed = lane.nodes.kill_node(n2)
        assert len(killed) >= 5, (
            f"containerd, a shim, the kubelet, kube-router, kube-proxy at least: {killed}"
        )
        started = time.monotonic()
        ready = "True"
        while ready == "True" and time.monotonic() - started < GRACE_S + 90:
            time.sleep(1)
            ready = lane.kubectl(
                "get", "node", n2, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
            )
        print(f"node {n2} Ready={ready} {time.monotonic() - started:.0f} s after its processes were killed")
        assert ready == "Unknown", f"the kubelet is dead but node {n2} still reads Ready={ready}"
        out = lane.kubectl("exec", "b", "--", "python3", "-c", PROBE, json.dumps([[a, 8080], [c, 8080]]))
        assert json.loads(out.strip().splitlines()[-1]) == [True, False], out
    before, after = narrow(before, slot), narrow(host_snapshot(node_dir), slot)
    leftovers = left_behind(before, after)
    assert not leftovers, json.dumps(leftovers, indent=1)

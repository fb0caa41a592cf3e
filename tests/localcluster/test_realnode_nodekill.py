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
    narrow,
    node_dir_or_skip,
    pod_ip,
    running_lane,
    wait_pods_ready,
)

pytestmark = pytest.mark.slow


def test_a_killed_node_goes_not_ready_and_is_removed_with_the_lane(
    control_plane_bin: Path, tmp_path: Path
) -> None:
    node_dir = node_dir_or_skip()
    before = host_snapshot(node_dir)
    with running_lane(control_plane_bin, tmp_path) as lane:
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
        while ready == "True" and time.monotonic() - started < 150:
            time.sleep(2)
            ready = lane.kubectl(
                "get", "node", n2, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
            )
        print(f"node {n2} Ready={ready} {time.monotonic() - started:.0f} s after its processes were killed")
        assert ready == "Unknown", f"the kubelet is dead but node {n2} still reads Ready={ready}"
        out = lane.kubectl("exec", "b", "--", "python3", "-c", PROBE, json.dumps([[a, 8080], [c, 8080]]))
        assert json.loads(out.strip().splitlines()[-1]) == [True, False], out
    before, after = narrow(before, slot), narrow(host_snapshot(node_dir), slot)
    assert after == before, json.dumps(
        {k: (before[k], after[k]) for k in before if before[k] != after[k]}, indent=1
    )

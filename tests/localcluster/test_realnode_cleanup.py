"""A real-node lane killed with SIGKILL leaves nothing on the host: its janitor removes the
nodes' processes and containers, mounts, network namespaces (their iptables, nftables and
ipsets), the bridge, the guard table, the cgroups, and restores the kernel settings.

Needs root, ``make node``, ``make control-plane`` and the netfilter tools; skipped otherwise,
with a reason that says what is missing.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .realnode_harness import LISTENER, debian_pod, host_snapshot, left_behind, narrow, node_dir_or_skip

pytestmark = pytest.mark.slow


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="")
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_sigkill_of_the_lane_leaves_nothing_behind(control_plane_bin: Path, tmp_path: Path) -> None:
    node_dir = node_dir_or_skip()
    before = host_snapshot(node_dir)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kelastic.localcluster.node", f"--control-plane={control_plane_bin}",
         "--nodes=2", f"--state-dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines, kubeconfig, slot = _lines(proc), "", -1
        while True:
            try:
                line = lines.get(timeout=max(1.0, 400 - (time.monotonic() - started)))
            except queue.Empty:
                pytest.fail("the lane did not print `ready` within 400 s")
            if found := re.match(r"kelastic: lane (\d+): ", line):
                slot = int(found.group(1))
            if "export KUBECONFIG=" in line:
                kubeconfig = line.split("=", 1)[1]
            if line == "ready":
                break
        kubectl = [str(control_plane_bin / "kubectl"), f"--kubeconfig={kubeconfig}"]
        pods = [
            debian_pod(f"p{i}", "default", f"kelastic-node-{i}", {"app": "p"}, LISTENER, ["8080"])
            for i in (1, 2)
        ]
        subprocess.run([*kubectl, "apply", "-f", "-"], input="\n---\n".join(json.dumps(p) for p in pods),
                       check=True, text=True, capture_output=True)  # fmt: skip
        subprocess.run([*kubectl, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=180s"],
                       check=True, capture_output=True, timeout=240)  # fmt: skip
        during = narrow(host_snapshot(node_dir), slot)
        # The snapshot sees the lane: otherwise "nothing left" below would prove nothing.
        assert during["netns"] and during["links"] and during["mounts"] and during["processes"], during
        assert during["cgroups"], during
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    janitor_log = tmp_path / "logs" / "janitor.log"
    deadline = time.monotonic() + 180
    while "cleaned" not in (janitor_log.read_text() if janitor_log.exists() else ""):
        assert time.monotonic() < deadline, f"the janitor did not finish within 180 s: {janitor_log}"
        time.sleep(0.5)
    before, after = narrow(before, slot), narrow(host_snapshot(node_dir), slot)
    print(f"SIGKILL to clean host: janitor log:\n{janitor_log.read_text()}")
    assert "left behind" not in janitor_log.read_text()
    leftovers = left_behind(before, after)
    assert not leftovers, json.dumps(leftovers, indent=1)

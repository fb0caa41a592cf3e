"""What the real-node lane's tests share: a running lane (the real control plane and real nodes)
and kubectl against it. Importing this module does not start anything."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kelastic.localcluster.controlplane.controlplane import ControlPlane, ControlPlaneBinaries
from kelastic.localcluster.node.checks import missing
from kelastic.localcluster.node.images import DEBIAN_IMAGE
from kelastic.localcluster.node.lane import NodeBinaries, RealNodeLane, default_node_dir

ENABLE = (
    " To run the lane: `make node` (and `make control-plane`), then as root: "
    "`python -m pytest -m slow tests/localcluster/test_realnode_lane.py`"
)


def node_dir_or_skip() -> Path:
    """``make node``'s directory; skips the test, saying what is missing, when the lane cannot run."""
    node_dir = default_node_dir()
    why = missing(node_dir)
    if why:
        pytest.skip(why + "." + ENABLE)
    return node_dir


@dataclass
class Lane:
    """A running lane: the control plane, the nodes, and kubectl as its admin."""

    control_plane: ControlPlane
    nodes: RealNodeLane
    kubectl_bin: Path

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        argv = [str(self.kubectl_bin), f"--kubeconfig={self.control_plane.admin_kubeconfig}", *args]
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done.stdout

    def apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin="\n---\n".join(json.dumps(o) for o in objects))

    def node_names(self) -> list[str]:
        assert self.nodes.plan is not None
        return [n.name for n in self.nodes.plan.nodes]


@contextmanager
def running_lane(control_plane_bin: Path, state: Path, nodes: int = 2) -> Iterator[Lane]:
    """Start the control plane and ``nodes`` real nodes; stop and check the host is clean after."""
    node_dir = node_dir_or_skip()
    started = time.monotonic()
    lane = RealNodeLane(NodeBinaries.find(node_dir), nodes=nodes, logs_dir=state / "logs", progress=print)
    cp: ControlPlane | None = None
    try:
        lane.prepare()
        cp = ControlPlane(
            binaries=ControlPlaneBinaries.find(control_plane_bin),
            state_dir=state / "control-plane",
            progress=print,
            **lane.control_plane_settings(),
        )
        cp.start()
        lane.start(cp)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in lane.timings.items())
        print(f"real-node lane setup: {time.monotonic() - started:.1f} s ({phases})")
        yield Lane(cp, lane, control_plane_bin / "kubectl")
    finally:
        left = lane.stop()
        if cp is not None:
            cp.stop()
    assert not left, f"the lane left behind: {left} (janitor log: {state / 'logs' / 'janitor.log'})"


def debian_pod(
    name: str,
    namespace: str,
    node: str,
    labels: dict[str, str],
    program: str,
    args: Sequence[str] = (),
) -> dict[str, Any]:
    """A pod on ``node`` running ``python3 -c program args...`` in the lane's Debian image."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": DEBIAN_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", program, *args],
                }
            ],
        },
    }


#: Serves ``ok`` on every port named in its arguments.
LISTENER = """
import socket, sys, threading
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        try:
            c.sendall(b"ok\\n")
        except OSError:
            pass
        c.close()
ports = [int(p) for p in sys.argv[1:]]
for p in ports[1:]:
    threading.Thread(target=serve, args=(p,), daemon=True).start()
serve(ports[0]) if ports else threading.Event().wait()
"""

#: Connects to every ``[ip, port]`` of its JSON argument at once; prints which answered ``ok``.
PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def probe(target):
    try:
        with socket.create_connection((target[0], target[1]), timeout=3) as s:
            s.settimeout(3)
            return s.recv(3) == b"ok\\n"
    except OSError:
        return False
targets = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(list(pool.map(probe, targets))))
"""


def wait_pods_ready(lane: Lane, namespaces: Sequence[str], timeout: float = 180) -> None:
    for ns in namespaces:
        lane.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod", "--all", f"--timeout={int(timeout)}s",
                     timeout=timeout + 30)  # fmt: skip


def pod_ip(lane: Lane, namespace: str, name: str) -> str:
    return lane.kubectl("get", "pod", "-n", namespace, name, "-o", "jsonpath={.status.podIP}").strip()


LOG_LINKS = "/var/log/containers"
DEFAULT_PATHS = (
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/run/containerd",
    "/var/lib/cni",
    "/etc/cni/net.d",
    "/var/lib/kube-router",
    "/run/kube-router",
    "/var/log/pods",
)


def host_snapshot(node_dir: Path) -> dict[str, Any]:
    """What a lane could leave on the host, narrowed to what carries its names (others run
    beside it on a shared machine): links, namespaces, nftables tables, ipsets, iptables rules,
    mounts, cgroups, kernel settings and the processes of ``make node``'s binaries."""
    from kelastic.localcluster.node import hostops

    def out(*argv: str) -> list[str]:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done.stdout.splitlines()

    ours = ("kelastic", "kel0", "kel1", "kel2", "kel3", "kel4", "kel5", "kel6", "kel7", "kel8", "kel9")
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    processes = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if exe.startswith(str(node_dir)):
                processes.append(f"{pid} {exe}")
    cgroups = [str(p) for h in hostops.hierarchies() for p in h.rglob("kelastic-[0-9]")]
    return {
        "links": sorted(
            line.split(":")[1].strip() for line in out("ip", "-o", "link") if any(o in line for o in ours)
        ),
        "netns": sorted(line for line in out("ip", "netns", "list") if "kelastic" in line),
        "nft tables": sorted(
            line for line in out("nft", "list", "tables") if "kelastic" in line or "kube" in line
        ),
        "ipsets": sorted(line for line in out("ipset", "list", "-n") if "kube" in line.lower()),
        "iptables": sorted(line for line in out("iptables-save") if "KUBE-" in line or "kelastic" in line),
        "mounts": sorted(m for m in mounts if "kelastic-node" in m or "/run/netns/kelastic" in m),
        "cgroups": sorted(cgroups),
        "sysctls": {name: hostops.sysctl(name) for name in hostops.SYSCTLS},
        "processes": sorted(processes),
        # The fixed paths a kubelet, containerd, the CNI plugins and kube-router use by default.
        "paths": {path: sorted(os.listdir(path)) if os.path.isdir(path) else None for path in DEFAULT_PATHS},
        "log links": sorted(
            name
            for name in (os.listdir(LOG_LINKS) if os.path.isdir(LOG_LINKS) else [])
            if "kelastic-node" in os.path.realpath(os.path.join(LOG_LINKS, name))
        ),
    }

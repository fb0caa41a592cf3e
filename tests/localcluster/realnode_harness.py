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
from kelastic.localcluster.node.diskspace import NotEnoughSpace
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


#: A file each lane appends its timings to (CI sets it, and prints it after the suite: pytest
#: keeps a passing test's output to itself).
REPORT_VARIABLE = "KELASTIC_LANE_REPORT"


def report(line: str) -> None:
    """Append one line on the lane's cost to ``$KELASTIC_LANE_REPORT``, where set."""
    path = os.environ.get(REPORT_VARIABLE)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(
                f"real-node lane ({os.environ.get('PYTEST_CURRENT_TEST', '?').split('::')[0]}): {line}\n"
            )


@contextmanager
def running_lane(
    control_plane_bin: Path,
    state: Path,
    nodes: int = 2,
    images: Sequence[Path] = (),
    node_monitor_grace: float | None = None,
) -> Iterator[Lane]:
    """Start the control plane and ``nodes`` real nodes (with ``images``, OCI tars or layouts, in
    each node's containerd besides the lane's own); stop and check the host is clean after.
    ``node_monitor_grace``: the control plane's seconds before a silent node reads NotReady
    (None: its default)."""
    node_dir = node_dir_or_skip()
    started = time.monotonic()
    lane = RealNodeLane(
        NodeBinaries.find(node_dir), nodes=nodes, logs_dir=state / "logs", progress=print,
        extra_images=tuple(images),
    )  # fmt: skip
    cp: ControlPlane | None = None
    setup, ready = "", started
    try:
        lane.prepare()
        cp = ControlPlane(
            binaries=ControlPlaneBinaries.find(control_plane_bin),
            state_dir=state / "control-plane",
            progress=print,
            **lane.control_plane_settings(),
            **({} if node_monitor_grace is None else {"node_monitor_grace": node_monitor_grace}),
        )
        cp.start()
        try:
            lane.start(cp)
        except NotEnoughSpace as exc:  # a missing prerequisite, as a missing binary is
            pytest.skip(f"the real-node lane cannot run here: {exc}")
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in lane.timings.items())
        setup = f"setup ({'cold' if lane.cold else 'warm'}) {time.monotonic() - started:.1f} s ({phases})"
        print(f"real-node lane {setup}")
        ready = time.monotonic()
        yield Lane(cp, lane, control_plane_bin / "kubectl")
    finally:
        used = time.monotonic()
        lane.stop_components()  # their watches would hold the API server's shutdown
        if cp is not None:  # before the bridge, which its own requests on the way out use
            cp.stop()
        left = lane.stop()
        if setup:
            report(f"{setup}, tests {used - ready:.1f} s, stop {time.monotonic() - used:.1f} s")
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
    """What a lane could leave on the host: links, namespaces, nftables tables, ipsets, iptables
    rules, mounts, cgroups, kernel settings, the processes of ``make node``'s binaries, the
    components' default paths. :func:`narrow` keeps what one lane's slot names (other lanes
    may run beside it on a shared machine)."""
    from kelastic.localcluster.node import hostops
    from kelastic.localcluster.node.plan import SLOTS

    def out(*argv: str) -> list[str]:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done.stdout.splitlines()

    processes = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
                cgroup = Path(f"/proc/{pid}/cgroup").read_text().replace("\n", " ")
            except OSError:
                continue
            if exe.startswith(str(node_dir)):
                processes.append(f"{pid} {exe} {cgroup}")
    links = os.listdir(LOG_LINKS) if os.path.isdir(LOG_LINKS) else []
    return {
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in out("ip", "-o", "link")),
        "netns": sorted(line.split()[0] for line in out("ip", "netns", "list") if line.strip()),
        "nft tables": sorted(out("nft", "list", "tables")),
        "ipsets": sorted(line for line in out("ipset", "list", "-n") if "kube" in line.lower()),
        "iptables": sorted(line for line in out("iptables-save") if "KUBE-" in line or "kelastic" in line),
        "mounts": sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()),
        "cgroups": sorted(
            str(p) for h in hostops.hierarchies(unified=True) for p in h.rglob("kelastic-[0-9]")
        ),
        "sysctls": {name: hostops.sysctl(name) for name in hostops.SYSCTLS},
        "processes": sorted(processes),
        # The fixed paths a kubelet, containerd, the CNI plugins and kube-router use by default.
        "paths": {path: sorted(os.listdir(path)) if os.path.isdir(path) else None for path in DEFAULT_PATHS},
        "log links": sorted(os.path.realpath(os.path.join(LOG_LINKS, name)) for name in links),
        "held slots": [slot for slot in range(SLOTS) if _held(slot)],
    }


def _held(slot: int) -> bool:
    import fcntl

    from kelastic.localcluster.node.hostops import STATE_DIR

    path = STATE_DIR / f"slot-{slot}.lock"
    if not path.exists():
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def narrow(snapshot: dict[str, Any], slot: int) -> dict[str, Any]:
    """What of ``snapshot`` lane ``slot`` could have made (and the host-wide leaks any lane could)."""
    from kelastic.localcluster.node.lane import ROOT_BASE
    from kelastic.localcluster.node.plan import LanePlan

    plan = LanePlan.make(slot, 9, root_base=ROOT_BASE, cgroup_parent="/")
    names = {plan.bridge, *(n.host_veth for n in plan.nodes), *(n.netns for n in plan.nodes)}
    root = f"{plan.root}/"
    mine = dict(snapshot)
    mine["links"] = [n for n in snapshot["links"] if n in names or n.startswith(f"kel{slot}n")]
    mine["netns"] = [n for n in snapshot["netns"] if n.startswith(f"kelastic-{slot}-")]
    mine["nft tables"] = [
        t for t in snapshot["nft tables"] if t.endswith(f" {plan.nft_table}") or "kube" in t
    ]
    mine["mounts"] = [
        m for m in snapshot["mounts"] if m.startswith(root) or f"/run/netns/kelastic-{slot}-" in m
    ]
    mine["cgroups"] = [c for c in snapshot["cgroups"] if c.endswith(f"/kelastic-{slot}")]
    mine["processes"] = [p for p in snapshot["processes"] if f"/kelastic-{slot}/" in p]
    mine["log links"] = [t for t in snapshot["log links"] if t.startswith(root)]
    others = [s for s in snapshot.get("held slots", []) if s != slot]
    mine.pop("held slots", None)
    if others:  # another lane's kubelets may hold the host's settings changed: not ours to judge
        mine.pop("sysctls")
    return mine


def left_behind(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What differs between two :func:`narrow` snapshots, as ``{part: (before, after)}``, over the
    parts both judged (another lane starting or stopping in between leaves the settings out of one)."""
    return {k: (before[k], after[k]) for k in before.keys() & after.keys() if before[k] != after[k]}

"""The real control plane and N real nodes in the foreground, until stopped.

::

    kelastic local up --control-plane DIR --real-nodes N [--node-dir DIR] [--state-dir DIR]
    python -m kelastic.localcluster.node --control-plane DIR [--nodes 2] [--node-dir DIR] [--state-dir DIR]

Prints the kubeconfig's path and ``ready`` once every node is Ready, then runs until Ctrl-C or
SIGTERM; everything is removed at exit, and by the lane's janitor when this process is killed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..controlplane.controlplane import ControlPlane, ControlPlaneBinaries
from .checks import missing
from .lane import NodeBinaries, RealNodeLane, default_node_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kelastic.localcluster.node", description=__doc__)
    parser.add_argument("--control-plane", type=Path, required=True, help="make control-plane's directory")
    parser.add_argument("--nodes", type=int, default=2, help="real nodes to start (default 2)")
    parser.add_argument(
        "--node-dir", type=Path, default=None, help="make node's directory (default: its cache)"
    )
    parser.add_argument("--state-dir", type=Path, default=None, help="logs and the control plane's state")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    node_dir = args.node_dir or default_node_dir()
    why = missing(node_dir)
    if why:
        print(f"kelastic: {why}", file=sys.stderr)
        return 2
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="kelastic-nodes-"))
    say = lambda line: print(f"kelastic: {line}", flush=True)  # noqa: E731
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    lane = RealNodeLane(NodeBinaries.find(node_dir), nodes=args.nodes, logs_dir=state / "logs", progress=say)
    cp: ControlPlane | None = None
    try:
        lane.prepare()
        cp = ControlPlane(
            binaries=ControlPlaneBinaries.find(args.control_plane),
            state_dir=state / "control-plane",
            progress=say,
            **lane.control_plane_settings(),
        )
        cp.start()
        lane.start(cp)
        say(
            f"setup ({'cold' if lane.cold else 'warm'}) {time.monotonic() - started:.1f} s: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in lane.timings.items())
        )
        print(f"  export KUBECONFIG={cp.admin_kubeconfig}", flush=True)
        print("ready", flush=True)
        while not stop.wait(1.0):
            if failed := lane.failed():
                say("a node component exited:\n" + "\n".join(failed))
                return 1
        return 0
    finally:
        lane.stop_components()  # their watches would hold the API server's shutdown
        if cp is not None:  # before the bridge, which its own requests on the way out use
            cp.stop()
        left = lane.stop()
        say("everything removed" if not left else f"left behind: {left}")

"""The lane's janitor: removes everything a real-node lane made, however the lane ended.

A lane starts its janitor first (``python -m kelastic.localcluster.node.janitor``), in a
session of its own and holding the lane's slot lock, with a pipe on its standard input. The
janitor waits for that pipe to close: the lane closes it on a normal stop, and the kernel
closes it when the lane dies, SIGKILL included. It then removes, in this order:

1. every process of the lane's cgroups (frozen, then SIGKILLed): the nodes' containerd,
   shims, kubelets, kube-routers, kube-proxies and every container;
2. every mount below the lane's directory (containers' root filesystems, volumes, the pods'
   network namespaces) and the nodes' ``/run/netns`` entries;
3. the nodes' network namespaces (their iptables, nftables and ipsets go with them), the
   veths, the host bridge (its routes go with it) and the host's guard table;
4. the lane's cgroups in every hierarchy (v1, and the v2 one of a hybrid layout), the
   kubelets' links in ``/var/log/containers``, and the lane's directory;
5. once no other lane is running, the host's kernel settings the kubelets changed, and the
   fixed host paths the components make (``hostops.FIXED_PATHS``) that were absent before.

:func:`clean` is the same work as a function (idempotent); it returns what it could not
remove, which the janitor prints as its last lines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from . import hostops, network
from .plan import SLOTS, LanePlan

__all__ = ["clean", "main"]

#: Where every kubelet links its containers' logs, whatever its root directory.
CONTAINER_LOG_LINKS = Path("/var/log/containers")


def clean(lane: LanePlan) -> list[str]:
    """Remove everything of ``lane`` (see the module docstring); what is left, one line each."""
    left: list[str] = []
    try:
        hostops.kill_cgroup(lane.cgroup)
    except RuntimeError as exc:
        left.append(str(exc))
    netns_paths = [f"/run/netns/{node.netns}" for node in lane.nodes]
    left += [f"mount {p}" for p in hostops.unmount_under([str(lane.root)])]
    left += network.tear_down(lane)
    left += [f"mount {p}" for p in hostops.mounts_under(netns_paths)]
    left += [f"cgroup {p}" for p in hostops.remove_cgroup(lane.cgroup)]
    left += [f"link {p}" for p in _remove_log_links(lane.root)]
    shutil.rmtree(lane.root, ignore_errors=True)
    if lane.root.exists():
        left.append(f"directory {lane.root}")
    if not hostops.other_slots_held(SLOTS, lane.slot):
        hostops.restore_sysctls()
        left += [f"path {p}" for p in hostops.remove_fixed_paths()]
    return left


def _remove_log_links(root: Path) -> list[Path]:
    """The kubelets' links in /var/log/containers (a fixed path) into the lane; those left."""
    left = []
    for link in CONTAINER_LOG_LINKS.glob("*.log"):
        try:
            if link.is_symlink() and os.readlink(link).startswith(f"{root}/"):
                link.unlink()
        except OSError:
            left.append(link)
    return left


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kelastic.localcluster.node.janitor")
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--root-base", type=Path, required=True)
    parser.add_argument("--cgroup-parent", required=True)
    parser.add_argument(
        "--now", action="store_true", help="clean at once instead of waiting for stdin to close"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    lane = LanePlan.make(args.slot, args.nodes, root_base=args.root_base, cgroup_parent=args.cgroup_parent)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the lane's end is stdin closing, nothing else
    if not args.now:
        while os.read(0, 4096):
            pass
    left = clean(lane)
    for line in left:
        print(f"janitor: left behind: {line}", flush=True)
    print(f"janitor: lane {lane.slot} cleaned{'' if not left else f' ({len(left)} left)'}", flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())

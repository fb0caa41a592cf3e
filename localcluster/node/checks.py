"""Whether real nodes can run on this machine, and if not, what is missing and how to fix it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import hostops, images
from .lane import NodeBinaries

__all__ = ["TOOLS", "missing"]

#: Host commands the lane runs (Debian package in brackets where the name differs).
TOOLS = {
    "ip": "iproute2",
    "nft": "nftables",
    "iptables": "iptables",
    "ipset": "ipset",
    "conntrack": "conntrack",
    "tar": "tar",
    "mount": "mount",
}


def missing(node_dir: Path) -> str | None:
    """Why a lane cannot start here (one sentence per gap, each saying how to close it), or None."""
    gaps = []
    if os.geteuid() != 0:
        gaps.append(
            "not root (it makes network namespaces, a bridge, nftables rules, cgroups): run it as root"
        )
    absent = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if absent:
        gaps.append(f"the netfilter and network tools are missing: apt-get install -y {' '.join(absent)}")
    if not hostops.hierarchies():
        gaps.append(
            "cgroup v1 hierarchies under /sys/fs/cgroup (the pinned kubelet, containerd and runc use them)"
        )
    try:
        NodeBinaries.find(node_dir)
    except FileNotFoundError as exc:
        gaps.append(str(exc))
    if not images.debian_layer_path().is_file() and shutil.which("debootstrap") is None:
        gaps.append("no debootstrap to make the Debian image once: apt-get install -y debootstrap")
    if not gaps:
        return None
    return "the real-node lane cannot run here: " + "; ".join(gaps)

"""The lane's network on the host: one bridge, a network namespace per node, routes, a guard.

:func:`guard_rules` and :func:`setup_commands` are pure (the ``ip``/``nft`` commands, in
order); :func:`set_up` runs them and :func:`tear_down` removes what they made. Layout and
addresses are :mod:`.plan`'s. What keeps the lane's traffic on this machine:

- the pods' only route is the lane's ``/16`` through their node (no default route, see
  :func:`~kelastic.localcluster.node.configs.cni_conflist`), the nodes have no default route
  either, and nothing masquerades;
- the host routes each node's pod range to that node and the Service range to node 1 (its
  kube-proxy translates a ClusterIP for the host's own clients), nothing else;
- the host's nftables table ``inet kelastic_<slot>`` drops whatever would be forwarded from the
  bridge to another interface, or from another interface onto the bridge.
"""

from __future__ import annotations

import contextlib
import subprocess

from .hostops import HostCommandFailed, run
from .plan import LanePlan

__all__ = ["guard_rules", "set_up", "setup_commands", "tear_down"]


def guard_rules(lane: LanePlan) -> str:
    """The nftables script of the host's guard table (``nft -f -``)."""
    br = lane.bridge
    return (
        f"table inet {lane.nft_table} {{\n"
        "  chain forward {\n"
        "    type filter hook forward priority -10; policy accept;\n"
        f'    iifname "{br}" oifname != "{br}" counter drop comment "kelastic lane: nothing leaves the bridge"\n'
        f'    oifname "{br}" iifname != "{br}" counter drop comment "kelastic lane: nothing enters the bridge"\n'
        "  }\n"
        "}\n"
    )


def setup_commands(lane: LanePlan) -> list[tuple[str | None, list[str]]]:
    """``(netns or None, argv)`` in order: the bridge, each node's namespace, veth and routes."""
    br = lane.bridge
    prefix = lane.node_network.prefixlen
    cmds: list[tuple[str | None, list[str]]] = [
        (None, ["ip", "link", "add", br, "type", "bridge"]),
        (None, ["ip", "addr", "add", f"{lane.host_address}/{prefix}", "dev", br]),
        (None, ["ip", "link", "set", br, "up"]),
    ]
    for node in lane.nodes:
        ns = node.netns
        cmds += [
            (None, ["ip", "netns", "add", ns]),
            (None, ["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", node.node_veth]),
            (None, ["ip", "link", "set", node.node_veth, "netns", ns]),
            (None, ["ip", "link", "set", node.host_veth, "master", br, "up"]),
            (ns, ["ip", "link", "set", node.node_veth, "name", "eth0"]),
            (ns, ["ip", "addr", "add", f"{node.address}/{prefix}", "dev", "eth0"]),
            (ns, ["ip", "link", "set", "eth0", "up"]),
            (ns, ["ip", "link", "set", "lo", "up"]),
            # The node routes for its pods (per namespace: the host's setting is untouched).
            (ns, ["sysctl", "-qw", "net.ipv4.ip_forward=1"]),
            (None, ["ip", "route", "add", str(node.pod_cidr), "via", str(node.address), "dev", br]),
        ]
        for other in lane.nodes:
            if other is not node:
                cmds.append((ns, ["ip", "route", "add", str(other.pod_cidr), "via", str(other.address)]))
    cmds.append(
        (
            None,
            ["ip", "route", "add", str(lane.service_network), "via", str(lane.nodes[0].address), "dev", br],
        )
    )
    return cmds


def set_up(lane: LanePlan) -> None:
    """Make the lane's network (raises HostCommandFailed; :func:`tear_down` removes any part)."""
    _nft(guard_rules(lane))
    for netns, argv in setup_commands(lane):
        run(argv, netns=netns)
    # br_netfilter per namespace: bridged pod-to-pod traffic of one node goes through its
    # iptables, where kube-router enforces the NetworkPolicies.
    for node in lane.nodes:
        run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], netns=node.netns, check=False)


def _nft(script: str) -> None:
    try:
        done = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise HostCommandFailed(f"nft: {exc} (apt-get install -y nftables)") from exc
    if done.returncode != 0:
        raise HostCommandFailed(f"nft -f - failed ({done.returncode}): {done.stderr.strip()}\n{script}")


def tear_down(lane: LanePlan) -> list[str]:
    """Remove the namespaces, veths, bridge and guard table; what could not be removed."""
    left = []
    for node in lane.nodes:
        run(["ip", "netns", "delete", node.netns], check=False)
        run(["ip", "link", "delete", node.host_veth], check=False)
    run(["ip", "link", "delete", lane.bridge], check=False)
    run(["nft", "delete", "table", "inet", lane.nft_table], check=False)
    with contextlib.suppress(HostCommandFailed):
        links = run(["ip", "-o", "link", "show"]).stdout
        names = {lane.bridge, *(n.host_veth for n in lane.nodes)}
        left += [f"link {name}" for name in names if f": {name}:" in links or f": {name}@" in links]
        namespaces = run(["ip", "netns", "list"]).stdout.split()
        left += [f"netns {n.netns}" for n in lane.nodes if n.netns in namespaces]
        if run(["nft", "list", "table", "inet", lane.nft_table], check=False).returncode == 0:
            left.append(f"nft table inet {lane.nft_table}")
    return left

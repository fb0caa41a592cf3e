"""Names, addresses and paths of one real-node lane (pure).

A lane is N real nodes beside one control plane on this machine. Each node is a network
namespace of its own (``kelastic-<slot>-n<i>``) joined by a veth to one host bridge
(``kelastic-br<slot>``): its containerd, kubelet, kube-router and kube-proxy run inside it,
so two nodes' iptables, ipsets and nftables never meet, and every pod of a node hangs off
that node's own CNI bridge. The slot (0-9) keeps lanes that run at the same time apart:
``10.<210+slot>.0.0/16`` holds everything of one lane:

- ``10.S.0.0/24``: the node network on the host bridge; the host (the control plane) is
  ``.1``, node ``i`` is ``.(10+i)``;
- ``10.S.i.0/24``: node ``i``'s pods (``i`` from 1), its CNI bridge ``.1``;
- ``10.S.255.0/24``: the Service range (the ``kubernetes`` Service is ``10.S.255.1``).

Nothing of it is routed beyond the machine: the pods' only route is ``10.S.0.0/16`` through
their node, the nodes have no default route, and the host drops whatever would leave the
bridge for another interface.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_NODES", "SLOTS", "LanePlan", "NodePlan"]

#: Lanes that may run at once on one machine (each takes a slot, 10.210-219.0.0/16).
SLOTS = 10
#: Nodes per lane (pod CIDRs 10.S.1.0/24 ... 10.S.MAX.0/24 stay below the Service range).
MAX_NODES = 100
FIRST_OCTET = 10
SECOND_OCTET_BASE = 210


@dataclass(frozen=True)
class NodePlan:
    """One node of a lane."""

    index: int
    name: str
    netns: str
    #: The veth pair: the host end (on the bridge) and the node end, renamed ``eth0`` inside.
    host_veth: str
    node_veth: str
    address: ipaddress.IPv4Address
    pod_cidr: ipaddress.IPv4Network
    #: Where its containerd, kubelet and CNI keep their state (removed with the lane).
    root: Path
    #: Its cgroup, relative to each hierarchy's root (the kubelet's ``cgroupRoot``).
    cgroup: str

    @property
    def pod_gateway(self) -> ipaddress.IPv4Address:
        """The node's CNI bridge address, the pods' gateway to the rest of the lane."""
        return self.pod_cidr.network_address + 1

    @property
    def runtime_cgroup(self) -> str:
        """Where the node's own processes run (containerd, its shims, the kubelet ...)."""
        return f"{self.cgroup}/runtime"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"


@dataclass(frozen=True)
class LanePlan:
    """Everything one lane creates on the host, so that it can all be removed again."""

    slot: int
    bridge: str
    network: ipaddress.IPv4Network
    node_network: ipaddress.IPv4Network
    service_network: ipaddress.IPv4Network
    #: The host's address on the bridge: the control plane binds and advertises it.
    host_address: ipaddress.IPv4Address
    #: The host's nftables table holding the lane's guard rules.
    nft_table: str
    #: Everything on disk that the lane makes and removes (containerd roots, sockets).
    root: Path
    #: The lane's cgroup, relative to each hierarchy's root.
    cgroup: str
    nodes: tuple[NodePlan, ...]

    @classmethod
    def make(cls, slot: int, nodes: int, *, root_base: Path, cgroup_parent: str) -> LanePlan:
        """The plan of lane ``slot`` with ``nodes`` nodes; ValueError for a slot or count out of range."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} is out of range 0-{SLOTS - 1}")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"{nodes} nodes: a lane has 1 to {MAX_NODES}")
        second = SECOND_OCTET_BASE + slot
        network = ipaddress.IPv4Network(f"{FIRST_OCTET}.{second}.0.0/16")
        node_network = ipaddress.IPv4Network(f"{FIRST_OCTET}.{second}.0.0/24")
        root = root_base / str(slot)
        cgroup = f"{cgroup_parent.rstrip('/')}/kelastic-{slot}"
        plans = tuple(
            NodePlan(
                index=i,
                name=f"kelastic-node-{i}",
                netns=f"kelastic-{slot}-n{i}",
                host_veth=f"kel{slot}n{i}h",
                node_veth=f"kel{slot}n{i}c",
                address=node_network.network_address + 10 + i,
                pod_cidr=ipaddress.IPv4Network(f"{FIRST_OCTET}.{second}.{i}.0/24"),
                root=root / f"n{i}",
                cgroup=f"{cgroup}/n{i}",
            )
            for i in range(1, nodes + 1)
        )
        return cls(
            slot=slot,
            bridge=f"kelastic-br{slot}",
            network=network,
            node_network=node_network,
            service_network=ipaddress.IPv4Network(f"{FIRST_OCTET}.{second}.255.0/24"),
            host_address=node_network.network_address + 1,
            nft_table=f"kelastic_{slot}",
            root=root,
            cgroup=cgroup,
            nodes=plans,
        )

    def node(self, name: str) -> NodePlan:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name} in lane {self.slot}")

"""The configuration files of one real node (pure renderers).

- containerd v2 (``config.toml``): its root, state and sockets under the node's directory;
  overlayfs; the locally built pause image pinned as the sandbox image (nothing is pulled);
  ``restrict_oom_score_adj`` (root here may lack CAP_SYS_RESOURCE, and every container
  would otherwise fail on ``oom_score_adj``); AppArmor off; runc with cgroupfs; the pods'
  network namespaces and its shims' sockets kept under the node's directory, so that removing
  the node finds them.
- the kubelet (``KubeletConfiguration``): cgroup v1 allowed (``failCgroupV1: false``: the
  machines this runs on have v1 only), the cgroupfs driver under the node's own cgroup, its
  server on the node's address with a serving certificate of the cluster CA and the API
  server's client certificate required (``kubectl logs`` and ``exec`` work), no eviction
  thresholds and no image garbage collection (a lane is short and its images are local).
- the CNI network (``conflist``): bridge + host-local + portmap, no masquerade, and no
  default route in the pods: one route to the lane's ``/16`` through the node.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .plan import LanePlan, NodePlan

__all__ = ["PAUSE_IMAGE", "cni_conflist", "containerd_config", "kubelet_config"]

#: The sandbox image's name; the lane imports its own build of it under this name.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
CNI_BRIDGE = "cni0"


def _toml_str(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def containerd_config(node: NodePlan, *, runc: Path, cni_bin: Path) -> str:
    """containerd v2.4's ``config.toml`` (version 3) for ``node``."""
    root = node.root / "containerd"
    return "\n".join(
        [
            "version = 3",
            f"root = {_toml_str(root / 'root')}",
            f"state = {_toml_str(root / 'state')}",
            "[grpc]",
            f"  address = {_toml_str(node.containerd_socket)}",
            "[ttrpc]",
            f"  address = {_toml_str(str(node.containerd_socket) + '.ttrpc')}",
            "[debug]",
            "  level = 'info'",
            "[plugins]",
            # The shims' sockets beside the node's state, not in /run/containerd/s.
            "  [plugins.'io.containerd.shim.v1.manager']",
            f"    socket_dir = {_toml_str(node.root / 's')}",
            "  [plugins.'io.containerd.cri.v1.images']",
            "    snapshotter = 'overlayfs'",
            "    [plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"      sandbox = {_toml_str(PAUSE_IMAGE)}",
            "  [plugins.'io.containerd.cri.v1.runtime']",
            "    restrict_oom_score_adj = true",
            "    disable_apparmor = true",
            "    netns_mounts_under_state_dir = true",
            "    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]",
            "      runtime_type = 'io.containerd.runc.v2'",
            "      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]",
            f"        BinaryName = {_toml_str(runc)}",
            f"        Root = {_toml_str(node.root / 'runc')}",
            "        SystemdCgroup = false",
            "    [plugins.'io.containerd.cri.v1.runtime'.cni]",
            f"      bin_dirs = [{_toml_str(cni_bin)}]",
            f"      conf_dir = {_toml_str(node.root / 'cni' / 'net.d')}",
            "  [plugins.'io.containerd.grpc.v1.cri']",
            "    stream_server_address = '127.0.0.1'",
            "",
        ]
    )


def kubelet_config(node: NodePlan, *, ca_file: Path, serving_cert: Path, serving_key: Path) -> dict[str, Any]:
    """The kubelet's ``KubeletConfiguration`` for ``node`` (written as JSON, which is YAML)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "podLogsDir": str(node.root / "kubelet" / "logs"),
        "address": str(node.address),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(serving_cert),
        "tlsPrivateKeyFile": str(serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "resolvConf": "",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "evictionHard": {},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "localStorageCapacityIsolation": False,
        "serializeImagePulls": False,
    }


def cni_conflist(lane: LanePlan, node: NodePlan) -> dict[str, Any]:
    """The node's CNI network: its pods on its own bridge, routed through it to the lane only."""
    return {
        "cniVersion": "1.0.0",
        "name": "kelastic",
        "plugins": [
            {
                "type": "bridge",
                "bridge": CNI_BRIDGE,
                # The bridge gets the gateway address (the node routes for its pods) but the
                # pods get no default route: only the lane's /16 below.
                "isGateway": True,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(node.pod_cidr), "gateway": str(node.pod_gateway)}]],
                    "dataDir": str(node.root / "cni" / "ipam"),
                    "routes": [{"dst": str(lane.network)}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }

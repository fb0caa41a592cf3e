"""How the kubelet runs pods: :class:`KubeletConfig` (a LocalCluster or a test makes one)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..common.ipam import POD_NETWORK
from .images import ImageMap

__all__ = ["DEFAULT_NODE_NAME", "KubeletConfig"]

DEFAULT_NODE_NAME = "kelastic-local"


@dataclass
class KubeletConfig:
    """How the kubelet runs pods."""

    data_dir: Path
    node_name: str = DEFAULT_NODE_NAME
    #: Working directory of containers that set no ``workingDir``.
    workdir: Path = field(default_factory=Path.cwd)
    host_ip: str = "127.0.0.1"
    backoff_base: float = 10.0
    backoff_cap: float = 300.0
    #: Grace given to pods when the kubelet itself shuts down.
    shutdown_grace: float = 2.0
    #: Seconds a deleted pod's logs are kept before its directory is removed.
    log_retention: float = 60.0
    #: Where pod IPs come from (a LocalCluster passes the block it claimed).
    pod_network: ipaddress.IPv4Network = POD_NETWORK
    #: Environment every container starts from (the current one by default:
    #: containers are processes of this Python environment).
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    #: Bind unscheduled pods to this node (the emulator has no scheduler); with a
    #: real kube-scheduler the kubelet only runs the pods bound to it.
    bind_pods: bool = True
    #: The API server as pods reach it (``https://127.0.0.1:PORT``): sets
    #: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the service-account kubeconfig.
    #: None for the emulator (plain http: in-cluster clients cannot use it).
    api_url: str | None = None
    #: The port of the kubelet's log server, published in the Node's daemonEndpoints (0: none).
    kubelet_port: int = 0
    #: How often the node's Lease and Ready heartbeat are renewed.
    heartbeat_s: float = 10.0
    #: The version the Node reports (that of the control plane, when there is a real one).
    version: str = "v1.37.2-kelastic"
    #: Which interpreter plays which image (unlisted images: this Python environment).
    images: ImageMap = field(default_factory=ImageMap)
    #: The node's ``nvidia.com/gpu`` count; None: detected (see :func:`~.gpus.detect_gpus`).
    gpus: int | None = None
    #: The node's cpu capacity and allocatable (a quantity: ``2``, ``1500m``); None: the machine's
    #: cores. Only the scheduler counts it: pods are not limited to it.
    cpus: str | None = None

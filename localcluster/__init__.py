"""kelastic local: a Kubernetes API server emulator and a process kubelet on one machine."""

from .apiserver import ApiServer
from .cluster import LocalCluster
from .endpoints import EndpointsController
from .errors import ApiError
from .kubelet import DEFAULT_NODE_NAME, Kubelet, KubeletConfig, pod_log_dir
from .proxy import ServiceProxy

__all__ = [
    "DEFAULT_NODE_NAME",
    "ApiError",
    "ApiServer",
    "EndpointsController",
    "Kubelet",
    "KubeletConfig",
    "LocalCluster",
    "ServiceProxy",
    "pod_log_dir",
]

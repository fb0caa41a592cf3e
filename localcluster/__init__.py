"""kelastic local: a Kubernetes API server emulator and a process kubelet on one machine."""

from .apiserver.apiserver import ApiServer
from .apiserver.errors import ApiError
from .cli.cluster import LocalCluster
from .common.podlogs import pod_log_dir
from .controllers.proxy import ServiceProxy
from .kubelet.kubelet import DEFAULT_NODE_NAME, Kubelet, KubeletConfig

__all__ = [
    "DEFAULT_NODE_NAME",
    "ApiError",
    "ApiServer",
    "Kubelet",
    "KubeletConfig",
    "LocalCluster",
    "ServiceProxy",
    "pod_log_dir",
]

"""kelastic local: a Kubernetes API server emulator and a process kubelet on one machine.

Needs the ``local`` extra (``pip install 'kelastic[local]'``). The names below are loaded
when first used, so that importing the package (as the ``kelastic`` command does first)
needs nothing of the extra: the command then says which extra is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each public name lives.
_HOMES = {
    "ApiServer": ".apiserver.apiserver",
    "ApiError": ".apiserver.errors",
    "LocalCluster": ".cli.cluster",
    "pod_log_dir": ".common.podlogs",
    "ServiceProxy": ".controllers.proxy",
    "DEFAULT_NODE_NAME": ".kubelet.kubelet",
    "Kubelet": ".kubelet.kubelet",
    "KubeletConfig": ".kubelet.kubelet",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value

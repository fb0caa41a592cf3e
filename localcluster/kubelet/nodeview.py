"""What a pod's worker, its containers and the preemption see of their kubelet.

:class:`KubeletView` is the part of :class:`~.kubelet.Kubelet` they use: the node's
configuration, its API client, the pods it knows, its address and GPU ledgers, the
Events it posts and the API reads it makes for a pod. The kubelet satisfies it; those
modules import this one, never the kubelet's, so the kubelet's module can import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..common.client import ApiClient
from ..common.ipam import IpAllocator
from .config import KubeletConfig
from .gpus import GpuLedger
from .satokens import IssuedToken

__all__ = ["KubeletView"]


class KubeletView(Protocol):
    """The kubelet as the pods it runs see it."""

    client: ApiClient
    config: KubeletConfig
    ipam: IpAllocator
    gpus: GpuLedger
    #: The pods the kubelet knows, by ``namespace/name``.
    pods: dict[str, dict[str, Any]]
    #: The pod workers, by pod UID; the workers waiting for GPUs (both of type PodWorker).
    workers: dict[str, Any]
    gpu_waiters: set[Any]
    stopping: bool

    async def bind(self, pod: Mapping[str, Any]) -> None: ...

    def event(
        self,
        pod: Mapping[str, Any],
        reason: str,
        message: str,
        warning: bool = False,
        component: str = "kubelet",
    ) -> None: ...

    def release_gpus(self, uid: str) -> None: ...

    def forget_events(self, uid: str) -> None: ...

    async def fetch_sources(
        self, namespace: str, pod: Mapping[str, Any], container: Mapping[str, Any]
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]: ...

    async def fetch_tokens(self, pod: Mapping[str, Any]) -> dict[str, IssuedToken]: ...

    async def request_token(
        self, pod: Mapping[str, Any], volume: str, request: Mapping[str, Any]
    ) -> IssuedToken: ...

    def in_cluster_env(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path], pod_dir: Path
    ) -> dict[str, str]: ...

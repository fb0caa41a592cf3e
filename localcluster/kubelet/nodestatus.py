"""The node as the API sees it: its Node object and its Lease, kept fresh.

:class:`NodeStatus` registers the node (capacity: cpu, memory, pods and the GPUs; its
addresses, the kubelet's log port, Ready), renews its Lease in ``kube-node-lease`` and
the Ready condition's heartbeat every ``heartbeat_s``, so the node never goes NotReady,
and registers it again when it was deleted. API servers without nodes or Leases are
tolerated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import time

from ..common.client import ApiClient, ApiRequestError
from .config import KubeletConfig
from .gpus import GPU_RESOURCE
from .podstatus import rfc3339

__all__ = ["LEASE_DURATION_S", "NodeStatus", "micro_time"]

log = logging.getLogger(__name__)

#: The node Lease's duration, as a real kubelet sets it.
LEASE_DURATION_S = 40


class NodeStatus:
    """The node's Node object and Lease; ``gpus`` is the node's ``nvidia.com/gpu`` count."""

    def __init__(self, client: ApiClient, config: KubeletConfig, gpus: int) -> None:
        self.client = client
        self.config = config
        self.gpus = gpus
        self._node_uid = ""
        self._ready_since = ""

    async def heartbeat_loop(self) -> None:
        """Renew the node Lease and the Ready condition's heartbeat, so the node stays Ready."""
        lease_served = True
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if lease_served:
                try:
                    await self.renew_lease()
                except ApiRequestError as exc:
                    lease_served = exc.status != 404  # an API server without node Leases
                    if lease_served:
                        log.warning("could not renew the node lease of %s: %s", self.config.node_name, exc)
                except Exception as exc:
                    log.debug("could not renew the node lease: %s", exc)
            try:
                await self.client.request(
                    "PATCH",
                    f"/api/v1/nodes/{self.config.node_name}/status",
                    body={"status": {"conditions": [self._ready_condition()]}},
                    content_type="application/strategic-merge-patch+json",
                )
            except ApiRequestError as exc:
                if exc.status == 415:  # no strategic merge: the whole condition list then
                    with contextlib.suppress(Exception):
                        await self.client.merge_patch(
                            f"/api/v1/nodes/{self.config.node_name}/status",
                            {"status": {"conditions": [self._ready_condition()]}},
                        )
                elif exc.status == 404:
                    await self.register()  # deleted under us: register again
                else:
                    log.warning("could not post the node status of %s: %s", self.config.node_name, exc)
            except Exception as exc:
                log.debug("could not post the node status: %s", exc)

    async def renew_lease(self) -> None:
        """Create or renew ``kube-node-lease/<node>`` (coordination.k8s.io/v1)."""
        name = self.config.node_name
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        renew = micro_time(time.time())
        try:
            await self.client.merge_patch(path, {"spec": {"holderIdentity": name, "renewTime": renew}})
        except ApiRequestError as exc:
            if exc.status != 404:
                raise
            await self.client.post(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [
                            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self._node_uid}
                        ]
                        if self._node_uid
                        else [],
                    },
                    "spec": {
                        "holderIdentity": name,
                        "leaseDurationSeconds": LEASE_DURATION_S,
                        "renewTime": renew,
                    },
                },
            )

    def _ready_condition(self) -> dict[str, str]:
        now = rfc3339(time.time())
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kelastic local kubelet is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": self._ready_since or now,
        }

    async def register(self) -> None:
        """Create (or refresh) this node's Node object and Lease; servers without nodes are tolerated."""
        now = rfc3339(time.time())
        self._ready_since = self._ready_since or now
        cpus = self.config.cpus or str(os.cpu_count() or 1)
        try:
            memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 1024}Ki"
        except (ValueError, OSError):
            memory = "0"
        capacity = {"cpu": cpus, "memory": memory, "pods": "1000"}
        if self.gpus:  # as a device plugin registers them: only where there are some
            capacity[GPU_RESOURCE] = str(self.gpus)
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.config.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.config.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": platform.machine(),
                },
            },
            "spec": {},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [
                    {"type": "InternalIP", "address": self.config.host_ip},
                    {"type": "Hostname", "address": self.config.node_name},
                ],
                "conditions": [self._ready_condition()],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.config.kubelet_port}},
                "nodeInfo": {
                    "kubeletVersion": self.config.version,
                    "containerRuntimeVersion": "kelastic-process://1",
                    "operatingSystem": "linux",
                    "architecture": platform.machine(),
                    "osImage": platform.platform(),
                    "kernelVersion": platform.release(),
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kubeProxyVersion": "",
                },
            },
        }
        try:
            created = await self.client.post("/api/v1/nodes", node)
            self._node_uid = str(created.get("metadata", {}).get("uid", ""))
        except ApiRequestError as exc:
            if exc.status == 409:
                with contextlib.suppress(ApiRequestError):
                    current = await self.client.merge_patch(
                        f"/api/v1/nodes/{self.config.node_name}/status", {"status": node["status"]}
                    )
                    self._node_uid = str(current.get("metadata", {}).get("uid", ""))
            elif exc.status in (401, 403):
                raise RuntimeError(
                    f"the API server refused to register node {self.config.node_name}: {exc}"
                ) from exc
            else:
                log.debug("node registration not supported by the API server: %s", exc)
        with contextlib.suppress(ApiRequestError):
            await self.renew_lease()


def micro_time(t: float) -> str:
    """A ``MicroTime`` (RFC 3339 with microseconds), as Lease ``renewTime`` requires."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"

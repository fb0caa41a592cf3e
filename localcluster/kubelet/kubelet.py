"""The process kubelet: runs the pods of the one local node as local processes.

A client of the API server like a real node agent: it watches pods, binds
unscheduled ones to its node (it is the scheduler too), and for each pod bound
to it runs one :class:`~.podworker.PodWorker` (the pod's lifecycle; each container's
run, exit, restart and probes are :mod:`.containers`) that

- holds the GPUs the pod requests (``nvidia.com/gpu``; the pod waits, Pending,
  while too few are free) and names them to its containers as the NVIDIA device
  plugin does (see :mod:`kelastic.localcluster.kubelet.gpus`),
- gives the pod an address in ``127.1.0.0/16`` (``status.podIP``),
- prepares its volumes (see :mod:`kelastic.localcluster.kubelet.volumes`),
- runs the init containers one after another, then the containers, each as a
  process group of the current Python environment (see
  :mod:`kelastic.localcluster.kubelet.podenv` for env and argv), logging to
  ``<data_dir>/pods/<namespace>_<pod>_<uid>/<container>/<restartCount>.log``,
- restarts exited containers per ``restartPolicy`` with exponential back-off
  (``CrashLoopBackOff``), runs startup/readiness/liveness probes,
- writes the status a real kubelet writes (phase, conditions, container
  statuses) and posts Events,
- on graceful deletion (``deletionTimestamp``) sends SIGTERM to every
  container's process group, waits up to the grace period, sends SIGKILL, then
  deletes the pod with grace period 0; when the pod disappears at once (force
  deletion) it kills the processes immediately.

The kubelet is level-based: every pod event only wakes the pod's worker, which
compares what runs with what the latest pod object asks for.

One implementation for both API servers: against the emulator it also binds
pods (``KubeletConfig.bind_pods``); against a real control plane the scheduler
binds them and the kubelet watches only the pods of its node. Either way it
registers its Node, renews the node's Lease in ``kube-node-lease`` and the
Ready condition's heartbeat, so the node never goes NotReady (:mod:`.nodestatus`). Service-account
tokens are mounted as the API server asks (the token Secret volume of
Kubernetes 1.20, projected volumes with a TokenRequest token of current
releases); since a mount path such as
``/var/run/secrets/kubernetes.io/serviceaccount`` cannot be honoured on a
shared filesystem, a container that mounts the token gets ``KUBECONFIG``
naming a kubeconfig with that token, plus ``KUBERNETES_SERVICE_HOST``/``PORT``
pointing at the API server's loopback address, so in-cluster clients (kopf,
the official client) authenticate as the pod's ServiceAccount.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..common.client import ApiClient, ApiRequestError, Informer
from ..common.ipam import IpAllocator
from ..common.podlogs import pod_log_dir
from .config import DEFAULT_NODE_NAME, KubeletConfig
from .gpus import GpuLedger, detect_gpus
from .kubeconfigs import SERVICE_ACCOUNT_KUBECONFIG, write_token_kubeconfig
from .nodestatus import NodeStatus
from .podstatus import (
    rfc3339,
)
from .podworker import PodWorker
from .satokens import DEFAULT_EXPIRATION_S, IssuedToken, issued_token
from .volumes import token_key

__all__ = ["DEFAULT_NODE_NAME", "Kubelet", "KubeletConfig"]

log = logging.getLogger(__name__)

#: Where Kubernetes mounts a pod's service-account credentials.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class Kubelet:
    """Runs the pods bound to one node; create, ``await start()``, ``await stop()`` in one loop."""

    def __init__(self, client: ApiClient, config: KubeletConfig) -> None:
        self.client = client
        self.config = config
        self.ipam = IpAllocator(config.pod_network)
        #: The node's GPUs and which pod holds which (see :mod:`~.gpus`).
        self.gpus = GpuLedger(detect_gpus(config.gpus))
        #: The node's Node object and Lease, kept fresh (see :mod:`~.nodestatus`).
        self.node = NodeStatus(client, config, len(self.gpus.devices))
        #: Pod workers waiting for GPUs, woken when some are released.
        self.gpu_waiters: set[PodWorker] = set()
        self.pods: dict[str, dict[str, Any]] = {}
        self.workers: dict[str, PodWorker] = {}
        # With a scheduler, only this node's pods concern us (and the Node authorizer
        # lets a node see them); without one, unscheduled pods are ours to bind.
        params = {} if config.bind_pods else {"fieldSelector": f"spec.nodeName={config.node_name}"}
        self._informer = Informer(client, "/api/v1/pods", self._on_pod, params)
        self._heartbeat: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        #: Events posted per pod UID: (reason, message, warning) → (event name, count).
        self._events: dict[str, dict[tuple[str, str, bool], tuple[str, int]]] = {}
        self.stopping = False

    async def start(self, timeout: float = 30.0) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        await self.node.register()
        self._heartbeat = asyncio.get_running_loop().create_task(
            self.node.heartbeat_loop(), name="node heartbeat"
        )
        self._informer.start()
        try:
            await asyncio.wait_for(self._informer.synced.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the kubelet could not list pods from {self.client.base_url} within {timeout}s"
            ) from None

    async def stop(self) -> None:
        """Stop watching and kill every pod process (SIGTERM, a short grace, SIGKILL)."""
        self.stopping = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        await self._informer.stop()
        workers = list(self.workers.values())
        await asyncio.gather(
            *(w._kill_all(self.config.shutdown_grace) for w in workers), return_exceptions=True
        )
        for w in workers:
            if w.task is not None:
                w.task.cancel()
        await asyncio.gather(*(w.task for w in workers if w.task is not None), return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _on_pod(self, etype: str, key: str, pod: dict[str, Any]) -> None:
        if etype == "DELETED":
            current = self.pods.get(key)
            if current is not None and current["metadata"].get("uid") == pod["metadata"].get("uid"):
                del self.pods[key]
        else:
            self.pods[key] = pod
        uid = pod["metadata"].get("uid", "")
        worker = self.workers.get(uid)
        if worker is not None:
            worker.wake.set()
            return
        if etype == "DELETED" or self.stopping:
            return
        node = pod["spec"].get("nodeName")
        if node != self.config.node_name and (node or not self.config.bind_pods):
            return  # another node's, or waiting for the scheduler
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and not pod["metadata"].get(
            "deletionTimestamp"
        ):
            return  # finished before this kubelet started: nothing to run
        worker = PodWorker(self, uid, key)
        self.workers[uid] = worker
        worker.task = asyncio.get_running_loop().create_task(worker.run(), name=f"pod {key}")

    def release_gpus(self, uid: str) -> None:
        """Free a pod's GPUs (call only once its processes are gone) and wake the pods waiting."""
        if self.gpus.release(uid):
            for waiter in list(self.gpu_waiters):
                waiter.wake.set()

    # -- API helpers ----------------------------------------------------------
    async def bind(self, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": ns, "uid": meta.get("uid")},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.config.node_name},
        }
        try:
            await self.client.post(f"/api/v1/namespaces/{ns}/pods/{name}/binding", binding)
        except ApiRequestError as exc:
            if exc.status == 409:
                return  # already bound
            # Servers without the binding subresource: set the field directly.
            await self.client.merge_patch(
                f"/api/v1/namespaces/{ns}/pods/{name}", {"spec": {"nodeName": self.config.node_name}}
            )
        self.pods.setdefault(f"{ns}/{name}", dict(pod))["spec"]["nodeName"] = self.config.node_name

    async def fetch_sources(
        self, namespace: str, pod: Mapping[str, Any], container: Mapping[str, Any]
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """The configmaps and secrets the container or the pod's volumes refer to, by name."""
        wanted: dict[str, set[str]] = {"configmaps": set(), "secrets": set()}
        for source in container.get("envFrom") or []:
            if source.get("configMapRef"):
                wanted["configmaps"].add(source["configMapRef"].get("name", ""))
            if source.get("secretRef"):
                wanted["secrets"].add(source["secretRef"].get("name", ""))
        for var in container.get("env") or []:
            ref = var.get("valueFrom") or {}
            if ref.get("configMapKeyRef"):
                wanted["configmaps"].add(ref["configMapKeyRef"].get("name", ""))
            if ref.get("secretKeyRef"):
                wanted["secrets"].add(ref["secretKeyRef"].get("name", ""))
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            if vol.get("configMap"):
                wanted["configmaps"].add(vol["configMap"].get("name", ""))
            if vol.get("secret"):
                wanted["secrets"].add(vol["secret"].get("secretName", ""))
            for source in (vol.get("projected") or {}).get("sources") or []:
                if source.get("configMap"):
                    wanted["configmaps"].add(source["configMap"].get("name", ""))
                if source.get("secret"):
                    wanted["secrets"].add(source["secret"].get("name", ""))
        found: dict[str, dict[str, dict[str, str]]] = {"configmaps": {}, "secrets": {}}
        for resource, names in wanted.items():
            for name in names:
                try:
                    obj = await self.client.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
                except ApiRequestError as exc:
                    if exc.status == 404:
                        continue
                    raise
                found[resource][name] = dict(obj.get("data") or {})
        return found["configmaps"], found["secrets"]

    async def fetch_tokens(self, pod: Mapping[str, Any]) -> dict[str, IssuedToken]:
        """Tokens for the pod's projected ``serviceAccountToken`` sources, by :func:`token_key`."""
        tokens: dict[str, IssuedToken] = {}
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            for source in (vol.get("projected") or {}).get("sources") or []:
                request = source.get("serviceAccountToken")
                if request is not None:
                    issued = await self.request_token(pod, str(vol.get("name", "")), request)
                    tokens[token_key(issued.volume, issued.path)] = issued
        return tokens

    async def request_token(
        self, pod: Mapping[str, Any], volume: str, request: Mapping[str, Any]
    ) -> IssuedToken:
        """A token for one ``serviceAccountToken`` source of ``pod``'s ``volume``.

        Requested through the ServiceAccount's ``token`` subresource (TokenRequest),
        bound to the pod like a real kubelet's, so they die with it.
        """
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace", "default")
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        seconds = int(request.get("expirationSeconds") or DEFAULT_EXPIRATION_S)
        body: dict[str, Any] = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [request["audience"]] if request.get("audience") else [],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta.get("name"),
                    "uid": meta.get("uid"),
                },
            },
        }
        answer = await self.client.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", body
        )
        return issued_token(volume, str(request.get("path", "token")), answer, seconds, time.time())

    def in_cluster_env(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path], pod_dir: Path
    ) -> dict[str, str]:
        """What in-cluster clients of this container need to reach the API server.

        ``KUBERNETES_SERVICE_HOST``/``PORT`` name the API server's loopback address
        (the ``kubernetes`` Service's ClusterIP is not routed here). A container that
        mounts service-account credentials also gets ``KUBECONFIG``: the mount path
        cannot be honoured on a shared filesystem, so the token is handed over as a
        kubeconfig, which kopf and the official client fall back to.
        """
        if not self.config.api_url:
            return {}
        host_port = self.config.api_url.split("://", 1)[-1]
        host, _, port = host_port.rpartition(":")
        env = {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host_port}",
        }
        for mount in container.get("volumeMounts") or []:
            if (
                mount.get("mountPath", "").rstrip("/") != SERVICE_ACCOUNT_DIR
                or mount.get("name") not in volumes
            ):
                continue
            source = volumes[mount["name"]]
            token_file, ca_file = source / "token", source / "ca.crt"
            if not token_file.is_file():
                break
            kubeconfig = pod_dir / SERVICE_ACCOUNT_KUBECONFIG
            write_token_kubeconfig(
                kubeconfig,
                self.config.api_url,
                token_file.read_text().strip(),
                ca_file if ca_file.is_file() else None,
                str((pod.get("metadata") or {}).get("namespace", "default")),
            )
            env["KUBECONFIG"] = str(kubeconfig)
            break
        return env

    def event(
        self,
        pod: Mapping[str, Any],
        reason: str,
        message: str,
        warning: bool = False,
        component: str = "kubelet",
    ) -> None:
        """Post a core/v1 Event about ``pod`` in the background (best effort), from ``component``
        (the kubelet, or the scheduler whose part it plays without one).

        A repeat of the same reason and message for the same pod bumps the first
        Event's ``count`` and ``lastTimestamp`` instead of adding another, as the
        kubelet's event recorder does (a crash loop shows as one line, xN).
        """
        meta = pod.get("metadata") or {}
        ns = meta.get("namespace", "default")
        uid = str(meta.get("uid", ""))
        now = rfc3339(time.time())
        key = (reason, message, warning)
        seen = self._events.setdefault(uid, {})
        collection = f"/api/v1/namespaces/{ns}/events"
        if key in seen:
            name, count = seen[key]
            seen[key] = (name, count + 1)
            request = self.client.merge_patch(
                f"{collection}/{name}", {"count": count + 1, "lastTimestamp": now}
            )
        else:
            name = f"{meta.get('name')}.{uuid.uuid4().hex[:16]}"
            seen[key] = (name, 1)
            request = self.client.post(
                collection,
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": name, "namespace": ns},
                    "involvedObject": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta.get("name"),
                        "namespace": ns,
                        "uid": uid,
                    },
                    "reason": reason,
                    "message": message,
                    "type": "Warning" if warning else "Normal",
                    "source": {"component": component, "host": self.config.node_name}
                    if component == "kubelet"
                    else {"component": component},
                    "reportingComponent": component,
                    "reportingInstance": self.config.node_name,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "count": 1,
                },
            )

        async def send() -> None:
            with contextlib.suppress(Exception):
                await request

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget_events(self, uid: str) -> None:
        self._events.pop(uid, None)

    def locate_logs(
        self, namespace: str, name: str, container: str
    ) -> tuple[Path, Callable[[int], bool]] | None:
        """Where a container's logs are, and whether its run number N still writes (for the log server)."""
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is not None:
            uid = str(pod["metadata"].get("uid", ""))
            folder = pod_log_dir(self.config.data_dir, namespace, name, uid) / container
        else:  # deleted: its logs are kept a while
            candidates = sorted(
                (self.config.data_dir / "pods").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime
            )
            if not candidates:
                return None
            folder, uid = candidates[-1] / container, ""

        def running(index: int) -> bool:
            worker = self.workers.get(uid)
            if worker is None:
                return False
            return any(
                c.name == container and c.running and c.record.restart_count == index
                for c in worker.all_containers()
            )

        return folder, running

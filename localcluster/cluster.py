"""``LocalCluster``: a whole single-machine Kubernetes in one object.

Composes the API server with the node components that are its clients over
HTTP: the kubelet (which also schedules), the endpoints controller and the
service proxy. Those run in one background thread with their own event loop;
the pod processes are children of that thread, so they receive SIGKILL if the
process dies without :meth:`LocalCluster.stop`.

::

    with LocalCluster(data_dir) as cluster:
        subprocess.run(["kubectl", "--kubeconfig", cluster.kubeconfig, "get", "pods"])

What is not emulated: cluster DNS (reach services by their cluster IP), node
resources (requests and limits are recorded, not enforced), image pulls (the
image is recorded; containers are processes of the current Python environment).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from .client import ApiClient
from .endpoints import EndpointsController
from .ipam import NetworkClaim, claim_networks
from .kubelet import DEFAULT_NODE_NAME, Kubelet, KubeletConfig
from .proxy import ServiceProxy

__all__ = ["LocalCluster"]

T = TypeVar("T")


class LocalCluster:
    """API server + kubelet + endpoints controller + service proxy.

    ``data_dir`` holds pod logs and volumes; ``state_dir`` (optional) persists
    the API objects across restarts; ``kubeconfig`` is where the kubeconfig is
    written (default ``<data_dir>/kubeconfig``). ``backoff_base``/``backoff_cap``
    tune the CrashLoopBackOff delays (10 s / 300 s like a real kubelet).
    """

    def __init__(
        self,
        data_dir: Path | str,
        port: int = 0,
        state_dir: Path | str | None = None,
        kubeconfig: Path | str | None = None,
        *,
        host: str = "127.0.0.1",
        node_name: str = DEFAULT_NODE_NAME,
        workdir: Path | str | None = None,
        backoff_base: float = 10.0,
        backoff_cap: float = 300.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.host = host
        self.state_dir = Path(state_dir).resolve() if state_dir is not None else None
        self.kubeconfig = Path(kubeconfig).resolve() if kubeconfig else self.data_dir / "kubeconfig"
        self.kubelet_config = KubeletConfig(
            data_dir=self.data_dir,
            node_name=node_name,
            workdir=Path(workdir).resolve() if workdir else Path.cwd(),
            backoff_base=backoff_base,
            backoff_cap=max(backoff_cap, backoff_base),
        )
        self.apiserver: Any = None
        self.kubelet: Kubelet | None = None
        self._client: ApiClient | None = None
        self._endpoints: EndpointsController | None = None
        self._proxy: ServiceProxy | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._claim: NetworkClaim | None = None

    @property
    def client(self) -> ApiClient | None:
        """The node components' API client; use it only inside :meth:`call`."""
        return self._client

    @property
    def url(self) -> str:
        if self.apiserver is None:
            raise RuntimeError("the local cluster is not started")
        return str(self.apiserver.url)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start everything; return once the node components have synced with the API server."""
        from .apiserver import ApiServer  # the API server is a sibling module with its own deps

        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A block of pod and service addresses no other cluster on this machine uses.
        self._claim = claim_networks()
        self.kubelet_config.pod_network = self._claim.pod_network
        try:
            self.apiserver = ApiServer(
                host=self.host,
                port=self.port,
                data_dir=self.data_dir,
                state_dir=self.state_dir,
                service_network=self._claim.service_network,
            )
            self.apiserver.start()
            self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
            self.apiserver.write_kubeconfig(self.kubeconfig)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="kelastic-node", daemon=True)
            self._thread.start()
            self.call(self._start_components(timeout), timeout=timeout + 5)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start_components(self, timeout: float) -> None:
        self._client = ApiClient(self.url)
        self.kubelet = Kubelet(self._client, self.kubelet_config)
        self._endpoints = EndpointsController(self._client)
        self._proxy = ServiceProxy(self._client)
        await self.kubelet.start(timeout)
        await self._endpoints.start(timeout)
        await self._proxy.start(timeout)

    async def _stop_components(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self._proxy is not None:
            await self._proxy.stop()
        if self._endpoints is not None:
            await self._endpoints.stop()
        if self._client is not None:
            await self._client.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Run ``coro`` in the node components' event loop and return its result."""
        if self._loop is None:
            raise RuntimeError("the local cluster is not started")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the local cluster did not finish {coro!r} within {timeout}s") from None

    def stop(self) -> None:
        """Stop the node components (killing every pod process), then the API server. Idempotent.

        Each part is stopped even when an earlier one fails; the first error is raised at the end.
        """
        try:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                try:
                    self.call(self._stop_components(), timeout=60.0)
                finally:
                    # Ending the thread also fires the pod shims' parent-death signal:
                    # whatever the kubelet could not stop dies with it.
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    self._thread.join(10.0)
                    if not self._thread.is_alive():
                        self._loop.close()
        finally:
            self._loop = None
            self._thread = None
            self.kubelet = None
            try:
                if self.apiserver is not None:
                    self.apiserver.stop()
                    self.apiserver = None
            finally:
                if self._claim is not None:
                    self._claim.release()
                    self._claim = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

"""``LocalCluster``: a whole single-machine Kubernetes in one object.

Composes the API server with the node components that are its clients over
HTTP: the kubelet (which also schedules), the service proxy and the volume
provisioner. Those run in one background thread with their own event loop;
the pod processes are children of that thread, so they receive SIGKILL if the
process dies without :meth:`LocalCluster.stop`.

::

    with LocalCluster(data_dir) as cluster:
        subprocess.run(["kubectl", "--kubeconfig", cluster.kubeconfig, "get", "pods"])

With ``control_plane=DIR`` the API server is not kelastic's emulator but the
real one: :class:`~kelastic.localcluster.controlplane.controlplane.ControlPlane` runs etcd,
kube-apiserver, kube-controller-manager and kube-scheduler from ``DIR``. The
same kubelet and service proxy then talk TLS to it: the kubelet as the node
(``system:node:<name>``, under the Node authorizer and NodeRestriction), the
proxy as ``system:kube-proxy`` for Services and as the node for its pods; the
scheduler binds pods. No Endpoints nor EndpointSlices carry the pods' loopback
addresses (the API server refuses them): the proxy finds a Service's pods itself.

What is not emulated: cluster DNS (reach services by their cluster IP), node
resources (requests and limits are recorded, not enforced), image pulls (the
image is recorded; containers are processes of the current Python environment).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ..common.client import ApiClient
from ..common.ipam import NetworkClaim, claim_networks
from ..controllers.provisioner import ClaimProvisioner
from ..controllers.proxy import ServiceProxy
from ..controlplane.controlplane import ControlPlane, ControlPlaneBinaries
from ..controlplane.tmpfs import claim_scratch_dir, sweep_scratch_dirs
from ..kubelet.images import ImageMap
from ..kubelet.kubelet import DEFAULT_NODE_NAME, Kubelet, KubeletConfig
from ..kubelet.kubeletserver import KubeletServer

__all__ = ["LocalCluster"]

T = TypeVar("T")

#: Where a control plane without a state directory keeps etcd's data (RAM).
SHM = Path("/dev/shm")
#: Seconds the node components get to stop (pods included) before the rest is stopped anyway.
STOP_TIMEOUT = 60.0


class LocalCluster:
    """API server + kubelet + service proxy + volume provisioner.

    ``data_dir`` holds pod logs and volumes; ``state_dir`` (optional) persists
    the API objects across restarts; ``kubeconfig`` is where the kubeconfig is
    written (default ``<data_dir>/kubeconfig``). ``backoff_base``/``backoff_cap``
    tune the CrashLoopBackOff delays (10 s / 300 s like a real kubelet).
    ``control_plane`` is a directory of Kubernetes binaries to run instead of the
    emulator (its state lives in ``<state_dir>/control-plane``, else under
    ``data_dir``); ``progress`` receives its start-up lines (default: dropped). ``gpus``
    overrides the node's ``nvidia.com/gpu`` count (see :mod:`~kelastic.localcluster.kubelet.gpus`),
    ``cpus`` its cpu capacity (a quantity; default the machine's cores).
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
        control_plane: Path | str | None = None,
        progress: Callable[[str], None] | None = None,
        images: ImageMap | None = None,
        gpus: int | None = None,
        cpus: str | None = None,
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
            images=images or ImageMap(),
            gpus=gpus,
            cpus=cpus,
        )
        self.control_plane_dir = Path(control_plane).expanduser() if control_plane else None
        self.progress: Callable[[str], None] = progress or (lambda line: None)
        self.apiserver: Any = None
        self.control_plane: ControlPlane | None = None
        self.kubelet: Kubelet | None = None
        self._client: ApiClient | None = None
        self._node_client: ApiClient | None = None
        self._proxy_client: ApiClient | None = None
        self._provisioner: ClaimProvisioner | None = None
        self._proxy: ServiceProxy | None = None
        self._kubelet_server: KubeletServer | None = None
        self._etcd_tmp: Path | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._claim: NetworkClaim | None = None

    @property
    def client(self) -> ApiClient | None:
        """The node components' API client; use it only inside :meth:`call`."""
        return self._client

    @property
    def url(self) -> str:
        if self.control_plane is not None:
            return self.control_plane.url
        if self.apiserver is None:
            raise RuntimeError("the local cluster is not started")
        return str(self.apiserver.url)

    @property
    def real(self) -> bool:
        """Whether the API server is a real kube-apiserver (not the emulator)."""
        return self.control_plane_dir is not None

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start everything; return once the node components have synced with the API server."""
        from ..apiserver.apiserver import ApiServer  # the API server is a sibling module with its own deps

        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A block of pod and service addresses no other cluster on this machine uses.
        self._claim = claim_networks()
        self.kubelet_config.pod_network = self._claim.pod_network
        try:
            self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
            if self.control_plane_dir is not None:
                self._start_control_plane(self.control_plane_dir)
            else:
                self.apiserver = ApiServer(
                    host=self.host,
                    port=self.port,
                    data_dir=self.data_dir,
                    state_dir=self.state_dir,
                    service_network=self._claim.service_network,
                )
                self.apiserver.start()
                self.apiserver.write_kubeconfig(self.kubeconfig)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="kelastic-node", daemon=True)
            self._thread.start()
            self.call(
                self._start_components(timeout), timeout=timeout + 5, what="starting the node components"
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_control_plane(self, directory: Path) -> None:
        assert self._claim is not None
        state = (self.state_dir or self.data_dir) / "control-plane"
        if self.state_dir is None and SHM.is_dir() and os.access(SHM, os.W_OK):
            # Nothing to persist: keep etcd in memory, out of reach of a slow disk's fsyncs.
            # First free the memory that SIGKILLed clusters left there (they could not clean up).
            for swept in sweep_scratch_dirs(SHM):
                self.progress(
                    f"removed {swept.path} ({swept.size_bytes / 1e6:.0f} MB), a stopped cluster's etcd "
                    f"data: {swept.reason}"
                )
            self._etcd_tmp = claim_scratch_dir(SHM)
        self.control_plane = ControlPlane(
            ControlPlaneBinaries.find(directory),
            state,
            service_network=self._claim.service_network,
            node_name=self.kubelet_config.node_name,
            progress=self.progress,
            etcd_data=self._etcd_tmp / "data" if self._etcd_tmp is not None else None,
            api_port=self.port,
        )
        self.control_plane.start()
        shutil.copyfile(self.control_plane.admin_kubeconfig, self.kubeconfig)
        self.kubeconfig.chmod(0o600)
        self.kubelet_config.api_url = self.control_plane.url
        self.kubelet_config.version = f"{self.control_plane.version}-kelastic"
        # Without a scheduler nothing else binds pods: the kubelet does, as the admin.
        self.kubelet_config.bind_pods = self.control_plane.binaries.scheduler is None

    def _clients(self) -> tuple[ApiClient, ApiClient, ApiClient]:
        """(admin, node, proxy) clients: one identity each on a real API server, one client on the emulator."""
        cp = self.control_plane
        if cp is None:
            client = ApiClient(self.url)
            return client, client, client
        admin = ApiClient(cp.url, ssl_context=cp.ssl_context(cp.credentials("admin")))
        node = (
            admin
            if self.kubelet_config.bind_pods
            else ApiClient(cp.url, ssl_context=cp.ssl_context(cp.credentials("node")))
        )
        proxy = ApiClient(cp.url, ssl_context=cp.ssl_context(cp.credentials("kube-proxy")))
        return admin, node, proxy

    async def _start_components(self, timeout: float) -> None:
        self._client, self._node_client, self._proxy_client = self._clients()
        self.kubelet = Kubelet(self._node_client, self.kubelet_config)
        cp = self.control_plane
        if cp is not None:
            # The real API server asks the node for container logs (kubectl logs).
            pki = cp.pki_dir
            self._kubelet_server = KubeletServer(
                self.kubelet.locate_logs, pki / "kubelet-serving.crt", pki / "kubelet-serving.key", cp.ca_file
            )
            self.kubelet_config.kubelet_port = await self._kubelet_server.start()
        # Services as the node proxy, pods as the node (the only identity, besides the
        # admin, that may list them); the proxy finds each Service's pods itself.
        self._proxy = ServiceProxy(
            self._proxy_client, self._node_client, None if cp is None else self.kubelet_config.node_name
        )
        # Claims are node directories (the kubelet's claims_dir): bind them so pods schedule.
        self._provisioner = ClaimProvisioner(self._client, self.data_dir / "claims", real=cp is not None)
        await self.kubelet.start(timeout)
        await self._provisioner.start(timeout)
        await self._proxy.start(timeout)

    async def _stop_components(self) -> None:
        if self._kubelet_server is not None:
            await self._kubelet_server.stop()
            self._kubelet_server = None
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self._proxy is not None:
            await self._proxy.stop()
        if self._provisioner is not None:
            await self._provisioner.stop()
        for client in {id(c): c for c in (self._client, self._node_client, self._proxy_client) if c}.values():
            await client.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0, *, what: str = "") -> T:
        """Run ``coro`` in the node components' event loop and return its result.

        Raises :class:`TimeoutError` after ``timeout`` seconds, naming ``what`` (a phrase
        such as "stopping the kubelet"; by default the coroutine's function), never a raw repr.
        """
        if self._loop is None:
            raise RuntimeError("the local cluster is not started")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"{what or _describe(coro)} did not finish within {timeout:g} s (local cluster)"
            ) from None

    def stop(self) -> None:
        """Stop the node components (killing every pod process), then the API server. Idempotent.

        Each part is stopped even when an earlier one fails; the first error is raised at the end.
        """
        stuck: TimeoutError | None = None
        try:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                try:
                    self.call(
                        self._stop_components(), timeout=STOP_TIMEOUT, what="stopping the node components"
                    )
                except TimeoutError:
                    stuck = TimeoutError(_stuck_message(STOP_TIMEOUT))  # raised once the rest is stopped
                finally:
                    # Ending the thread also fires the pod shims' parent-death signal:
                    # whatever the kubelet could not stop dies with it.
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    self._thread.join(10.0)
                    if not self._thread.is_alive():
                        self._close_loop(self._loop)
        finally:
            self._loop = None
            self._thread = None
            self.kubelet = None
            try:
                if self.apiserver is not None:
                    self.apiserver.stop()
                    self.apiserver = None
                if self.control_plane is not None:
                    self.control_plane.stop()
                    self.control_plane = None
                if self._etcd_tmp is not None:
                    shutil.rmtree(self._etcd_tmp, ignore_errors=True)
                    self._etcd_tmp = None
            finally:
                if self._claim is not None:
                    self._claim.release()
                    self._claim = None
        if stuck is not None:
            raise stuck

    def _close_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the stopped node loop as ``asyncio.run`` closes its own: cancel what is still
        pending (all of it when the components did not stop in time) and let it unwind, then
        close the API clients. A task left pending is destroyed later by the garbage collector,
        and its clean-up (closing a watch's connection) then fails on the closed loop."""
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=STOP_TIMEOUT))
        for client in {id(c): c for c in (self._client, self._node_client, self._proxy_client) if c}.values():
            loop.run_until_complete(client.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _describe(coro: Coroutine[Any, Any, Any]) -> str:
    """A readable name for a coroutine (its function), never its ``<coroutine object ...>`` repr."""
    name = getattr(coro, "__qualname__", "") or type(coro).__name__
    return f"{name.replace('.<locals>', '')}()"


def _stuck_message(timeout: float) -> str:
    """What to tell the user when the node components did not stop in time."""
    return (
        f"the node components (kubelet, service proxy, volume provisioner) did not stop within "
        f"{timeout:g} s; the API server was stopped anyway and the pods' processes are killed when this "
        "process exits. If any remain, list them with `pgrep -af localcluster/kubelet/shim.py` and kill them"
    )

"""The service proxy: makes every ClusterIP Service reachable at ``clusterIP:port``.

A userspace TCP forwarder (what kube-proxy's userspace mode did): for each TCP
port of each Service that has a cluster IP (``127.2.x.y``, allocated by the API
server), it listens on that address and port and forwards each connection to
one of the ready pods the Service selects, round-robin, trying the next one when
a backend refuses. A connection to a Service without ready pods is closed at once
(a client sees a reset/EOF, as with a real service without endpoints). Headless
services (``clusterIP: None``) get no listener. UDP is not proxied. Service ports
below 1024 need the privilege to bind them (root, or a lowered
``net.ipv4.ip_unprivileged_port_start``); the proxy keeps retrying those.

The backends come from the pods themselves, not from Endpoints or EndpointSlices:
the API server (any release since 1.21, and the emulator) refuses loopback
addresses in both, and every pod of kelastic local has one (``127.1.x.y``). The
proxy follows Services and the node's pods and applies the endpoints rule of
:func:`~kelastic.localcluster.controllers.endpoints.compute_subsets` itself.

There is no cluster DNS in kelastic local: clients reach services by their
cluster IP (e.g. from the Service's ``spec.clusterIP`` or, as in a real
cluster, the ``<NAME>_SERVICE_HOST`` convention set by whoever builds the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Mapping
from typing import Any

from ..common.client import ApiClient, Informer
from .endpoints import compute_subsets

__all__ = ["ServiceProxy", "ready_backends", "service_listeners"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
RETRY_LISTEN_S = 2.0
_CHUNK = 1 << 16


def service_listeners(service: Mapping[str, Any]) -> dict[tuple[str, int], str]:
    """``(clusterIP, port) → port name`` for every TCP port the proxy serves for ``service``."""
    spec = service.get("spec") or {}
    ip = spec.get("clusterIP")
    if not ip or ip == "None" or spec.get("type") == "ExternalName":
        return {}
    out: dict[tuple[str, int], str] = {}
    for port in spec.get("ports") or []:
        if port.get("protocol", "TCP") == "TCP" and port.get("port"):
            out[(str(ip), int(port["port"]))] = str(port.get("name", ""))
    return out


def ready_backends(endpoints: Mapping[str, Any] | None, port_name: str) -> list[tuple[str, int]]:
    """Ready ``(ip, port)`` pairs of the Endpoints for the service port named ``port_name``."""
    backends: list[tuple[str, int]] = []
    for subset in (endpoints or {}).get("subsets") or []:
        ports = [p for p in subset.get("ports") or [] if str(p.get("name", "")) == port_name]
        if not ports:
            continue
        for address in subset.get("addresses") or []:
            backends.append((str(address["ip"]), int(ports[0]["port"])))
    return backends


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy until EOF (then half-close ``writer``: True) or a connection error (False)."""
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except (ConnectionError, OSError):
        return False


async def _splice(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Forward both ways until the connection is over.

    A client that half-closes (sends its request, then EOF) still gets the whole
    answer; once the backend's side ends, or either side fails, both are torn
    down so no forwarding task outlives its connection.
    """
    to_upstream = asyncio.ensure_future(_pipe(client[0], upstream[1]))
    to_client = asyncio.ensure_future(_pipe(upstream[0], client[1]))
    try:
        done, _ = await asyncio.wait({to_upstream, to_client}, return_when=asyncio.FIRST_COMPLETED)
        if to_client not in done and to_upstream.result():
            await to_client
    finally:
        for task in (to_upstream, to_client):
            task.cancel()
        await asyncio.gather(to_upstream, to_client, return_exceptions=True)


class ServiceProxy:
    """Listeners for every ClusterIP service port; start and stop in one event loop.

    ``client`` reads Services (the node proxy's identity on a real API server);
    ``pods_client`` reads the pods of node ``node_name`` (the node's identity, which the
    Node authorizer lets list its own pods), or every pod when ``node_name`` is None.
    """

    def __init__(
        self, client: ApiClient, pods_client: ApiClient | None = None, node_name: str | None = None
    ) -> None:
        self.client = client
        self.services = Informer(client, "/api/v1/services", self._changed)
        params = {"fieldSelector": f"spec.nodeName={node_name}"} if node_name else None
        self.pods = Informer(pods_client or client, "/api/v1/pods", self._changed, params)
        self._servers: dict[tuple[str, int], asyncio.Server] = {}
        self._targets: dict[tuple[str, int], tuple[str, str]] = {}
        self._rr = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._failed: set[tuple[str, int]] = set()

    async def start(self, timeout: float = 30.0) -> None:
        self.services.start()
        self.pods.start()
        try:
            await asyncio.wait_for(
                asyncio.gather(self.services.synced.wait(), self.pods.synced.wait()), timeout
            )
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the service proxy could not list services and pods within {timeout}s"
            ) from None
        await self._reconcile()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="service proxy")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self.services.stop()
        await self.pods.stop()

    def _backends(self, service_key: str, port_name: str) -> list[tuple[str, int]]:
        """Ready ``(ip, port)`` of the service's pods, computed when a connection comes in
        (so a pod that just turned ready or left is seen at once)."""
        service = self.services.cache.get(service_key)
        if service is None or not (service.get("spec") or {}).get("selector"):
            return []
        subsets = compute_subsets(service, self.pods.cache.values())
        return ready_backends({"subsets": subsets}, port_name)

    def _changed(self, etype: str, key: str, obj: dict[str, Any]) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._reconcile()

    async def _reconcile(self) -> None:
        desired: dict[tuple[str, int], tuple[str, str]] = {}
        for key, service in self.services.cache.items():
            for addr, port_name in service_listeners(service).items():
                desired[addr] = (key, port_name)
        for addr in list(self._servers):
            if addr not in desired:
                self._servers.pop(addr).close()
        self._targets = desired
        for addr in desired:
            if addr in self._servers:
                continue
            try:
                self._servers[addr] = await asyncio.start_server(
                    functools.partial(self._accept, addr), host=addr[0], port=addr[1], reuse_address=True
                )
            except OSError as exc:
                # Retried until it works (the address may be held by a listener that is
                # closing); said once, not at every retry.
                level = logging.DEBUG if addr in self._failed else logging.WARNING
                log.log(level, "cannot listen on service address %s:%d: %s", addr[0], addr[1], exc)
                self._failed.add(addr)
                asyncio.get_running_loop().call_later(RETRY_LISTEN_S, self._wake.set)
            else:
                self._failed.discard(addr)

    def _accept(
        self, addr: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.get_running_loop().create_task(self._forward(addr, reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _forward(
        self, addr: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            target = self._targets.get(addr)
            backends = self._backends(target[0], target[1]) if target else []
            if not backends:
                return
            start = next(self._rr) % len(backends)
            for ip, port in backends[start:] + backends[:start]:
                try:
                    up_reader, up_writer = await asyncio.wait_for(
                        asyncio.open_connection(ip, port), CONNECT_TIMEOUT_S
                    )
                except (OSError, asyncio.TimeoutError):
                    continue
                try:
                    await _splice((reader, writer), (up_reader, up_writer))
                finally:
                    up_writer.close()
                return
        finally:
            writer.close()

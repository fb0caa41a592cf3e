"""The kubelet's HTTPS endpoint: container logs for a real API server.

``kubectl logs`` against a real kube-apiserver is answered by the node: the
API server connects to the address and port the Node publishes
(``status.daemonEndpoints.kubeletEndpoint``) and asks for
``/containerLogs/<namespace>/<pod>/<container>`` with the query of the
``pods/log`` request (``follow``, ``previous``, ``tailLines``, ``limitBytes``,
``timestamps``). The API server has already checked the user's RBAC and the
container name; this server only checks that the caller presents a client
certificate of the cluster CA (the API server's kubelet-client certificate)
and serves the files the kubelet writes. The emulator reads those files
itself and needs none of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ..common.podlogs import log_files, select_lines

__all__ = ["KubeletServer"]

#: ``(namespace, pod, container) → (log directory, container still running?)``, or None if unknown.
Locate = Callable[[str, str, str], "tuple[Path, Callable[[int], bool]] | None"]


def _stamped(data: bytes) -> bytes:
    t = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z "
    return b"".join(stamp.encode() + line for line in data.splitlines(keepends=True))


def _int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"not an integer: {value!r}") from None


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class KubeletServer:
    """Serves ``/containerLogs`` and ``/healthz`` over TLS on ``host``; start and stop in one event loop."""

    def __init__(
        self, locate: Locate, cert: Path, key: Path, client_ca: Path, host: str = "127.0.0.1"
    ) -> None:
        self.locate = locate
        self.host = host
        self.port = 0
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
        self._ssl.load_cert_chain(str(cert), str(key))
        self._ssl.verify_mode = ssl.CERT_REQUIRED
        self._runner: web.AppRunner | None = None
        self.stopping = False

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/healthz", _healthz)
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=self._ssl)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the port the kernel chose
        return self.port

    async def stop(self) -> None:
        self.stopping = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        found = self.locate(ns, pod, container)
        files = log_files(found[0]) if found else []
        if found is None or not files:
            raise web.HTTPNotFound(
                text=f'container "{container}" in pod "{pod}" has no logs on this node yet'
            )
        q = request.query
        previous = q.get("previous") in ("true", "1")
        if previous and len(files) < 2:
            raise web.HTTPBadRequest(
                text=f'previous terminated container "{container}" in pod "{pod}" not found'
            )
        index, path = files[-2] if previous else files[-1]
        stamp = _stamped if q.get("timestamps") in ("true", "1") else (lambda b: b)
        data = path.read_bytes()
        offset = len(data)
        body = stamp(select_lines(data, _int(q.get("tailLines")), _int(q.get("limitBytes"))))
        if q.get("follow") not in ("true", "1") or previous:
            return web.Response(body=body, content_type="text/plain")
        running = found[1]
        resp = web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await resp.write(body)
            while not self.stopping:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                if chunk:
                    await resp.write(stamp(chunk))
                    continue
                if not running(index):
                    break
                await asyncio.sleep(0.2)
        return resp

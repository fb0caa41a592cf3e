"""A small asyncio client of the Kubernetes API, for the kubelet and the controllers.

The kubelet, the endpoints controller and the service proxy of ``kelastic
local`` talk to the API server over HTTP only, as a real node's components do.
:class:`ApiClient` sends requests and turns error responses into
:class:`ApiRequestError`; :class:`Informer` keeps a cache of one resource by list +
watch with ``resourceVersion`` (resuming the watch, relisting on ``410 Gone`` or
any error) and calls back on every change. Consumers are level-based: a
callback says "this key changed", the consumer rereads the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

__all__ = ["ApiClient", "ApiRequestError", "Informer", "object_key"]

log = logging.getLogger(__name__)

#: Watches are restarted this often even when quiet, so a half-dead connection is noticed.
WATCH_TIMEOUT_S = 240


class ApiRequestError(Exception):
    """An error response of the API server (the ``Status`` object's fields)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` (or ``name`` for cluster-scoped objects)."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


class ApiClient:
    """JSON requests against one API server; create and use inside one event loop.

    Plain ``http://`` for the emulator; for a real API server, ``https://`` with
    ``ssl_context`` trusting its CA and holding the client certificate (see
    :meth:`ControlPlane.ssl_context`), and/or a bearer ``token``.
    """

    def __init__(
        self,
        base_url: str,
        request_timeout: float = 30.0,
        *,
        ssl_context: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = request_timeout
        self._ssl = ssl_context
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(
                read_bufsize=1 << 20, connector=connector, headers=self._headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; return the decoded JSON body or raise :class:`ApiRequestError`."""
        data = None if body is None else json.dumps(body)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        async with self.session.request(
            method,
            self.base_url + path,
            params={k: str(v) for k, v in (params or {}).items()},
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self._timeout),
        ) as resp:
            text = await resp.text()
            payload: Any
            try:
                payload = json.loads(text) if text else {}
            except json.JSONDecodeError:
                payload = {"message": text}
            if resp.status >= 400:
                if not isinstance(payload, dict):
                    payload = {}
                raise ApiRequestError(
                    resp.status, str(payload.get("reason", resp.reason)), str(payload.get("message", text))
                )
            return payload if isinstance(payload, dict) else {"items": payload}

    async def get(self, path: str, **params: Any) -> dict[str, Any]:
        return await self.request("GET", path, params=params)

    async def post(self, path: str, body: Any, **params: Any) -> dict[str, Any]:
        return await self.request("POST", path, params=params, body=body)

    async def put(self, path: str, body: Any, **params: Any) -> dict[str, Any]:
        return await self.request("PUT", path, params=params, body=body)

    async def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def strategic_patch(self, path: str, body: Any) -> dict[str, Any]:
        """A strategic merge patch (built-in kinds): lists with a merge key, such as a pod's
        ``status.conditions`` (by ``type``), are merged item by item, not replaced."""
        return await self.request(
            "PATCH", path, body=body, content_type="application/strategic-merge-patch+json"
        )

    async def delete(self, path: str, body: Any = None, **params: Any) -> dict[str, Any]:
        return await self.request("DELETE", path, params=params, body=body)


Callback = Callable[[str, str, dict[str, Any]], None]


class Informer:
    """Cache of one resource collection kept current by list + watch.

    ``path`` is the collection (e.g. ``/api/v1/pods``). ``on_change(type, key,
    obj)`` runs in the event loop for every ADDED/MODIFIED/DELETED, including the
    differences found by a relist; it must not block. ``synced`` is set after the
    first list.
    """

    def __init__(
        self,
        client: ApiClient,
        path: str,
        on_change: Callback | None = None,
        params: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.path = path
        #: Extra query parameters of the list and the watch (e.g. a ``fieldSelector``).
        self.params = dict(params or {})
        self.cache: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._callbacks: list[Callback] = [on_change] if on_change else []
        self._task: asyncio.Task[None] | None = None

    def add_callback(self, callback: Callback) -> None:
        self._callbacks.append(callback)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"informer {self.path}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _emit(self, etype: str, key: str, obj: dict[str, Any]) -> None:
        for callback in self._callbacks:
            try:
                callback(etype, key, obj)
            except Exception:
                log.exception("informer callback for %s failed", self.path)

    async def _list(self) -> str:
        listing = await self.client.get(self.path, **self.params)
        fresh = {object_key(o): o for o in listing.get("items") or []}
        for key in list(self.cache):
            if key not in fresh:
                self._emit("DELETED", key, self.cache.pop(key))
        for key, obj in fresh.items():
            old = self.cache.get(key)
            self.cache[key] = obj
            if old is None:
                self._emit("ADDED", key, obj)
            elif (old.get("metadata") or {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self._emit("MODIFIED", key, obj)
        self.synced.set()
        return str((listing.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, rv: str) -> str | None:
        """Follow the watch from ``rv``; return the last version seen, or None to relist."""
        params = {
            **self.params,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        if rv:
            params["resourceVersion"] = rv
        async with self.client.session.get(
            self.client.base_url + self.path,
            params=params,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30),
        ) as resp:
            if resp.status == 410:
                return None
            if resp.status >= 400:
                raise ApiRequestError(resp.status, resp.reason or "", await resp.text())
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                event = json.loads(line)
                etype = event.get("type")
                obj = event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise ApiRequestError(
                        int(obj.get("code", 500)), str(obj.get("reason", "")), str(obj.get("message", ""))
                    )
                rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                if etype == "BOOKMARK":
                    continue
                key = object_key(obj)
                if etype == "DELETED":
                    self.cache.pop(key, None)
                else:
                    self.cache[key] = obj
                self._emit(str(etype), key, obj)
        return rv

    async def _run(self) -> None:
        delay = 0.1
        rv: str | None = None
        refused = ""
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                rv = await self._watch(rv)
                delay = 0.1
                refused = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A refusal (403, 404...) will not cure itself like a dropped connection:
                # say it once, loudly.
                if isinstance(exc, ApiRequestError) and str(exc) != refused:
                    refused = str(exc)
                    log.warning("cannot list/watch %s: %s; retrying", self.path, exc)
                log.debug("watch of %s failed (%s); relisting in %.1fs", self.path, exc, delay)
                rv = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

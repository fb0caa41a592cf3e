"""WATCH: a stream of a resource's events, as kube-apiserver sends them.

:func:`serve_watch` answers ``?watch=true`` (and ``/watch/…`` paths): from
``resourceVersion`` on (410 Gone, as an ERROR event, when it left the history), or the
current objects first (none or ``0``, or ``sendInitialEvents``, whose end a bookmark
marks); label and field selectors; ``timeoutSeconds``; bookmarks every
``bookmark_interval`` when asked; events as Table rows for ``kubectl get -w``. A client
that went away ends the stream within :data:`WATCH_IDLE_TICK` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from .errors import ApiError
from .httpio import ObjectEncoder, accept_as, dumps, flag, int_param
from .registry import Registry
from .registry_types import Obj
from .resources import ResourceType
from .routing import Route
from .selectors import make_predicate, parse_field_selector, parse_label_selector
from .storage import EventType, Watcher, WatchItem
from .table import to_table

__all__ = ["WATCH_IDLE_TICK", "serve_watch"]

#: How often an idle watch checks that its client is still there (and sends a bookmark if asked).
WATCH_IDLE_TICK = 5.0


@dataclass
class _Lines:
    """Encodes one watch's events, each a line of JSON."""

    rt: ResourceType
    registry: Registry
    encoder: ObjectEncoder
    as_table: bool

    def bookmark(self, rv: str, annotations: Obj | None = None) -> bytes:
        meta: Obj = {"resourceVersion": rv}
        if annotations:
            meta["annotations"] = annotations
        rt = self.rt
        return (
            dumps(
                {
                    "type": "BOOKMARK",
                    "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta},
                }
            )
            + b"\n"
        )

    def event(self, item: WatchItem) -> bytes:
        kind, obj, rv = item
        if kind == "INITIAL_END":
            return self.bookmark(str(rv), {"k8s.io/initial-events-end": "true"})
        obj = self.registry.present(self.rt, obj)
        body = dumps(to_table(self.rt, [obj])) if self.as_table else self.encoder.object_bytes(obj)
        return b'{"type":"' + kind.value.encode() + b'","object":' + body + b"}\n"


def _subscribe(
    registry: Registry, r: Route, watcher: Watcher, rv_param: str, initial: bool
) -> ApiError | None:
    """Queue what the watch starts with and subscribe it; the 410 Gone to send instead, if any.
    Runs without awaiting: no write can slip in between."""
    ns = r.namespace if r.rt.namespaced else None
    if rv_param in ("", "0") or initial:
        for obj in registry.store.list(r.rt.key, ns):
            if watcher.match(obj):
                watcher.queue.put_nowait((EventType.ADDED, obj, int(obj["metadata"]["resourceVersion"])))
    else:
        try:
            since = int(rv_param)
        except ValueError:
            raise ApiError.bad_request(f"invalid resourceVersion {rv_param!r}") from None
        try:
            for ev in registry.events_since(r.rt, since):
                watcher.offer(ev)
        except ApiError as err:
            return err
    registry.store.subscribe(watcher)
    return None


async def serve_watch(
    request: web.Request,
    r: Route,
    registry: Registry,
    encoder: ObjectEncoder,
    bookmark_interval: float,
    stopping: Callable[[], bool],
) -> web.StreamResponse:
    """Stream the events of ``r`` until the client goes, the timeout passes or ``stopping()``."""
    q = request.query
    rt = r.rt
    if "watch" not in rt.verbs:
        raise ApiError.method_not_allowed(f"{rt.plural} cannot be watched")
    fields = parse_field_selector(q.get("fieldSelector"), rt.kind)
    if r.name is not None:
        fields = [*fields, *parse_field_selector(f"metadata.name={r.name}", rt.kind)]
    ns = r.namespace if rt.namespaced else None
    watcher = Watcher(rt.key, make_predicate(ns, parse_label_selector(q.get("labelSelector")), fields))
    timeout = int_param(q.get("timeoutSeconds"), "timeoutSeconds")
    initial = flag(q.get("sendInitialEvents"))
    lines = _Lines(rt, registry, encoder, accept_as(request) == "Table")
    gone = _subscribe(registry, r, watcher, q.get("resourceVersion") or "", initial)
    start_rv = registry.store.rv
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.enable_chunked_encoding()
    try:
        await resp.prepare(request)
        if gone is not None:
            await resp.write(dumps({"type": "ERROR", "object": gone.to_status()}) + b"\n")
            return resp
        if initial:
            # The initial state is queued; the bookmark marking its end follows it.
            watcher.queue.put_nowait(("INITIAL_END", {}, start_rv))
        deadline = time.monotonic() + timeout if timeout else None
        interval = bookmark_interval if flag(q.get("allowWatchBookmarks")) else None
        await _pump(request, resp, watcher, lines, interval, deadline, stopping)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        registry.store.unsubscribe(watcher)
    return resp


async def _pump(
    request: web.Request,
    resp: web.StreamResponse,
    watcher: Watcher,
    lines: _Lines,
    bookmark_interval: float | None,
    deadline: float | None,
    stopping: Callable[[], bool],
) -> None:
    """Write the watcher's events as they come (in batches), and bookmarks when they are due."""
    last_bookmark = time.monotonic()
    while not stopping():
        wait = WATCH_IDLE_TICK
        if bookmark_interval is not None:
            wait = min(wait, max(0.05, last_bookmark + bookmark_interval - time.monotonic()))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait = min(wait, left)
        item: WatchItem | tuple[()] | None  # () when the wait timed out
        if not watcher.queue.empty():
            item = watcher.queue.get_nowait()
        else:
            try:
                item = await asyncio.wait_for(watcher.queue.get(), wait)
            except asyncio.TimeoutError:
                item = ()
        if item is None:
            break
        chunks = []
        if item:
            chunks.append(lines.event(item))
            while not watcher.queue.empty() and len(chunks) < 256:
                nxt = watcher.queue.get_nowait()
                if nxt is None:
                    watcher.closed = True
                    break
                chunks.append(lines.event(nxt))
        if (
            bookmark_interval is not None
            and time.monotonic() - last_bookmark >= bookmark_interval
            and watcher.queue.empty()
        ):
            chunks.append(lines.bookmark(str(lines.registry.store.rv)))
            last_bookmark = time.monotonic()
        transport = request.transport
        if transport is None or transport.is_closing():
            break
        if chunks:
            await resp.write(b"".join(chunks))
        if watcher.closed and watcher.queue.empty():
            break

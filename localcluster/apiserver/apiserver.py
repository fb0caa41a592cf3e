"""The Kubernetes API server of ``kelastic local``: plain HTTP on a loopback address.

:class:`ApiServer` serves the Kubernetes REST API (discovery, OpenAPI, CRUD,
list/watch, subresources, Table output, pod logs) with aiohttp on its own event
loop in a background thread. Object semantics live in :mod:`.registry`, storage
in :mod:`.storage`, garbage collection in :mod:`.gc`.

What clients get, as from a real API server: legacy discovery, OpenAPI v3 (and an
empty protobuf v2 document, so kubectl validates through the server), CRUD with
Status errors, list/watch with resumable resourceVersions, 410 Gone, bookmarks and
``sendInitialEvents``, label and field selectors, merge/JSON/strategic merge
patches, dry-run, field validation (Strict/Warn/Ignore), status and scale
subresources, CRD schemas (validation, defaults, pruning, CEL rules), Table output with
printer columns, finalizers, graceful pod deletion, pod binding and eviction,
ownerReference garbage collection, namespace termination, pod logs, and the
protobuf request bodies of ``kubectl create <kind>``.

Known differences: server-side apply records each manager's applied fields,
removes those it stops applying and reports conflicts between apply managers,
but does not track fields written by updates; CEL validation rules are
evaluated for a subset of CEL (see :mod:`.cel`; rules outside it are not
enforced); responses are JSON only; there
is no exec/attach/port-forward, no authentication or authorization (every
request is allowed), and the only controllers are garbage collection and
namespace termination (Deployments, Jobs and the like are stored as data).

Run it alone for debugging::

    python -m kelastic.localcluster.apiserver --port 6443 --data-dir /tmp/kl --kubeconfig /tmp/kl/kubeconfig
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from ..common.podlogs import log_files, pod_log_dir, select_lines
from . import discovery, kinds, openapi
from .disruption import DisruptionController
from .errors import ApiError, FieldCause, status_object
from .eviction import evict
from .fields import component_schemas
from .gc import GarbageCollector
from .protobuf import ProtobufError, decode_object
from .registry import DeleteOptions, FieldValidation, PatchType, Registry
from .resources import ResourceType, TypeRegistry
from .selectors import make_predicate, parse_field_selector, parse_label_selector
from .storage import EventType, Store, Watcher, WatchItem
from .table import to_table

__all__ = ["ApiServer", "main"]

log = logging.getLogger(__name__)
Obj = dict[str, Any]

_V2_PROTOBUF = "application/octet-stream"
#: How often an idle watch checks that its client is still there (and sends a bookmark if asked).
WATCH_IDLE_TICK = 5.0


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


#: The kinds whose DELETE answers the deleted object itself; the others answer a Status
#: when the object is gone at once (the object while its deletion is pending, for all).
RETURN_DELETED = frozenset(
    {
        ("", "pods"),
        ("", "services"),
        ("", "namespaces"),
        ("", "serviceaccounts"),
        ("", "persistentvolumes"),
        ("", "persistentvolumeclaims"),
        ("", "resourcequotas"),
        ("", "podtemplates"),
        ("storage.k8s.io", "storageclasses"),
        ("storage.k8s.io", "csidrivers"),
        ("storage.k8s.io", "csinodes"),
        ("storage.k8s.io", "volumeattachments"),
        ("storage.k8s.io", "volumeattributesclasses"),
    }
)


def _json(obj: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    resp = web.Response(body=_dumps(obj), status=status, content_type="application/json")
    for w in warnings or ():
        resp.headers.add("Warning", '299 - "' + w.replace('"', '\\"') + '"')
    return resp


def _error(err: ApiError) -> web.Response:
    return _json(err.to_status(), err.code)


def _not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


@dataclass
class _Route:
    group: str
    version: str
    rt: ResourceType
    namespace: str | None
    name: str | None
    sub: str
    watch_path: bool


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def _int(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError.bad_request(f"{what} must be an integer, got {value!r}") from None


class _Encoder:
    """Per-event JSON encoding shared by every watcher (objects are immutable once stored)."""

    def __init__(self, size: int = 8192) -> None:
        self._cache: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._size = size

    def object_bytes(self, obj: Obj) -> bytes:
        m = obj["metadata"]
        key = (m.get("uid", ""), m.get("resourceVersion", ""), obj.get("apiVersion", ""))
        data = self._cache.get(key)
        if data is None:
            data = _dumps(obj)
            self._cache[key] = data
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return data


class _App:
    """The aiohttp request handlers over one registry."""

    def __init__(self, registry: Registry, data_dir: Path, bookmark_interval: float) -> None:
        self.registry = registry
        self.types = registry.types
        self.store = registry.store
        self.data_dir = data_dir
        self.bookmark_interval = bookmark_interval
        self.encoder = _Encoder()
        self.server_address = ""
        self.stopping = False
        self._openapi_cache: dict[tuple[Any, ...], tuple[bytes, str]] = {}

    # ---- routing -----------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as err:
            return _error(err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error(ApiError(500, "InternalError", f"Internal error occurred: {exc}"))

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        method = request.method
        if path in ("/healthz", "/livez", "/readyz") or path.startswith(("/healthz/", "/livez/", "/readyz/")):
            return web.Response(text="ok")
        if path == "/version":
            return _json(discovery.version_info())
        if path == "/api":
            return _json(discovery.api_versions(self.server_address))
        if path == "/apis":
            return _json(discovery.api_group_list(self.types))
        if parts[:1] == ["openapi"]:
            return self._openapi(request, parts[1:])
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 2:
            group = parts[1]
            if len(parts) == 2:
                doc = discovery.api_group(self.types, group)
                if doc is None:
                    raise _not_found_path()
                return _json(doc)
            version, rest = parts[2], parts[3:]
        else:
            raise _not_found_path()
        if not rest:
            doc = discovery.resource_list(self.types, group, version)
            if doc is None:
                raise _not_found_path()
            return _json(doc)
        route = self._route(group, version, rest)
        return await self._resource(request, method, route)

    def _route(self, group: str, version: str, rest: list[str]) -> _Route:
        watch_path = False
        if rest[0] == "watch":
            watch_path, rest = True, rest[1:]
        namespace: str | None = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
        ):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _not_found_path()
        rt = self.types.lookup(group, version, rest[0])
        if rt is None:
            raise _not_found_path()
        if namespace is not None and not rt.namespaced:
            raise _not_found_path()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if sub and sub not in rt.subresources:
            raise _not_found_path()
        return _Route(group, version, rt, namespace, name, sub, watch_path)

    # ---- openapi -----------------------------------------------------------------
    def _openapi(self, request: web.Request, rest: list[str]) -> web.Response:
        key = (self.types.generation, request.headers.get("Accept", ""), tuple(rest))
        cached = self._openapi_cache.get(key)
        if cached is None:
            cached = self._openapi_doc(request, rest)
            if len(self._openapi_cache) > 64:
                self._openapi_cache.clear()
            self._openapi_cache[key] = cached
        return web.Response(body=cached[0], content_type=cached[1])

    def _openapi_doc(self, request: web.Request, rest: list[str]) -> tuple[bytes, str]:
        if rest == ["v2"]:
            accept = request.headers.get("Accept", "")
            if "protobuf" in accept and "json" not in accept:
                # An empty protobuf message is a valid, empty OpenAPI v2 document: kubectl then
                # finds no v2 schema for any kind and relies on server-side field validation.
                return b"", _V2_PROTOBUF
            return _dumps(openapi.swagger_v2(self.types)), "application/json"
        if rest == ["v3"]:
            return _dumps(openapi.v3_root(self.types)), "application/json"
        if rest[:1] == ["v3"] and len(rest) >= 3:
            if rest[1] == "api":
                doc = openapi.gv_document(self.types, "", rest[2])
            elif rest[1] == "apis" and len(rest) == 4:
                doc = openapi.gv_document(self.types, rest[2], rest[3])
            else:
                doc = None
            if doc is not None:
                return _dumps(doc), "application/json"
        raise _not_found_path()

    # ---- bodies and options ---------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        ctype = request.content_type or ""
        if "protobuf" in ctype:
            try:
                return decode_object(raw)
            except ProtobufError as exc:
                raise ApiError(415, "UnsupportedMediaType", str(exc)) from None
        try:
            return json.loads(raw)
        except ValueError:
            if "yaml" in ctype:
                try:
                    return yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    raise ApiError.bad_request(f"the request body is not valid YAML: {exc}") from None
            raise ApiError.bad_request("the request body is not valid JSON") from None

    @staticmethod
    def _validation(request: web.Request) -> FieldValidation:
        value = request.query.get("fieldValidation") or "Warn"
        try:
            return FieldValidation(value)
        except ValueError:
            options = {"POST": "CreateOptions", "PUT": "UpdateOptions"}.get(request.method, "PatchOptions")
            why = f'Unsupported value: "{value}": supported values: "", "Ignore", "Strict", "Warn"'
            raise ApiError.invalid(
                "meta.k8s.io", options, "", [FieldCause("FieldValueNotSupported", why, "fieldValidation")]
            ) from None

    @staticmethod
    def _manager(request: web.Request) -> str:
        """Who an update is recorded for in managedFields: ``fieldManager``, else the client's
        User-Agent up to its first ``/`` (as the real server names it)."""
        given = request.query.get("fieldManager")
        if given:
            return given
        return (request.headers.get("User-Agent") or "unknown").split("/", 1)[0][:128]

    @staticmethod
    def _dry_run(request: web.Request) -> bool:
        values = request.query.getall("dryRun", [])
        for v in values:
            if v != "All":
                raise ApiError.bad_request(f'dryRun: Unsupported value: "{v}": supported values: "All"')
        return bool(values)

    async def _delete_options(self, request: web.Request) -> DeleteOptions:
        body = await self._body(request) or {}
        if not isinstance(body, dict):
            raise ApiError.bad_request("the DELETE body must be a DeleteOptions object")
        q = request.query
        policy = body.get("propagationPolicy") or q.get("propagationPolicy")
        orphan = body.get("orphanDependents")
        if orphan is None and "orphanDependents" in q:
            orphan = _flag(q.get("orphanDependents"))
        if policy is None and orphan is not None:
            policy = "Orphan" if orphan else "Background"
        grace = body.get("gracePeriodSeconds")
        if grace is None:
            grace = _int(q.get("gracePeriodSeconds"), "gracePeriodSeconds")
        pre = body.get("preconditions") or {}
        dry = bool(body.get("dryRun")) or self._dry_run(request)
        return DeleteOptions(policy, grace, pre.get("uid"), pre.get("resourceVersion"), dry)

    # ---- resource requests ------------------------------------------------------------
    async def _resource(self, request: web.Request, method: str, r: _Route) -> web.StreamResponse:
        rt, ns, name, sub = r.rt, r.namespace, r.name, r.sub
        q = request.query
        reg = self.registry
        if method == "GET":
            if r.watch_path or _flag(q.get("watch")):
                return await self._watch(request, r)
            if name is None:
                if "list" not in rt.verbs:
                    raise ApiError.method_not_allowed(f"{rt.plural} cannot be listed")
                return self._list(request, r)
            if sub == "scale":
                return _json(reg.scale.get(rt, ns, name))
            if sub == "log":
                return await self._logs(request, ns or "", name)
            if sub and sub != "status":
                raise ApiError.method_not_allowed(f"GET is not supported on {rt.plural}/{sub}")
            obj = reg.get(rt, ns, name)
            return self._object_response(request, rt, obj)
        if method == "POST":
            if rt.kind in ("SelfSubjectAccessReview", "SubjectAccessReview") and name is None:
                body = await self._body(request) or {}
                body["status"] = {"allowed": True, "reason": "kelastic local authorizes every request"}
                body.setdefault("apiVersion", rt.api_version)
                body.setdefault("kind", rt.kind)
                return _json(body, 201)
            body = await self._body(request)
            if name is None:
                res = reg.create(
                    rt, ns, body, validation=self._validation(request), dry_run=self._dry_run(request)
                )
                return _json(res.obj, 201, res.warnings)
            if sub == "binding":
                return _json(self._bind(rt, ns or "", name, body), 201)
            if sub == "eviction":
                return _json(evict(reg, rt, ns or "", name, body), 201)
            raise ApiError.method_not_allowed(f"POST is not supported on a named {rt.kind}")
        if method == "PUT":
            if name is None:
                raise ApiError.method_not_allowed(f"PUT needs an object name for {rt.plural}")
            body = await self._body(request)
            if sub == "scale":
                res = reg.scale.update(rt, ns, name, body, dry_run=self._dry_run(request))
                return _json(res.obj)
            if sub == "finalize":
                return _json(self._finalize_namespace(name, body))
            res = reg.update(
                rt,
                ns,
                name,
                body,
                subresource=sub,
                validation=self._validation(request),
                dry_run=self._dry_run(request),
                manager=self._manager(request),
            )
            return _json(res.obj, 200, res.warnings)
        if method == "PATCH":
            if name is None:
                raise ApiError.method_not_allowed(f"PATCH needs an object name for {rt.plural}")
            ctype = (request.content_type or "").split(";")[0].strip()
            try:
                ptype = PatchType(ctype)
            except ValueError:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format ({ctype!r}) - accepted media "
                    f"types include: {', '.join(p.value for p in PatchType)}",
                ) from None
            body = await self._body(request)
            res = reg.patch(
                rt,
                ns,
                name,
                ptype,
                body,
                subresource=sub,
                validation=self._validation(request),
                dry_run=self._dry_run(request),
                field_manager=q.get("fieldManager") if ptype is PatchType.APPLY else self._manager(request),
                force=q.get("force") == "true",
            )
            return _json(res.obj, 201 if res.created else 200, res.warnings)
        if method == "DELETE":
            opts = await self._delete_options(request)
            if name is None:
                if "deletecollection" not in rt.verbs:
                    raise ApiError.method_not_allowed(f"{rt.plural} cannot be deleted as a collection")
                items = reg.delete_collection(rt, ns, opts, q.get("labelSelector"), q.get("fieldSelector"))
                return _json(
                    {
                        "kind": rt.list_kind,
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(self.store.rv)},
                        "items": items,
                    }
                )
            obj, removed = reg.delete(rt, ns, name, opts)
            if removed and not rt.crd and (rt.group, rt.plural) in RETURN_DELETED:
                return _json(obj)
            if removed:
                # What most kinds answer for an object gone at once (the kind is the resource).
                meta = obj.get("metadata") or {}
                details = {"name": name, "group": rt.group, "kind": rt.plural, "uid": meta.get("uid")}
                return _json(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {k: v for k, v in details.items() if v},
                    }
                )
            return _json(obj)
        raise ApiError.method_not_allowed(f"method {method} is not supported")

    def _bind(self, rt: ResourceType, ns: str, name: str, body: Any) -> Obj:
        target = ((body or {}).get("target") or {}).get("name")
        if not target:
            raise ApiError.bad_request("a Binding needs target.name (the node)")
        self.registry.bind(rt, ns, name, target)
        return status_object("Success", 201, "", "")

    def _finalize_namespace(self, name: str, body: Any) -> Obj:
        finalizers = list(((body or {}).get("spec") or {}).get("finalizers") or [])
        return self.registry.namespaces.finalize(name, finalizers)

    # ---- output formats -------------------------------------------------------------------
    @staticmethod
    def _accept_as(request: web.Request) -> str:
        """'Table', 'PartialObjectMetadata' (or …List) when the client asks for it, else ''."""
        for part in request.headers.get("Accept", "").split(","):
            params = dict(p.strip().split("=", 1) for p in part.split(";")[1:] if "=" in p)
            as_ = params.get("as")
            if as_ in ("Table", "PartialObjectMetadata", "PartialObjectMetadataList"):
                return as_
            if part.strip().startswith(("application/json", "*/*")) and not as_:
                return ""
        return ""

    def _object_response(self, request: web.Request, rt: ResourceType, obj: Obj) -> web.Response:
        as_ = self._accept_as(request)
        if as_ == "Table":
            return _json(
                to_table(
                    rt,
                    [obj],
                    request.query.get("includeObject", "PartialObjectMetadata"),
                    {"resourceVersion": obj["metadata"].get("resourceVersion", "")},
                )
            )
        if as_.startswith("PartialObjectMetadata"):
            return _json(
                {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            )
        return _json(obj)

    def _list(self, request: web.Request, r: _Route) -> web.Response:
        q = request.query
        res = self.registry.list(
            r.rt,
            r.namespace,
            label_selector=q.get("labelSelector"),
            field_selector=q.get("fieldSelector"),
            limit=_int(q.get("limit"), "limit"),
            continue_token=q.get("continue"),
            resource_version=q.get("resourceVersion"),
            resource_version_match=q.get("resourceVersionMatch"),
        )
        meta: Obj = {"resourceVersion": res.resource_version}
        if res.continue_token:
            meta["continue"] = res.continue_token
        if res.remaining is not None:
            meta["remainingItemCount"] = res.remaining
        as_ = self._accept_as(request)
        if as_ == "Table":
            return _json(to_table(r.rt, res.items, q.get("includeObject", "PartialObjectMetadata"), meta))
        if as_.startswith("PartialObjectMetadata"):
            return _json(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                    "items": [
                        {
                            "kind": "PartialObjectMetadata",
                            "apiVersion": "meta.k8s.io/v1",
                            "metadata": o["metadata"],
                        }
                        for o in res.items
                    ],
                }
            )
        # Items are serialized once each and spliced in: lists of thousands of pods stay cheap.
        head = _dumps({"kind": r.rt.list_kind, "apiVersion": r.rt.api_version, "metadata": meta})
        items = b",".join(self.encoder.object_bytes(o) for o in res.items)
        body = head[:-1] + b',"items":[' + items + b"]}"
        return web.Response(body=body, content_type="application/json")

    # ---- watch -----------------------------------------------------------------------------
    async def _watch(self, request: web.Request, r: _Route) -> web.StreamResponse:
        q = request.query
        rt = r.rt
        if "watch" not in rt.verbs:
            raise ApiError.method_not_allowed(f"{rt.plural} cannot be watched")
        fields = parse_field_selector(q.get("fieldSelector"), rt.kind)
        if r.name is not None:
            fields = [*fields, *parse_field_selector(f"metadata.name={r.name}", rt.kind)]
        ns = r.namespace if rt.namespaced else None
        pred = make_predicate(ns, parse_label_selector(q.get("labelSelector")), fields)
        timeout = _int(q.get("timeoutSeconds"), "timeoutSeconds")
        bookmarks = _flag(q.get("allowWatchBookmarks"))
        initial = _flag(q.get("sendInitialEvents"))
        rv_param = q.get("resourceVersion") or ""
        as_table = self._accept_as(request) == "Table"
        watcher = Watcher(rt.key, pred)
        # Everything up to subscribe runs without awaiting: no write can slip in between.
        gone: ApiError | None = None
        if rv_param in ("", "0") or initial:
            for obj in self.store.list(rt.key, ns):
                if pred(obj):
                    watcher.queue.put_nowait((EventType.ADDED, obj, int(obj["metadata"]["resourceVersion"])))
        else:
            try:
                since = int(rv_param)
            except ValueError:
                raise ApiError.bad_request(f"invalid resourceVersion {rv_param!r}") from None
            try:
                for ev in self.registry.events_since(rt, since):
                    watcher.offer(ev)
            except ApiError as err:
                gone = err
        start_rv = self.store.rv
        if gone is None:
            self.store.subscribe(watcher)
        resp = web.StreamResponse(status=200)
        resp.content_type = "application/json"
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            if gone is not None:
                await resp.write(_dumps({"type": "ERROR", "object": gone.to_status()}) + b"\n")
                return resp
            if initial:
                # The initial state is queued; the bookmark marking its end follows it.
                watcher.queue.put_nowait(("INITIAL_END", {}, start_rv))
            deadline = time.monotonic() + timeout if timeout else None
            last_bookmark = time.monotonic()
            while not self.stopping:
                wait = WATCH_IDLE_TICK
                if bookmarks:
                    wait = min(wait, max(0.05, last_bookmark + self.bookmark_interval - time.monotonic()))
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
                    chunks.append(self._event_line(rt, item, as_table))
                    while not watcher.queue.empty() and len(chunks) < 256:
                        nxt = watcher.queue.get_nowait()
                        if nxt is None:
                            watcher.closed = True
                            break
                        chunks.append(self._event_line(rt, nxt, as_table))
                if (
                    bookmarks
                    and time.monotonic() - last_bookmark >= self.bookmark_interval
                    and watcher.queue.empty()
                ):
                    chunks.append(self._bookmark(rt, str(self.store.rv)))
                    last_bookmark = time.monotonic()
                transport = request.transport
                if transport is None or transport.is_closing():
                    break
                if chunks:
                    await resp.write(b"".join(chunks))
                if watcher.closed and watcher.queue.empty():
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unsubscribe(watcher)
        return resp

    def _bookmark(self, rt: ResourceType, rv: str, annotations: Obj | None = None) -> bytes:
        meta: Obj = {"resourceVersion": rv}
        if annotations:
            meta["annotations"] = annotations
        return (
            _dumps(
                {
                    "type": "BOOKMARK",
                    "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta},
                }
            )
            + b"\n"
        )

    def _event_line(self, rt: ResourceType, item: WatchItem, as_table: bool) -> bytes:
        kind, obj, rv = item
        if kind == "INITIAL_END":
            return self._bookmark(rt, str(rv), {"k8s.io/initial-events-end": "true"})
        obj = self.registry.present(rt, obj)
        if as_table:
            body = _dumps(to_table(rt, [obj]))
        else:
            body = self.encoder.object_bytes(obj)
        return b'{"type":"' + kind.value.encode() + b'","object":' + body + b"}\n"

    # ---- logs -----------------------------------------------------------------------------------
    async def _logs(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        rt = self.types.lookup("", "v1", "pods")
        assert rt is not None
        q = request.query
        pod = self.registry.get(rt, ns, name)
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        inits = [c["name"] for c in (pod.get("spec") or {}).get("initContainers") or []]
        container = q.get("container")
        if not container:
            if len(containers) != 1:
                raise ApiError.bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
                    + (f" or one of the init containers: [{' '.join(inits)}]" if inits else "")
                )
            container = containers[0]
        elif container not in containers and container not in inits:
            raise ApiError.bad_request(f"container {container} is not valid for pod {name}")
        folder = pod_log_dir(self.data_dir, ns, name, pod["metadata"]["uid"]) / container
        files = log_files(folder)
        if not files:
            raise ApiError.bad_request(
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        if _flag(q.get("previous")):
            if len(files) < 2:
                raise ApiError.bad_request(
                    f'previous terminated container "{container}" in pod "{name}" not found'
                )
            index, path = files[-2]
        else:
            index, path = files[-1]
        follow = _flag(q.get("follow"))
        tail = _int(q.get("tailLines"), "tailLines")
        limit = _int(q.get("limitBytes"), "limitBytes")
        stamps = _flag(q.get("timestamps"))
        data = path.read_bytes()
        offset = len(data)
        data = select_lines(data, tail, limit)
        prefix: Callable[[bytes], bytes] = (lambda b: _stamp(b)) if stamps else (lambda b: b)
        if not follow:
            return web.Response(body=prefix(data), content_type="text/plain")
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/plain"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            if data:
                await resp.write(prefix(data))
            pending = b""
            while not self.stopping:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
                offset += len(chunk)
                pending += chunk
                if pending:
                    cut = pending.rfind(b"\n") + 1
                    if cut:
                        await resp.write(prefix(pending[:cut]))
                        pending = pending[cut:]
                if chunk:
                    continue
                if self._container_done(rt, ns, name, pod["metadata"]["uid"], container, index, folder):
                    if pending:
                        await resp.write(prefix(pending))
                    break
                transport = request.transport
                if transport is None or transport.is_closing():
                    break
                await asyncio.sleep(0.1)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    def _container_done(
        self, rt: ResourceType, ns: str, name: str, uid: str, container: str, index: int, folder: Path
    ) -> bool:
        pod = self.store.get(rt.key, ns, name)
        if pod is None or pod["metadata"].get("uid") != uid:
            return True
        if (folder / f"{index + 1}.log").exists():
            return True
        status = pod.get("status") or {}
        for s in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
            if s.get("name") == container:
                return int(s.get("restartCount", 0)) == index and "terminated" in (s.get("state") or {})
        return status.get("phase") in ("Succeeded", "Failed")


def _stamp(data: bytes) -> bytes:
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1e9):09d}Z "
    return b"".join(now.encode() + line for line in data.splitlines(keepends=True))


class ApiServer:
    """A Kubernetes API server on ``host:port`` (0: any free port), in a background thread.

    ``data_dir`` is where the kubelet writes container logs (served by the pod
    ``log`` subresource). ``state_dir`` persists objects across restarts.
    ``watch_history`` is how many past events a watch can resume from (older:
    410 Gone); ``bookmark_interval`` is how often watches that allow bookmarks
    get one.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: Path | None = None,
        state_dir: Path | None = None,
        *,
        watch_history: int = 20_000,
        bookmark_interval: float = 10.0,
        service_network: ipaddress.IPv4Network | None = None,
    ) -> None:
        self.host = host
        #: Where ClusterIPs come from (default: all of ``kinds.SERVICE_NETWORK``); a
        #: LocalCluster passes its own block so clusters on one machine never share one.
        self.service_network = service_network
        self.port = port
        self.data_dir = Path(data_dir) if data_dir is not None else Path.cwd()
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.watch_history = watch_history
        self.bookmark_interval = bookmark_interval
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop_event: asyncio.Event | None = None
        self._app: _App | None = None
        self.registry: Registry | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; returns once the server accepts connections."""
        if self._thread is not None:
            raise RuntimeError("ApiServer.start() called twice")
        self._thread = threading.Thread(target=self._run, name="kelastic-apiserver", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(
                f"the API server did not start listening on {self.host}:{self.port} within {timeout}s"
            )
        if self._error is not None:
            raise RuntimeError(
                f"the API server failed to start on {self.host}:{self.port}: {self._error}"
            ) from self._error

    def stop(self, timeout: float = 15.0) -> None:
        """Stop serving, end open watches, and write the state (if persisted)."""
        if self._thread is None or self._loop is None:
            return
        loop, stop_event = self._loop, self._stop_event
        if stop_event is not None and loop.is_running():
            loop.call_soon_threadsafe(stop_event.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the API server on {self.url} did not stop within {timeout}s")
        self._thread = None

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the server's loop thread and return its result (tests, tools)."""
        if self._loop is None:
            raise RuntimeError("the API server is not running")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def compact(self) -> None:
        """Forget the watch history: watches resuming from an older resourceVersion get 410 Gone."""
        assert self.registry is not None
        self.call(self.registry.store.compact)

    def write_kubeconfig(self, path: Path | str, context: str = "kelastic-local") -> Path:
        """Write a kubeconfig for this server (plain HTTP, no credentials); returns its path."""
        if self.port == 0:
            raise RuntimeError("write_kubeconfig() needs the server's port: call start() first")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": {}}],
            "contexts": [
                {"name": context, "context": {"cluster": context, "user": context, "namespace": "default"}}
            ],
            "current-context": context,
            "preferences": {},
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(tmp, path)
        return path

    # ---- the server thread ------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start() when it happens before ready
            self._error = exc
            if self._ready.is_set():
                log.exception("the API server stopped with an error")
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        store = Store(history_size=self.watch_history, state_dir=self.state_dir)
        store.load()
        types = TypeRegistry()
        registry = Registry(store, types)
        if self.service_network is not None:
            registry.services = kinds.ServiceAddresses(self.service_network)
        self.registry = registry
        GarbageCollector(registry)
        DisruptionController(registry)
        registry.bootstrap()
        app_state = _App(registry, self.data_dir, self.bookmark_interval)
        self._app = app_state
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", app_state.handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        await site.start()
        if runner.addresses:  # the port the kernel chose when asked for 0
            self.port = runner.addresses[0][1]
        app_state.server_address = f"{self.host}:{self.port}"
        # Building the built-in kinds' OpenAPI schemas takes a moment: do it off the loop, once.
        per_gv = [types.in_group_version(g, v) for g, vs in types.group_versions().items() for v in vs]
        asyncio.get_running_loop().run_in_executor(None, lambda: [component_schemas(ts) for ts in per_gv])
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            app_state.stopping = True
            store.close_watchers()
            await runner.cleanup()
            store.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kelastic.localcluster.apiserver",
        description="Serve the kelastic local Kubernetes API server (debugging).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6443)
    parser.add_argument("--data-dir", type=Path, default=Path.cwd(), help="where pod logs are read from")
    parser.add_argument("--state-dir", type=Path, default=None, help="persist objects here")
    parser.add_argument("--kubeconfig", type=Path, default=None, help="write a kubeconfig here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = ApiServer(args.host, args.port, args.data_dir, args.state_dir)
    server.start()
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig)
        print(f"kubeconfig written to {args.kubeconfig}", flush=True)
    print(f"API server listening on {server.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

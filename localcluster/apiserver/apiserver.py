"""The Kubernetes API server of ``kelastic local``: plain HTTP on a loopback address.

:class:`ApiServer` serves the Kubernetes REST API (discovery, OpenAPI, CRUD,
list/watch, subresources, Table output, pod logs) with aiohttp on its own event
loop in a background thread. What a path names is decided in :mod:`.routing`; the
handlers here answer each verb, with the request's options and the answers' encoding in
:mod:`.httpio`, watches in :mod:`.watchstream` and pod logs in :mod:`.logstream`. Object
semantics live in :mod:`.registry`, storage in :mod:`.storage`, garbage collection in
:mod:`.gc`.

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
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from . import discovery, kinds, openapi
from .disruption import DisruptionController
from .errors import ApiError, status_object
from .eviction import evict
from .fields import component_schemas
from .gc import GarbageCollector
from .httpio import (
    ObjectEncoder,
    accept_as,
    delete_options,
    dry_run,
    dumps,
    error_response,
    field_manager,
    field_validation,
    flag,
    int_param,
    json_response,
    read_body,
)
from .logstream import serve_logs
from .registry import PatchType, Registry
from .registry_types import Obj
from .resources import ResourceType, TypeRegistry
from .routing import EndpointKind, Route, not_found_path, resolve
from .storage import Store
from .table import to_table
from .watchstream import serve_watch

__all__ = ["ApiServer", "main"]

log = logging.getLogger(__name__)

_V2_PROTOBUF = "application/octet-stream"


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


class _App:
    """The aiohttp request handlers over one registry: :mod:`.routing` says what a path
    names, each handler below answers one kind of endpoint or one verb of a resource."""

    def __init__(self, registry: Registry, data_dir: Path, bookmark_interval: float) -> None:
        self.registry = registry
        self.types = registry.types
        self.store = registry.store
        self.data_dir = data_dir
        self.bookmark_interval = bookmark_interval
        self.encoder = ObjectEncoder()
        self.server_address = ""
        self.stopping = False
        self._openapi_cache: dict[tuple[Any, ...], tuple[bytes, str]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as err:
            return error_response(err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("internal error serving %s %s", request.method, request.path)
            return error_response(ApiError(500, "InternalError", f"Internal error occurred: {exc}"))

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        endpoint = resolve(self.types, request.path)
        kind = endpoint.kind
        if kind is EndpointKind.RESOURCE:
            assert endpoint.route is not None
            return await self._resource(request, endpoint.route)
        if kind is EndpointKind.HEALTH:
            return web.Response(text="ok")
        if kind is EndpointKind.OPENAPI:
            return self._openapi(request, list(endpoint.rest))
        doc: Obj | None
        if kind is EndpointKind.VERSION:
            doc = discovery.version_info()
        elif kind is EndpointKind.CORE_VERSIONS:
            doc = discovery.api_versions(self.server_address)
        elif kind is EndpointKind.GROUPS:
            doc = discovery.api_group_list(self.types)
        elif kind is EndpointKind.GROUP:
            doc = discovery.api_group(self.types, endpoint.group)
        else:
            doc = discovery.resource_list(self.types, endpoint.group, endpoint.version)
        if doc is None:
            raise not_found_path()
        return json_response(doc)

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
            return dumps(openapi.swagger_v2(self.types)), "application/json"
        if rest == ["v3"]:
            return dumps(openapi.v3_root(self.types)), "application/json"
        if rest[:1] == ["v3"] and len(rest) >= 3:
            if rest[1] == "api":
                doc = openapi.gv_document(self.types, "", rest[2])
            elif rest[1] == "apis" and len(rest) == 4:
                doc = openapi.gv_document(self.types, rest[2], rest[3])
            else:
                doc = None
            if doc is not None:
                return dumps(doc), "application/json"
        raise not_found_path()

    # ---- resource requests ------------------------------------------------------------
    async def _resource(self, request: web.Request, r: Route) -> web.StreamResponse:
        handler = {
            "GET": self._get,
            "POST": self._post,
            "PUT": self._put,
            "PATCH": self._patch,
            "DELETE": self._delete,
        }.get(request.method)
        if handler is None:
            raise ApiError.method_not_allowed(f"method {request.method} is not supported")
        return await handler(request, r)

    async def _get(self, request: web.Request, r: Route) -> web.StreamResponse:
        rt, ns, name, sub = r.rt, r.namespace, r.name, r.sub
        if r.watch_path or flag(request.query.get("watch")):
            return await serve_watch(
                request, r, self.registry, self.encoder, self.bookmark_interval, lambda: self.stopping
            )
        if name is None:
            if "list" not in rt.verbs:
                raise ApiError.method_not_allowed(f"{rt.plural} cannot be listed")
            return self._list(request, r)
        if sub == "scale":
            return json_response(self.registry.scale.get(rt, ns, name))
        if sub == "log":
            return await serve_logs(
                request, self.registry, self.data_dir, ns or "", name, lambda: self.stopping
            )
        if sub and sub != "status":
            raise ApiError.method_not_allowed(f"GET is not supported on {rt.plural}/{sub}")
        obj = self.registry.get(rt, ns, name)
        return self._object_response(request, rt, obj)

    async def _post(self, request: web.Request, r: Route) -> web.StreamResponse:
        rt, ns, name, sub = r.rt, r.namespace, r.name, r.sub
        reg = self.registry
        if rt.kind in ("SelfSubjectAccessReview", "SubjectAccessReview") and name is None:
            body = await read_body(request) or {}
            body["status"] = {"allowed": True, "reason": "kelastic local authorizes every request"}
            body.setdefault("apiVersion", rt.api_version)
            body.setdefault("kind", rt.kind)
            return json_response(body, 201)
        body = await read_body(request)
        if name is None:
            res = reg.create(rt, ns, body, validation=field_validation(request), dry_run=dry_run(request))
            return json_response(res.obj, 201, res.warnings)
        if sub == "binding":
            return json_response(self._bind(rt, ns or "", name, body), 201)
        if sub == "eviction":
            return json_response(evict(reg, rt, ns or "", name, body), 201)
        raise ApiError.method_not_allowed(f"POST is not supported on a named {rt.kind}")

    async def _put(self, request: web.Request, r: Route) -> web.StreamResponse:
        rt, ns, name, sub = r.rt, r.namespace, r.name, r.sub
        if name is None:
            raise ApiError.method_not_allowed(f"PUT needs an object name for {rt.plural}")
        body = await read_body(request)
        if sub == "scale":
            res = self.registry.scale.update(rt, ns, name, body, dry_run=dry_run(request))
            return json_response(res.obj)
        if sub == "finalize":
            return json_response(self._finalize_namespace(name, body))
        res = self.registry.update(
            rt,
            ns,
            name,
            body,
            subresource=sub,
            validation=field_validation(request),
            dry_run=dry_run(request),
            manager=field_manager(request),
        )
        return json_response(res.obj, 200, res.warnings)

    async def _patch(self, request: web.Request, r: Route) -> web.StreamResponse:
        rt, name = r.rt, r.name
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
        body = await read_body(request)
        q = request.query
        res = self.registry.patch(
            rt,
            r.namespace,
            name,
            ptype,
            body,
            subresource=r.sub,
            validation=field_validation(request),
            dry_run=dry_run(request),
            field_manager=q.get("fieldManager") if ptype is PatchType.APPLY else field_manager(request),
            force=q.get("force") == "true",
        )
        return json_response(res.obj, 201 if res.created else 200, res.warnings)

    async def _delete(self, request: web.Request, r: Route) -> web.StreamResponse:
        rt, ns, name = r.rt, r.namespace, r.name
        opts = await delete_options(request)
        q = request.query
        if name is None:
            if "deletecollection" not in rt.verbs:
                raise ApiError.method_not_allowed(f"{rt.plural} cannot be deleted as a collection")
            items = self.registry.delete_collection(
                rt, ns, opts, q.get("labelSelector"), q.get("fieldSelector")
            )
            return json_response(
                {
                    "kind": rt.list_kind,
                    "apiVersion": rt.api_version,
                    "metadata": {"resourceVersion": str(self.store.rv)},
                    "items": items,
                }
            )
        obj, removed = self.registry.delete(rt, ns, name, opts)
        if removed and not rt.crd and (rt.group, rt.plural) in RETURN_DELETED:
            return json_response(obj)
        if removed:
            # What most kinds answer for an object gone at once (the kind is the resource).
            meta = obj.get("metadata") or {}
            details = {"name": name, "group": rt.group, "kind": rt.plural, "uid": meta.get("uid")}
            return json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {k: v for k, v in details.items() if v},
                }
            )
        return json_response(obj)

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
    def _object_response(self, request: web.Request, rt: ResourceType, obj: Obj) -> web.Response:
        as_ = accept_as(request)
        if as_ == "Table":
            return json_response(
                to_table(
                    rt,
                    [obj],
                    request.query.get("includeObject", "PartialObjectMetadata"),
                    {"resourceVersion": obj["metadata"].get("resourceVersion", "")},
                )
            )
        if as_.startswith("PartialObjectMetadata"):
            return json_response(
                {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            )
        return json_response(obj)

    def _list(self, request: web.Request, r: Route) -> web.Response:
        q = request.query
        res = self.registry.list(
            r.rt,
            r.namespace,
            label_selector=q.get("labelSelector"),
            field_selector=q.get("fieldSelector"),
            limit=int_param(q.get("limit"), "limit"),
            continue_token=q.get("continue"),
            resource_version=q.get("resourceVersion"),
            resource_version_match=q.get("resourceVersionMatch"),
        )
        meta: Obj = {"resourceVersion": res.resource_version}
        if res.continue_token:
            meta["continue"] = res.continue_token
        if res.remaining is not None:
            meta["remainingItemCount"] = res.remaining
        as_ = accept_as(request)
        if as_ == "Table":
            return json_response(
                to_table(r.rt, res.items, q.get("includeObject", "PartialObjectMetadata"), meta)
            )
        if as_.startswith("PartialObjectMetadata"):
            return json_response(
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
        head = dumps({"kind": r.rt.list_kind, "apiVersion": r.rt.api_version, "metadata": meta})
        items = b",".join(self.encoder.object_bytes(o) for o in res.items)
        body = head[:-1] + b',"items":[' + items + b"]}"
        return web.Response(body=body, content_type="application/json")


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

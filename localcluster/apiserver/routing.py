"""Routing: which part of the API a request path names, decided before any handler runs.

:func:`resolve` turns a path into an :class:`Endpoint`: health and version, the
discovery documents, OpenAPI, or a resource :class:`Route` (group, version, type,
namespace, name, subresource, and whether the path is a ``/watch/…`` one). A path that
names nothing served is the real server's 404 ``the server could not find the requested
resource``. Pure: it reads the served types only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import ApiError
from .resources import ResourceType, TypeRegistry

__all__ = ["Endpoint", "EndpointKind", "Route", "not_found_path", "resolve", "route"]


def not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


@dataclass
class Route:
    """A resource request's target."""

    group: str
    version: str
    rt: ResourceType
    namespace: str | None
    name: str | None
    sub: str
    watch_path: bool


class EndpointKind(enum.Enum):
    HEALTH = "health"
    VERSION = "version"
    CORE_VERSIONS = "api"  # /api
    GROUPS = "apis"  # /apis
    GROUP = "group"  # /apis/GROUP
    RESOURCES = "resources"  # /api/v1, /apis/GROUP/VERSION
    OPENAPI = "openapi"
    RESOURCE = "resource"


@dataclass
class Endpoint:
    """What a path names: its kind, and the parts the handler of that kind needs."""

    kind: EndpointKind
    group: str = ""
    version: str = ""
    rest: tuple[str, ...] = ()  # OPENAPI: the path after /openapi
    route: Route | None = None  # RESOURCE


_PROBES = ("/healthz", "/livez", "/readyz")


def resolve(types: TypeRegistry, path: str) -> Endpoint:
    """The endpoint ``path`` names; 404 for a path that names nothing served."""
    path = path.rstrip("/") or "/"
    parts = [p for p in path.split("/") if p]
    if path in _PROBES or path.startswith(tuple(p + "/" for p in _PROBES)):
        return Endpoint(EndpointKind.HEALTH)
    if path == "/version":
        return Endpoint(EndpointKind.VERSION)
    if path == "/api":
        return Endpoint(EndpointKind.CORE_VERSIONS)
    if path == "/apis":
        return Endpoint(EndpointKind.GROUPS)
    if parts[:1] == ["openapi"]:
        return Endpoint(EndpointKind.OPENAPI, rest=tuple(parts[1:]))
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 2:
        group = parts[1]
        if len(parts) == 2:
            return Endpoint(EndpointKind.GROUP, group)
        version, rest = parts[2], parts[3:]
    else:
        raise not_found_path()
    if not rest:
        return Endpoint(EndpointKind.RESOURCES, group, version)
    return Endpoint(EndpointKind.RESOURCE, group, version, route=route(types, group, version, rest))


def route(types: TypeRegistry, group: str, version: str, rest: list[str]) -> Route:
    """The resource ``rest`` names under ``group``/``version`` (404 when none is served)."""
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
        raise not_found_path()
    rt = types.lookup(group, version, rest[0])
    if rt is None:
        raise not_found_path()
    if namespace is not None and not rt.namespaced:
        raise not_found_path()
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else ""
    if sub and sub not in rt.subresources:
        raise not_found_path()
    return Route(group, version, rt, namespace, name, sub, watch_path)

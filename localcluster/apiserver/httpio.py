"""What every handler of the API server reads from a request and writes back.

In: the body (JSON, YAML or the protobuf of ``kubectl create <kind>``), the query's
options (``fieldValidation``, ``fieldManager``, ``dryRun``, DeleteOptions) and the output
format the client asks for (``Accept: …;as=Table``). Out: JSON answers with ``Warning``
headers, Status errors, and :class:`ObjectEncoder`, which serializes each stored object
version once for every list and watch that sends it. A malformed option is the real
server's 400 or 422.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import yaml
from aiohttp import web

from .errors import ApiError, FieldCause
from .protobuf import ProtobufError, decode_object
from .registry_types import DeleteOptions, FieldValidation, Obj

__all__ = [
    "ObjectEncoder",
    "accept_as",
    "delete_options",
    "dry_run",
    "dumps",
    "error_response",
    "field_manager",
    "field_validation",
    "flag",
    "int_param",
    "json_response",
    "read_body",
]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    """``obj`` as JSON, each of ``warnings`` as a ``Warning: 299 - "…"`` header."""
    resp = web.Response(body=dumps(obj), status=status, content_type="application/json")
    for w in warnings or ():
        resp.headers.add("Warning", '299 - "' + w.replace('"', '\\"') + '"')
    return resp


def error_response(err: ApiError) -> web.Response:
    return json_response(err.to_status(), err.code)


def flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def int_param(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError.bad_request(f"{what} must be an integer, got {value!r}") from None


class ObjectEncoder:
    """Per-event JSON encoding shared by every watcher (objects are immutable once stored)."""

    def __init__(self, size: int = 8192) -> None:
        self._cache: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._size = size

    def object_bytes(self, obj: Obj) -> bytes:
        m = obj["metadata"]
        key = (m.get("uid", ""), m.get("resourceVersion", ""), obj.get("apiVersion", ""))
        data = self._cache.get(key)
        if data is None:
            data = dumps(obj)
            self._cache[key] = data
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return data


async def read_body(request: web.Request) -> Any:
    """The decoded body (None when empty); 415 for bad protobuf, 400 for bad JSON or YAML."""
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


def field_validation(request: web.Request) -> FieldValidation:
    value = request.query.get("fieldValidation") or "Warn"
    try:
        return FieldValidation(value)
    except ValueError:
        options = {"POST": "CreateOptions", "PUT": "UpdateOptions"}.get(request.method, "PatchOptions")
        why = f'Unsupported value: "{value}": supported values: "", "Ignore", "Strict", "Warn"'
        raise ApiError.invalid(
            "meta.k8s.io", options, "", [FieldCause("FieldValueNotSupported", why, "fieldValidation")]
        ) from None


def field_manager(request: web.Request) -> str:
    """Who an update is recorded for in managedFields: ``fieldManager``, else the client's
    User-Agent up to its first ``/`` (as the real server names it)."""
    given = request.query.get("fieldManager")
    if given:
        return given
    return (request.headers.get("User-Agent") or "unknown").split("/", 1)[0][:128]


def dry_run(request: web.Request) -> bool:
    values = request.query.getall("dryRun", [])
    for v in values:
        if v != "All":
            raise ApiError.bad_request(f'dryRun: Unsupported value: "{v}": supported values: "All"')
    return bool(values)


async def delete_options(request: web.Request) -> DeleteOptions:
    """A DELETE's options, from its DeleteOptions body and its query (the body wins)."""
    body = await read_body(request) or {}
    if not isinstance(body, dict):
        raise ApiError.bad_request("the DELETE body must be a DeleteOptions object")
    q = request.query
    policy = body.get("propagationPolicy") or q.get("propagationPolicy")
    orphan = body.get("orphanDependents")
    if orphan is None and "orphanDependents" in q:
        orphan = flag(q.get("orphanDependents"))
    if policy is None and orphan is not None:
        policy = "Orphan" if orphan else "Background"
    grace = body.get("gracePeriodSeconds")
    if grace is None:
        grace = int_param(q.get("gracePeriodSeconds"), "gracePeriodSeconds")
    pre = body.get("preconditions") or {}
    dry = bool(body.get("dryRun")) or dry_run(request)
    return DeleteOptions(policy, grace, pre.get("uid"), pre.get("resourceVersion"), dry)


def accept_as(request: web.Request) -> str:
    """'Table', 'PartialObjectMetadata' (or …List) when the client asks for it, else ''."""
    for part in request.headers.get("Accept", "").split(","):
        params = dict(p.strip().split("=", 1) for p in part.split(";")[1:] if "=" in p)
        as_ = params.get("as")
        if as_ in ("Table", "PartialObjectMetadata", "PartialObjectMetadataList"):
            return as_
        if part.strip().startswith(("application/json", "*/*")) and not as_:
            return ""
    return ""

"""Known fields of the built-in kinds, for field validation and pruning.

A real API server decodes built-in objects into typed structs, so fields it
does not know are dropped (with a warning, or refused under
``fieldValidation=Strict``, which kubectl uses by default). The field sets come
from the models of the official ``kubernetes`` client (their ``attribute_map``
and ``openapi_types``), which describe the same API types.
"""

from __future__ import annotations

import json
import re
from functools import cache, lru_cache
from typing import Any

from kubernetes.client import models

from .resources import ResourceType

__all__ = ["component_schemas", "model_name", "prune_unknown", "schema_ref_name", "time_error"]

Obj = dict[str, Any]

_SCALARS = frozenset({"str", "int", "bool", "float", "datetime", "date", "object", "bytearray"})


def model_name(rt: ResourceType) -> str | None:
    """The client model describing ``rt``'s objects (None for custom resources)."""
    return None if rt.crd else _kind_model(rt.group, rt.kind)


def _kind_model(group: str, kind: str) -> str:
    if kind == "Event":
        return "EventsV1Event" if group == "events.k8s.io" else "CoreV1Event"
    return f"V1{kind}"


@cache
def _fields(name: str) -> dict[str, str] | None:
    """JSON field name -> type string of a client model, or None when there is no such model."""
    model = getattr(models, name, None)
    types = getattr(model, "openapi_types", None)
    attrs = getattr(model, "attribute_map", None)
    if not isinstance(types, dict) or not isinstance(attrs, dict):
        return None
    return {attrs[k]: _normalize(v) for k, v in types.items() if k in attrs}


def _normalize(type_str: str) -> str:
    """Older clients spell containers ``list[X]`` and ``dict(str, X)``; use ``List[X]``/``Dict[str, X]``."""
    if type_str.startswith("list["):
        return "List[" + _normalize(type_str[5:-1]) + "]"
    if type_str.startswith("dict(str, "):
        return "Dict[str, " + _normalize(type_str[10:-1]) + "]"
    return type_str


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


#: JSON kinds each scalar type accepts (None, i.e. null, is accepted everywhere).
_ACCEPTS: dict[str, tuple[str, ...]] = {
    # Quantities are typed as strings but written as numbers too (cpu: 1).
    "str": ("string", "number"),
    "datetime": ("string",),
    "date": ("string",),
    "int": ("number",),
    "float": ("number",),
    "bool": ("bool",),
}


#: The fields of type MicroTime (micro-second times); the other times are Time (seconds).
_MICRO_TIMES = frozenset(
    {("V1LeaseSpec", "acquireTime"), ("V1LeaseSpec", "renewTime"), ("EventsV1Event", "eventTime"),
     ("CoreV1Event", "eventTime")}
)  # fmt: skip
_TIME_LAYOUT = ("2006", "-", "01", "-", "02", "T", "15", ":", "04", ":", "05")


def time_error(value: str, micro: bool) -> str | None:
    """Why ``value`` is not a Kubernetes Time (RFC 3339) or MicroTime (RFC 3339 with
    micro-seconds), in the words of Go's time parser, as the real server says it; None if it is."""
    layout = "2006-01-02T15:04:05" + (".000000" if micro else "") + "Z07:00"
    rest = value
    for element in (*_TIME_LAYOUT, ".000000" if micro else "", "Z07:00"):
        if not element:
            continue
        if element == ".000000" or (element == "Z07:00" and not micro and rest.startswith(".")):
            found = re.match(r"\.\d{6}" if micro else r"\.\d+", rest)
            if found is None:
                if micro:
                    return f'parsing time "{value}" as "{layout}": cannot parse "{rest}" as ".000000"'
            else:
                rest = rest[found.end() :]
            if element == ".000000":
                continue
        if element == "Z07:00":
            found = re.match(r"Z|[+-]\d\d:\d\d", rest)
        elif element.isdigit():
            found = re.match(rf"\d{{{len(element)}}}", rest)
        else:
            found = re.match(re.escape(element), rest)
        if found is None:
            return f'parsing time "{value}" as "{layout}": cannot parse "{rest}" as "{element}"'
        rest = rest[found.end() :]
    if rest:
        return f'parsing time "{value}" as "{layout}": extra text: "{rest}"'
    return None


def _prune(value: Any, type_str: str, path: str, dropped: list[str], wrong: list[str]) -> Any:
    if value is None:
        return value
    if type_str in _SCALARS:
        accepts = _ACCEPTS.get(type_str)
        if accepts is not None and (
            _json_kind(value) not in accepts
            or (type_str == "int" and isinstance(value, float) and not value.is_integer())
        ):
            wrong.append(f"{path}: expected {type_str}, got {_json_kind(value)} {value!r}")
        return value
    if type_str.startswith("List["):
        if not isinstance(value, list):
            wrong.append(f"{path}: expected an array, got {_json_kind(value)}")
            return value
        inner = type_str[5:-1]
        return [_prune(v, inner, f"{path}[{i}]", dropped, wrong) for i, v in enumerate(value)]
    if type_str.startswith("Dict[str, "):
        if not isinstance(value, dict):
            wrong.append(f"{path}: expected an object, got {_json_kind(value)}")
            return value
        inner = type_str[10:-1]
        return {k: _prune(v, inner, f"{path}.{k}", dropped, wrong) for k, v in value.items()}
    fields = _fields(type_str)
    if fields is None:
        return value
    if not isinstance(value, dict):
        wrong.append(f"{path}: expected an object, got {_json_kind(value)}")
        return value
    out: Obj = {}
    for k, v in value.items():
        sub = fields.get(k)
        where = f"{path}.{k}" if path else k
        if sub is None:
            dropped.append(where)
            continue
        if sub == "datetime" and isinstance(v, str):
            error = time_error(v, (type_str, k) in _MICRO_TIMES)
            if error:
                wrong.append(error)
        out[k] = _prune(v, sub, where, dropped, wrong)
    return out


def prune_unknown(rt: ResourceType, obj: Obj) -> tuple[Obj, list[str], list[str]]:
    """``obj`` without fields its kind does not have, the paths of those dropped, and type errors."""
    name = model_name(rt)
    if name is None or _fields(name) is None:
        return obj, [], []
    dropped: list[str] = []
    wrong: list[str] = []
    return _prune(obj, name, "", dropped, wrong), dropped, wrong


_PREFIX = re.compile(r"^([A-Z][a-z]*?)?(V\d+(?:alpha\d+|beta\d+)?)(.+)$")
_SCALAR_SCHEMAS: dict[str, Obj] = {
    "str": {"type": "string"},
    "int": {"type": "integer", "format": "int64"},
    "bool": {"type": "boolean"},
    "float": {"type": "number", "format": "double"},
    "datetime": {"type": "string", "format": "date-time"},
    "date": {"type": "string", "format": "date"},
    "object": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    "bytearray": {"type": "string", "format": "byte"},
}


def schema_ref_name(name: str) -> str:
    """A client model's name as an OpenAPI component name (``V1PodSpec`` -> ``io.k8s.api.v1.PodSpec``)."""
    m = _PREFIX.match(name)
    if not m:
        return f"io.k8s.api.{name}"
    prefix = (m.group(1) or "").lower()
    return f"io.k8s.api.{prefix + '.' if prefix else ''}{m.group(2).lower()}.{m.group(3)}"


def _description(model: Any) -> str:
    doc = (getattr(model, "__doc__", "") or "").strip()
    return doc.split("\n\n")[0].strip() if not doc.startswith("NOTE") else ""


def _schema_of(type_str: str, out: dict[str, Obj]) -> Obj:
    if type_str in _SCALAR_SCHEMAS:
        return dict(_SCALAR_SCHEMAS[type_str])
    if type_str.startswith("List["):
        return {"type": "array", "items": _schema_of(type_str[5:-1], out)}
    if type_str.startswith("Dict[str, "):
        return {"type": "object", "additionalProperties": _schema_of(type_str[10:-1], out)}
    if _fields(type_str) is None:
        return {"type": "object"}
    _collect(type_str, out)
    return {"allOf": [{"$ref": f"#/components/schemas/{schema_ref_name(type_str)}"}]}


def _collect(name: str, out: dict[str, Obj]) -> None:
    ref = schema_ref_name(name)
    if ref in out:
        return
    model = getattr(models, name)
    schema: Obj = {"type": "object", "description": _description(model), "properties": {}}
    out[ref] = schema  # registered before recursing: models refer to each other
    infos = getattr(model, "model_fields", {}) or {}
    attrs = model.attribute_map
    for attr, raw_type in model.openapi_types.items():
        type_str = _normalize(raw_type)
        prop = _schema_of(type_str, out)
        info = infos.get(attr)
        desc = getattr(info, "description", None)
        if desc:
            prop["description"] = desc
        schema["properties"][attrs[attr]] = prop


@lru_cache(maxsize=64)
def _component_schemas_cached(kinds: tuple[tuple[str, str, str], ...]) -> str:
    out: dict[str, Obj] = {}
    for group, version, kind in kinds:
        name = _kind_model(group, kind)
        if _fields(name) is None:
            continue
        _collect(name, out)
        out[schema_ref_name(name)]["x-kubernetes-group-version-kind"] = [
            {"group": group, "version": version, "kind": kind}
        ]
    return json.dumps(out)


def component_schemas(types: list[ResourceType]) -> dict[str, Obj]:
    """OpenAPI component schemas of built-in kinds (with field descriptions), for ``kubectl explain``."""
    kinds = tuple(sorted((t.group, t.version, t.kind) for t in types if not t.crd))
    return json.loads(_component_schemas_cached(kinds))

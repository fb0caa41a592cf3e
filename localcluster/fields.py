"""Known fields of the built-in kinds, for field validation and pruning.

A real API server decodes built-in objects into typed structs, so fields it
does not know are dropped (with a warning, or refused under
``fieldValidation=Strict``, which kubectl uses by default). The field sets come
from the models of the official ``kubernetes`` client (their ``attribute_map``
and ``openapi_types``), which describe the same API types.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from kubernetes.client import models

from .resources import ResourceType

__all__ = ["model_name", "prune_unknown"]

Obj = dict[str, Any]

_SCALARS = frozenset({"str", "int", "bool", "float", "datetime", "date", "object", "bytearray"})


def model_name(rt: ResourceType) -> str | None:
    """The client model describing ``rt``'s objects (None for custom resources)."""
    if rt.crd:
        return None
    if rt.kind == "Event":
        return "EventsV1Event" if rt.group == "events.k8s.io" else "CoreV1Event"
    return f"V1{rt.kind}"


@cache
def _fields(name: str) -> dict[str, str] | None:
    """JSON field name -> type string of a client model, or None when there is no such model."""
    model = getattr(models, name, None)
    types = getattr(model, "openapi_types", None)
    attrs = getattr(model, "attribute_map", None)
    if not isinstance(types, dict) or not isinstance(attrs, dict):
        return None
    return {attrs[k]: v for k, v in types.items() if k in attrs}


def _prune(value: Any, type_str: str, path: str, dropped: list[str]) -> Any:
    if type_str in _SCALARS:
        return value
    if type_str.startswith("List[") and isinstance(value, list):
        inner = type_str[5:-1]
        if inner in _SCALARS:
            return value
        return [_prune(v, inner, f"{path}[{i}]", dropped) for i, v in enumerate(value)]
    if type_str.startswith("Dict[str, ") and isinstance(value, dict):
        inner = type_str[10:-1]
        if inner in _SCALARS:
            return value
        return {k: _prune(v, inner, f"{path}.{k}", dropped) for k, v in value.items()}
    fields = _fields(type_str)
    if fields is None or not isinstance(value, dict):
        return value
    out: Obj = {}
    for k, v in value.items():
        sub = fields.get(k)
        where = f"{path}.{k}" if path else k
        if sub is None:
            dropped.append(where)
        else:
            out[k] = _prune(v, sub, where, dropped)
    return out


def prune_unknown(rt: ResourceType, obj: Obj) -> tuple[Obj, list[str]]:
    """``obj`` without fields its kind does not have, and the paths of those dropped."""
    name = model_name(rt)
    if name is None or _fields(name) is None:
        return obj, []
    dropped: list[str] = []
    return _prune(obj, name, "", dropped), dropped

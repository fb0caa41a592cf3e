"""Server-side apply, reduced to what ``kubectl apply --server-side`` relies on.

Each apply manager's fields are recorded in ``metadata.managedFields`` (an entry
with ``operation: Apply`` and a ``fieldsV1`` set, in the API's format:
``f:<field>``, ``k:{<merge key>}`` for list elements, ``v:<value>`` for set
members). When a manager applies again, the fields it owned before but no longer
sets are removed, then its configuration is merged in. An apply that would
change a field another apply manager owns is a conflict (409, one cause per
field, as the API server answers) unless forced (``force=true``), which moves
the field to the applying manager. Fields written by updates are not tracked.
All functions are pure.
"""

from __future__ import annotations

import json
from typing import Any

from .patch import clone, merge_key_for

__all__ = [
    "applied_fields",
    "conflict_message",
    "conflicts",
    "owned_fields",
    "record",
    "release",
    "removed_fields",
    "without_fields",
]

Obj = dict[str, Any]
_ROOT_SKIP = ("apiVersion", "kind")
_META_SKIP = ("name", "namespace", "managedFields", "resourceVersion", "uid")


def applied_fields(config: Obj, merge_keys: bool) -> Obj:
    """The fieldsV1 set of an applied configuration."""
    out: Obj = {}
    for k, v in config.items():
        if k in _ROOT_SKIP:
            continue
        if k == "metadata" and isinstance(v, dict):
            meta = {mk: mv for mk, mv in v.items() if mk not in _META_SKIP}
            if meta:
                out["f:metadata"] = _fields(meta, ("metadata",), merge_keys)
            continue
        out[f"f:{k}"] = _value_fields(v, (k,), merge_keys)
    return out


def _fields(config: Obj, path: tuple[str, ...], merge_keys: bool) -> Obj:
    return {f"f:{k}": _value_fields(v, (*path, k), merge_keys) for k, v in config.items()}


def _value_fields(value: Any, path: tuple[str, ...], merge_keys: bool) -> Obj:
    if isinstance(value, dict):
        return _fields(value, path, merge_keys)
    if isinstance(value, list):
        key = merge_key_for(path) if merge_keys else None
        if key and all(isinstance(i, dict) and key in i for i in value):
            return {
                "k:" + json.dumps({key: item[key]}, separators=(",", ":")): {
                    ".": {},
                    **_fields(item, path, True),
                }
                for item in value
            }
        if path[-1] == "finalizers":
            return {"v:" + json.dumps(v): {} for v in value}
    return {}


def owned_fields(obj: Obj, manager: str) -> Obj:
    """The fields ``manager`` last applied to ``obj`` (empty if it never applied)."""
    for entry in obj.get("metadata", {}).get("managedFields") or ():
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            return entry.get("fieldsV1") or {}
    return {}


def removed_fields(before: Obj, after: Obj) -> Obj:
    """What ``before`` has that ``after`` lacks: ``None`` marks a whole field, a dict a partial one."""
    out: Obj = {}
    for k, sub in before.items():
        if k == ".":
            continue
        if k not in after:
            out[k] = None
        elif sub and after[k]:
            nested = removed_fields(sub, after[k])
            if nested:
                out[k] = nested
    return out


def _matches(item: Any, key: str) -> bool:
    want = json.loads(key[2:])
    return isinstance(item, dict) and all(item.get(k) == v for k, v in want.items())


def without_fields(obj: Any, removed: Obj) -> Any:
    """``obj`` without the fields of ``removed`` (see :func:`removed_fields`)."""
    if isinstance(obj, dict):
        out = dict(obj)
        for k, sub in removed.items():
            if not k.startswith("f:"):
                continue
            name = k[2:]
            if name not in out:
                continue
            if sub is None:
                del out[name]
            else:
                out[name] = without_fields(out[name], sub)
        return out
    if isinstance(obj, list):
        items = list(obj)
        for k, sub in removed.items():
            if k.startswith("k:"):
                idx = next((i for i, item in enumerate(items) if _matches(item, k)), None)
                if idx is not None:
                    if sub is None:
                        items.pop(idx)
                    else:
                        items[idx] = without_fields(items[idx], sub)
            elif k.startswith("v:") and sub is None:
                value = json.loads(k[2:])
                items = [i for i in items if i != value]
        return items
    return obj


def record(managed: list[Obj] | None, manager: str, api_version: str, fields: Obj, now: str) -> list[Obj]:
    """managedFields with ``manager``'s Apply entry set to ``fields`` (its time kept when unchanged)."""
    out = []
    found = False
    for entry in managed or ():
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            found = True
            if entry.get("fieldsV1") == fields and entry.get("apiVersion") == api_version:
                out.append(entry)
                continue
            entry = {**clone(entry), "fieldsV1": fields, "apiVersion": api_version, "time": now}
        out.append(entry)
    if not found:
        out.append(
            {
                "manager": manager,
                "operation": "Apply",
                "apiVersion": api_version,
                "time": now,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields,
            }
        )
    return out


def _leaves(fields: Obj, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths (fieldsV1 keys) of the leaves of a fieldsV1 set."""
    out: list[tuple[str, ...]] = []
    for k, sub in fields.items():
        if k == ".":
            continue
        children = {c: v for c, v in (sub or {}).items() if c != "."}
        if children:
            out.extend(_leaves(children, (*prefix, k)))
        else:
            out.append((*prefix, k))
    return out


def _contains(fields: Obj, path: tuple[str, ...]) -> bool:
    node: Any = fields
    for k in path:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


_MISSING = object()


def _value_at(obj: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if k.startswith("f:") and isinstance(obj, dict):
            obj = obj.get(k[2:], _MISSING)
        elif k.startswith("k:") and isinstance(obj, list):
            obj = next((i for i in obj if _matches(i, k)), _MISSING)
        elif k.startswith("v:") and isinstance(obj, list):
            obj = json.loads(k[2:]) if json.loads(k[2:]) in obj else _MISSING
        else:
            return _MISSING
        if obj is _MISSING:
            return obj
    return obj


def _display(path: tuple[str, ...]) -> str:
    out = ""
    for k in path:
        if k.startswith("f:"):
            out += "." + k[2:]
        elif k.startswith("k:"):
            out += "[" + ",".join(f"{a}={json.dumps(b)}" for a, b in json.loads(k[2:]).items()) + "]"
        else:
            out += f"[{k[2:]}]"
    return out


def conflicts(obj: Obj, manager: str, fields: Obj, config: Obj) -> dict[str, list[tuple[str, ...]]]:
    """Fields other apply managers own that applying ``config`` would change, by manager."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for entry in obj.get("metadata", {}).get("managedFields") or ():
        other = entry.get("manager")
        if other == manager or entry.get("operation") != "Apply":
            continue
        owned = entry.get("fieldsV1") or {}
        for path in _leaves(fields):
            if _contains(owned, path) and _value_at(obj, path) != _value_at(config, path):
                out.setdefault(str(other), []).append(path)
    return out


def conflict_message(clashes: dict[str, list[tuple[str, ...]]]) -> tuple[str, list[tuple[str, str]]]:
    """The API server's message and (message, field) causes for ``clashes``."""
    causes = [(f'conflict with "{m}"', _display(p)) for m, paths in clashes.items() for p in paths]
    count = len(causes)
    listed = "\n".join(f"{message}: {field}" for message, field in causes)
    return f"Apply failed with {count} conflict{'s' if count != 1 else ''}: {listed}", causes


def release(managed: list[Obj] | None, clashes: dict[str, list[tuple[str, ...]]]) -> list[Obj]:
    """managedFields with the clashing fields taken from their previous owners (a forced apply)."""
    out = []
    for entry in managed or ():
        paths = clashes.get(str(entry.get("manager"))) if entry.get("operation") == "Apply" else None
        if paths:
            fields = clone(entry.get("fieldsV1") or {})
            for path in paths:
                node = fields
                for k in path[:-1]:
                    node = node.get(k) or {}
                node.pop(path[-1], None)
            entry = {**clone(entry), "fieldsV1": fields}
        out.append(entry)
    return out

"""Server-side apply, reduced to what ``kubectl apply --server-side`` relies on.

Each apply manager's fields are recorded in ``metadata.managedFields`` (an entry
with ``operation: Apply`` and a ``fieldsV1`` set, in the API's format:
``f:<field>``, ``k:{<merge key>}`` for list elements, ``v:<value>`` for set
members). When a manager applies again, the fields it owned before but no longer
sets are removed (unless another manager owns them too), then its configuration is
merged in. An apply that would change a field another manager owns is a conflict
(409, one cause per field, as the API server answers) unless forced
(``force=true``), which moves the field to the applying manager. An update (PUT or
a non-apply PATCH) records its manager with ``operation: Update`` and the fields it
changed, which it takes from every other manager (:func:`record_update`).
All functions are pure.
"""

from __future__ import annotations

import json
from typing import Any

from .patch import clone, merge_key_for

__all__ = [
    "applied_fields",
    "changed_fields",
    "conflict_message",
    "conflicts",
    "owned_fields",
    "record",
    "record_update",
    "release",
    "removed_fields",
    "unshared_removal",
    "without_fields",
]

Obj = dict[str, Any]
_ROOT_SKIP = ("apiVersion", "kind")
_META_SKIP = (
    "name", "namespace", "managedFields", "resourceVersion", "uid", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink",
)  # fmt: skip


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


def _who(entry: Obj) -> str:
    """How a conflict names a manager: an updater with the version it wrote."""
    if entry.get("operation") == "Update":
        return f'"{entry.get("manager")}" using {entry.get("apiVersion")}'
    return f'"{entry.get("manager")}"'


def conflicts(obj: Obj, manager: str, fields: Obj, config: Obj) -> dict[str, list[tuple[str, ...]]]:
    """Fields other managers own that applying ``config`` would change, by manager (as named
    in the conflict's message)."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for entry in obj.get("metadata", {}).get("managedFields") or ():
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            continue
        owned = entry.get("fieldsV1") or {}
        for path in _leaves(fields):
            if _contains(owned, path) and _value_at(obj, path) != _value_at(config, path):
                out.setdefault(_who(entry), []).append(path)
    return out


def conflict_message(clashes: dict[str, list[tuple[str, ...]]]) -> tuple[str, list[tuple[str, str]]]:
    """The API server's message and (message, field) causes for ``clashes``."""
    causes = [(f"conflict with {m}", _display(p)) for m, paths in clashes.items() for p in paths]
    count = len(causes)
    listed = "\n".join(f"{message}: {field}" for message, field in causes)
    return f"Apply failed with {count} conflict{'s' if count != 1 else ''}: {listed}", causes


def release(managed: list[Obj] | None, clashes: dict[str, list[tuple[str, ...]]]) -> list[Obj]:
    """managedFields with the clashing fields taken from their previous owners (a forced apply)."""
    out = []
    for entry in managed or ():
        paths = clashes.get(_who(entry))
        if paths:
            entry = {**clone(entry), "fieldsV1": _without_paths(entry.get("fieldsV1") or {}, paths)}
            if not _leaves(entry["fieldsV1"]):
                continue
        out.append(entry)
    return out


def _without_paths(fields: Obj, paths: list[tuple[str, ...]]) -> Obj:
    """A fieldsV1 set without the leaves ``paths`` (and the parents they leave empty)."""
    out = clone(fields)
    for path in paths:
        trail = [out]
        for k in path[:-1]:
            nxt = trail[-1].get(k)
            if not isinstance(nxt, dict):
                break
            trail.append(nxt)
        else:
            trail[-1].pop(path[-1], None)
            for parent, k in zip(reversed(trail[:-1]), reversed(path[:-1]), strict=True):
                if not {c for c in parent.get(k, {}) if c != "."}:
                    parent.pop(k, None)
    return out


def _from_paths(paths: list[tuple[str, ...]], leaf: Any) -> Obj:
    out: Obj = {}
    for path in paths:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = clone(leaf)
    return out


def unshared_removal(obj: Obj, manager: str, fields: Obj) -> Obj:
    """What ``manager``'s new apply of ``fields`` removes (see :func:`removed_fields`): the
    fields it applied before and no longer does, except those another manager owns too."""
    others = [
        e.get("fieldsV1") or {}
        for e in obj.get("metadata", {}).get("managedFields") or ()
        if not (e.get("manager") == manager and e.get("operation") == "Apply")
    ]
    dropped = [
        p
        for p in _leaves(owned_fields(obj, manager))
        if not _contains(fields, p) and not any(_contains(o, p) for o in others)
    ]
    return _from_paths(dropped, None)


def changed_fields(old: Obj, new: Obj, merge_keys: bool, subresource: str = "") -> Obj:
    """The fieldsV1 set of what an update changed (added or altered) from ``old`` to ``new``;
    only ``status`` for the status subresource, everything but ``status`` otherwise."""

    def part(obj: Obj) -> Obj:
        if subresource == "status":
            return {"status": obj.get("status")} if "status" in obj else {}
        return {k: v for k, v in obj.items() if k != "status"}

    before, after = part(old), part(new)
    paths = [
        p for p in _leaves(applied_fields(after, merge_keys)) if _value_at(before, p) != _value_at(after, p)
    ]
    return _from_paths(paths, {})


def record_update(
    managed: list[Obj] | None, manager: str, api_version: str, changed: Obj, now: str, subresource: str = ""
) -> list[Obj]:
    """managedFields after ``manager`` updated the ``changed`` fields: they are its (its Update
    entry for this subresource, made or extended) and no other manager's any more."""
    paths = _leaves(changed)
    if not paths:
        return list(managed or ())
    out: list[Obj] = []
    mine: Obj | None = None
    for entry in managed or ():
        is_mine = (
            entry.get("manager") == manager
            and entry.get("operation") == "Update"
            and entry.get("subresource", "") == subresource
        )
        if is_mine:
            mine = entry
            continue
        fields = _without_paths(entry.get("fieldsV1") or {}, paths)
        if _leaves(fields):
            out.append({**entry, "fieldsV1": fields} if fields != entry.get("fieldsV1") else entry)
    merged = _merge_fields(clone((mine or {}).get("fieldsV1") or {}), changed)
    entry = {
        "manager": manager,
        "operation": "Update",
        "apiVersion": api_version,
        "time": now,
        "fieldsType": "FieldsV1",
        "fieldsV1": merged,
    }
    if subresource:
        entry["subresource"] = subresource
    out.append(entry)
    return out


def _merge_fields(into: Obj, more: Obj) -> Obj:
    for k, sub in more.items():
        if isinstance(sub, dict) and isinstance(into.get(k), dict):
            _merge_fields(into[k], sub)
        else:
            into[k] = clone(sub)
    return into

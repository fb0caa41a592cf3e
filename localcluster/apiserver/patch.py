"""The three PATCH formats of the Kubernetes API, as pure functions.

- :func:`merge_patch` — JSON merge patch (RFC 7386), ``application/merge-patch+json``.
- :func:`json_patch` — JSON patch (RFC 6902), ``application/json-patch+json``.
- :func:`strategic_merge_patch` — ``application/strategic-merge-patch+json`` for
  built-in kinds: lists with a patch merge key (containers, env, ports, volumes,
  conditions, …) are merged element by element, ``finalizers`` is merged as a
  set, and the directives kubectl's client-side apply sends (``$patch``,
  ``$setElementOrder/…``, ``$retainKeys``, ``$deleteFromPrimitiveList/…``) are
  honoured.

Inputs are never mutated; each function returns a new document. Malformed
patches raise :class:`PatchError` with a message naming the problem.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PatchError", "clone", "json_patch", "merge_key_for", "merge_patch", "strategic_merge_patch"]


def clone(value: Any) -> Any:
    """A deep copy of a JSON document (dicts, lists, scalars), several times faster than deepcopy."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


class PatchError(ValueError):
    """The patch cannot be applied to the document."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# ---- JSON patch --------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON patch path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, path: str, allow_end: bool = False) -> int:
    if token == "-" and allow_end:
        return len(container)
    try:
        i = int(token)
    except ValueError:
        raise PatchError(f"JSON patch path {path!r}: {token!r} is not an array index") from None
    if i < 0 or i > len(container) or (i == len(container) and not allow_end):
        raise PatchError(f"JSON patch path {path!r}: index {i} out of range")
    return i


def _walk(doc: Any, tokens: list[str], path: str) -> Any:
    cur = doc
    for t in tokens:
        if isinstance(cur, dict):
            if t not in cur:
                raise PatchError(f"JSON patch path {path!r}: missing key {t!r}")
            cur = cur[t]
        elif isinstance(cur, list):
            cur = cur[_index(cur, t, path)]
        else:
            raise PatchError(f"JSON patch path {path!r}: cannot descend into a scalar")
    return cur


def _add(doc: Any, tokens: list[str], value: Any, path: str) -> Any:
    if not tokens:
        return value
    parent = _walk(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path, allow_end=True), value)
    else:
        raise PatchError(f"JSON patch path {path!r}: parent is not an object or array")
    return doc


def _remove(doc: Any, tokens: list[str], path: str) -> Any:
    if not tokens:
        raise PatchError("JSON patch cannot remove the whole document")
    parent = _walk(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"JSON patch path {path!r}: missing key {last!r}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, path))
    raise PatchError(f"JSON patch path {path!r}: parent is not an object or array")


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902: apply ``ops`` (a list of operations) to a copy of ``doc``."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    out = clone(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"JSON patch operation {op!r} needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        tokens = _pointer(path)
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"JSON patch operation {kind} at {path!r} needs 'value'")
        if kind == "add":
            out = _add(out, tokens, clone(op["value"]), path)
        elif kind == "remove":
            _remove(out, tokens, path)
        elif kind == "replace":
            _walk(out, tokens, path)  # must exist
            if tokens:
                _remove(out, tokens, path)
            out = _add(out, tokens, clone(op["value"]), path)
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = clone(_walk(out, src, op.get("from", "")))
            if kind == "move":
                _remove(out, src, op.get("from", ""))
            out = _add(out, tokens, value, path)
        elif kind == "test":
            if _walk(out, tokens, path) != op["value"]:
                raise PatchError(f"JSON patch test failed at {path!r}")
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return out


# ---- strategic merge patch ---------------------------------------------------

_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
#: The lists with a patch merge key in k8s.io/api. Any other list is atomic, replaced whole:
#: ``containerStatuses`` and ``initContainerStatuses`` among them (``+listType=atomic``), so a
#: kubelet's status write replaces each container's ``state`` rather than adding a second one.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
}
#: Lists of scalars merged as sets.
_SET_LISTS = ("finalizers",)


def merge_key_for(path: tuple[str, ...]) -> str | None:
    """The patch merge key of the list at ``path`` (field names from the root), if any."""
    if not path:
        return None
    name = path[-1]
    if name == "ports":
        if any(p in _CONTAINER_LISTS for p in path[:-1]):
            return "containerPort"
        if path[:-1] == ("spec",):
            return "port"  # Service.spec.ports
        return None
    return _MERGE_KEYS.get(name)


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Apply a strategic merge patch to a built-in kind's object (see module docstring)."""
    if not isinstance(patch, dict):
        return clone(patch)
    base = dict(target) if isinstance(target, dict) else {}
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: clone(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    retain = patch.get("$retainKeys")
    orders: dict[str, list[Any]] = {}
    for k, v in patch.items():
        if k.startswith("$setElementOrder/"):
            orders[k.split("/", 1)[1]] = v
        elif k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            if isinstance(base.get(field), list):
                base[field] = [x for x in base[field] if x not in (v or [])]
        elif k.startswith("$"):
            continue
        elif v is None:
            base.pop(k, None)
        else:
            base[k] = _smp_value(base.get(k), v, (*path, k))
            if base[k] is None:
                base.pop(k)
    for field, order in orders.items():
        if isinstance(base.get(field), list):
            base[field] = _reorder(base[field], order, merge_key_for((*path, field)))
    if isinstance(retain, list):
        keep = set(retain)
        base = {k: v for k, v in base.items() if k in keep}
    return base


def _smp_value(current: Any, patch: Any, path: tuple[str, ...]) -> Any:
    if isinstance(patch, dict):
        return strategic_merge_patch(current, patch, path)
    if isinstance(patch, list):
        key = merge_key_for(path)
        if key is not None and isinstance(current, list):
            return _merge_list(current, patch, key, path)
        if path[-1] in _SET_LISTS and isinstance(current, list):
            out = list(current)
            out.extend(x for x in patch if x not in out)
            return out
        return [x for x in clone(patch) if not (isinstance(x, dict) and x.get("$patch"))]
    return clone(patch)


def _merge_list(current: list[Any], patch: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [clone(p) for p in patch if not (isinstance(p, dict) and "$patch" in p)]
    out = list(current)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            out.append(clone(item))
            continue
        idx = next((i for i, e in enumerate(out) if isinstance(e, dict) and e.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(strategic_merge_patch({}, item, path))
        else:
            out[idx] = strategic_merge_patch(out[idx], item, path)
    return out


def _reorder(items: list[Any], order: list[Any], key: str | None) -> list[Any]:
    def ident(x: Any) -> Any:
        if key is not None and isinstance(x, dict):
            return x.get(key)
        return x if not isinstance(x, dict) else None

    wanted = [ident(o) for o in order]
    rank = {w: i for i, w in enumerate(wanted) if w is not None}
    indexed = list(enumerate(items))
    indexed.sort(key=lambda p: (rank.get(ident(p[1]), len(rank) + p[0]), p[0]))
    return [x for _, x in indexed]

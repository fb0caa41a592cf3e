"""Structural ``openAPIV3Schema`` handling for custom resources.

Three pure steps, applied on every write in the order the API server uses:
:func:`prune` (drop fields the schema does not declare, reporting their paths),
:func:`apply_defaults`, then :func:`validate`, which returns field causes for a
422 Invalid with the same wording a real API server uses (``spec.replicas:
Invalid value: 0: spec.replicas in body should be greater than or equal to 1``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .cel import MISSING, CelError, Optional, compile_rule
from .errors import FieldCause
from .patch import clone

__all__ = ["apply_defaults", "prune", "validate", "validate_rules"]

Obj = dict[str, Any]
_ROOT_KEEP = ("apiVersion", "kind", "metadata")


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def prune(value: Any, schema: Obj | None, path: str = "", root: bool = True) -> tuple[Any, list[str]]:
    """Return ``value`` without undeclared fields, and the paths that were dropped."""
    dropped: list[str] = []
    out = _prune(value, schema or {}, path, root, dropped)
    return out, dropped


def _prune(value: Any, schema: Obj, path: str, root: bool, dropped: list[str]) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        embedded = root or bool(schema.get("x-kubernetes-embedded-resource"))
        out: Obj = {}
        for k, v in value.items():
            if embedded and k in _ROOT_KEEP:
                out[k] = v
                continue
            if props is not None and k in props:
                out[k] = _prune(v, props[k], _child(path, k), False, dropped)
            elif isinstance(addl, dict):
                out[k] = _prune(v, addl, _child(path, k), False, dropped)
            elif preserve or addl is True:
                out[k] = v
            else:
                dropped.append(_child(path, k))
        return out
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            return [_prune(v, items, f"{path}[{i}]", False, dropped) for i, v in enumerate(value)]
        return value
    return value


def apply_defaults(value: Any, schema: Obj | None) -> Any:
    """Return ``value`` with the schema's ``default``s filled in where fields are absent (or null)."""
    if not schema:
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        out = dict(value)
        for k, sub in props.items():
            if "default" in sub and (k not in out or (out[k] is None and not sub.get("nullable"))):
                out[k] = clone(sub["default"])
        for k, v in out.items():
            if k in props:
                out[k] = apply_defaults(v, props[k])
            elif isinstance(schema.get("additionalProperties"), dict):
                out[k] = apply_defaults(v, schema["additionalProperties"])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def _show(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "map[string]interface {}{...}" if isinstance(v, dict) else "[]interface {}{...}"
    return json.dumps(v)


def _type_ok(t: str, v: Any) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return True


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def validate(value: Any, schema: Obj | None, path: str = "") -> list[FieldCause]:
    """Field causes for every violation of ``schema`` by ``value`` (empty when valid)."""
    causes: list[FieldCause] = []
    if schema:
        _validate(value, schema, path, causes, root=True)
    return causes


def _invalid(causes: list[FieldCause], path: str, v: Any, why: str) -> None:
    causes.append(FieldCause("FieldValueInvalid", f"Invalid value: {_show(v)}: {why}", path))


def _validate(v: Any, s: Obj, path: str, causes: list[FieldCause], root: bool = False) -> None:
    where = path or "<root>"
    if _type_causes(v, s, path, where, causes):
        return
    if "enum" in s and v not in s["enum"]:
        supported = ", ".join(json.dumps(e) for e in s["enum"])
        causes.append(
            FieldCause(
                "FieldValueNotSupported",
                f"Unsupported value: {_show(v)}: supported values: {supported}",
                path,
            )
        )
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        _number_causes(v, s, path, where, causes)
    if isinstance(v, str):
        _string_causes(v, s, path, where, causes)
    if isinstance(v, list):
        _list_causes(v, s, path, where, causes)
    if isinstance(v, dict):
        _object_causes(v, s, path, where, causes, root)
    for sub in s.get("allOf") or ():
        _validate(v, sub, path, causes)
    if s.get("anyOf") and not any(not validate(v, sub, path) for sub in s["anyOf"]):
        _invalid(causes, path, v, f"{where} in body must be valid against any of the anyOf schemas")
    if s.get("oneOf"):
        n = sum(1 for sub in s["oneOf"] if not validate(v, sub, path))
        if n != 1:
            _invalid(causes, path, v, f"{where} in body must validate one and only one schema (oneOf)")
    if isinstance(s.get("not"), dict) and not validate(v, s["not"], path):
        _invalid(causes, path, v, f"{where} in body must not validate the schema (not)")


def _type_causes(v: Any, s: Obj, path: str, where: str, causes: list[FieldCause]) -> bool:
    """A null or a value of the wrong type; True when nothing more is to be checked."""
    if v is None:
        if s.get("nullable") or not s.get("type"):
            return True
        causes.append(
            FieldCause(
                "FieldValueTypeInvalid",
                f'Invalid value: "null": {where} in body must be of type {s["type"]}: "null"',
                path,
            )
        )
        return True
    if s.get("x-kubernetes-int-or-string"):
        if not (isinstance(v, str) or _type_ok("integer", v)):
            causes.append(
                FieldCause(
                    "FieldValueTypeInvalid",
                    f"Invalid value: {_show(v)}: {where} in body must be of type "
                    f"integer or string: {json.dumps(_json_type(v))}",
                    path,
                )
            )
            return True
    elif s.get("type") and not _type_ok(s["type"], v):
        causes.append(
            FieldCause(
                "FieldValueTypeInvalid",
                f"Invalid value: {json.dumps(_json_type(v))}: {where} in body must be of type "
                f"{s['type']}: {json.dumps(_json_type(v))}",
                path,
            )
        )
        return True
    return False


def _number_causes(v: float, s: Obj, path: str, where: str, causes: list[FieldCause]) -> None:
    if "minimum" in s:
        if s.get("exclusiveMinimum") is True and not v > s["minimum"]:
            _invalid(causes, path, v, f"{where} in body should be greater than {s['minimum']}")
        elif v < s["minimum"]:
            _invalid(causes, path, v, f"{where} in body should be greater than or equal to {s['minimum']}")
    if "maximum" in s:
        if s.get("exclusiveMaximum") is True and not v < s["maximum"]:
            _invalid(causes, path, v, f"{where} in body should be less than {s['maximum']}")
        elif v > s["maximum"]:
            _invalid(causes, path, v, f"{where} in body should be less than or equal to {s['maximum']}")
    if s.get("multipleOf") and v % s["multipleOf"]:
        _invalid(causes, path, v, f"{where} in body should be a multiple of {s['multipleOf']}")


def _string_causes(v: str, s: Obj, path: str, where: str, causes: list[FieldCause]) -> None:
    if "minLength" in s and len(v) < s["minLength"]:
        _invalid(causes, path, v, f"{where} in body should be at least {s['minLength']} chars long")
    if "maxLength" in s and len(v) > s["maxLength"]:
        causes.append(
            FieldCause("FieldValueTooLong", f"Too long: may not be more than {s['maxLength']} bytes", path)
        )
    if "pattern" in s:
        try:
            ok = re.search(s["pattern"], v) is not None
        except re.error:
            ok = True  # patterns Go accepts but Python does not are not enforced
        if not ok:
            _invalid(causes, path, v, f"{where} in body should match '{s['pattern']}'")


def _list_causes(v: list[Any], s: Obj, path: str, where: str, causes: list[FieldCause]) -> None:
    if "minItems" in s and len(v) < s["minItems"]:
        _invalid(causes, path, len(v), f"{where} in body should have at least {s['minItems']} items")
    if "maxItems" in s and len(v) > s["maxItems"]:
        causes.append(
            FieldCause(
                "FieldValueTooMany", f"Too many: {len(v)}: must have at most {s['maxItems']} items", path
            )
        )
    if s.get("uniqueItems"):
        seen = [json.dumps(x, sort_keys=True) for x in v]
        if len(set(seen)) != len(seen):
            causes.append(FieldCause("FieldValueDuplicate", f"Duplicate value: {_show(v)}", path))
    items = s.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(v):
            _validate(item, items, f"{path}[{i}]", causes)


def _object_causes(v: Obj, s: Obj, path: str, where: str, causes: list[FieldCause], root: bool) -> None:
    props = s.get("properties") or {}
    for req in s.get("required") or ():
        if req not in v:
            causes.append(FieldCause("FieldValueRequired", "Required value", _child(path, req)))
    if "minProperties" in s and len(v) < s["minProperties"]:
        _invalid(
            causes, path, len(v), f"{where} in body should have at least {s['minProperties']} properties"
        )
    if "maxProperties" in s and len(v) > s["maxProperties"]:
        _invalid(causes, path, len(v), f"{where} in body should have at most {s['maxProperties']} properties")
    addl = s.get("additionalProperties")
    for k, item in v.items():
        if root and k in _ROOT_KEEP:
            continue
        if k in props:
            _validate(item, props[k], _child(path, k), causes)
        elif isinstance(addl, dict):
            _validate(item, addl, _child(path, k), causes)


def validate_rules(
    value: Any,
    schema: Obj | None,
    old: Any = MISSING,
    path: str = "",
    *,
    held: list[FieldCause] | None = None,
) -> list[FieldCause]:
    """Causes for the ``x-kubernetes-validations`` rules ``value`` breaks.

    ``old`` is the value before an update (MISSING on create): rules that use
    ``oldSelf`` (transition rules) only run when it exists, or with ``optionalOldSelf``
    always (``oldSelf`` an optional). Rules this server cannot parse are not enforced.
    An update ratchets, as the real server's does: a rule without ``oldSelf`` broken by
    a value the update left as it was (:func:`unchanged`: the rule's node, or for a list
    item its list) is not a cause; it is appended to ``held`` (the server answers it as
    a warning) instead.
    """
    causes: list[FieldCause] = []
    if schema:
        _rules(value, schema, old, path, causes, held if held is not None else [], False)
    return causes


#: Schema errors after which the real server does not run the CEL rules.
BLOCKING_REASONS = frozenset(
    {"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong", "FieldValueTooMany",
     "FieldValueTypeInvalid"}
)  # fmt: skip
#: The cause it adds instead.
RULES_NOT_CHECKED = FieldCause(
    "FieldValueInvalid",
    "Invalid value: null: some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation",
    "<nil>",
)


def has_rules(schema: Any) -> bool:
    """Whether ``schema`` has an ``x-kubernetes-validations`` rule anywhere."""
    if isinstance(schema, dict):
        return bool(schema.get("x-kubernetes-validations")) or any(has_rules(v) for v in schema.values())
    if isinstance(schema, list):
        return any(has_rules(v) for v in schema)
    return False


def _invalid_value(v: Any) -> str:
    """``Invalid value: <v>: `` as the real server writes it for a broken rule: objects and
    arrays are not shown, scalars as JSON."""
    return "Invalid value: " if isinstance(v, (dict, list)) else f"Invalid value: {json.dumps(v)}: "


def unchanged(v: Any, old: Any, s: Obj) -> bool:
    """Whether the real server's ratcheting finds ``v`` equal to ``old`` under schema ``s``.

    It compares what its schema describes: a map key no property (or additionalProperties)
    names, as under ``x-kubernetes-preserve-unknown-fields``, makes a map unequal whatever
    its value; items of a ``map`` list pair by their keys; other lists compare whole.
    """
    if isinstance(v, dict) and isinstance(old, dict):
        props = s.get("properties") or {}
        addl = s.get("additionalProperties")
        if v.keys() != old.keys():
            return False
        for k, item in v.items():
            sub = props.get(k) if k in props else (addl if isinstance(addl, dict) else None)
            if sub is None or not unchanged(item, old[k], sub):
                return False
        return True
    if isinstance(v, list) and isinstance(old, list) and s.get("x-kubernetes-list-type") == "map":
        keys = s.get("x-kubernetes-list-map-keys") or []
        items = s.get("items") or {}

        def key(item: Any) -> Any:
            return tuple(item.get(k) for k in keys) if isinstance(item, dict) else None

        before = {key(i): i for i in old}
        return len(v) == len(old) and all(key(i) in before and unchanged(i, before[key(i)], items) for i in v)
    return bool(v == old)


def _rules(
    v: Any, s: Obj, old: Any, path: str, causes: list[FieldCause], held: list[FieldCause], kept: bool
) -> None:
    """The rules of ``s`` and of its descendants on ``v``. ``kept``: the nearest ancestor that
    has an old value to compare with (a list, for its items) is unchanged."""
    if v is None:
        return
    if old is not MISSING:
        kept = bool(path) and unchanged(v, old, s)  # the root holds metadata: never unchanged
    for rule in s.get("x-kubernetes-validations") or ():
        text = rule.get("rule", "")
        optional = bool(rule.get("optionalOldSelf"))
        if "oldSelf" in text and old is MISSING and not optional:
            continue
        try:
            node = compile_rule(text)
        except CelError:
            continue
        env: dict[str, Any] = {"self": v}
        if optional:
            env["oldSelf"] = Optional(old)
        elif old is not MISSING:
            env["oldSelf"] = old
        try:
            ok = node(env) is True
            error = ""
        except (CelError, TypeError, ValueError, re.error, AttributeError) as exc:
            ok, error = False, f": {exc}"
        if ok:
            continue
        message = rule.get("message") or f"failed rule: {text}{error}"
        if rule.get("messageExpression"):
            # As the real server: the message sees oldSelf as it is (never an optional), and
            # one that fails to evaluate leaves the rule's message.
            said = {"self": v} if old is MISSING else {"self": v, "oldSelf": old}
            try:
                message = str(compile_rule(rule["messageExpression"])(said))
            except (CelError, TypeError, ValueError, AttributeError, KeyError):
                pass
        field_path = path + (rule.get("fieldPath") or "")
        cause = FieldCause(
            rule.get("reason") or "FieldValueInvalid",
            f"{_invalid_value(v)}{message}",
            field_path.lstrip("."),
        )
        (held if kept and "oldSelf" not in text else causes).append(cause)
    if isinstance(v, dict):
        props = s.get("properties") or {}
        addl = s.get("additionalProperties")
        for k, item in v.items():
            sub = props.get(k) if k in props else (addl if isinstance(addl, dict) else None)
            if sub:
                prev = old.get(k, MISSING) if isinstance(old, dict) else MISSING
                # A field the old value lacks has nothing to keep: its parent changed.
                _rules(item, sub, prev, _child(path, k), causes, held, kept and prev is not MISSING)
    elif isinstance(v, list) and isinstance(s.get("items"), dict):
        for i, item in enumerate(v):
            _rules(item, s["items"], MISSING, f"{path}[{i}]", causes, held, kept)

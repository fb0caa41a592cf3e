"""Label and field selectors, parsed once and evaluated as pure predicates.

Label selectors accept the full syntax of the API: equality (``a=b``, ``a==b``,
``a!=b``), set-based (``a in (x,y)``, ``a notin (x)``), existence (``a``,
``!a``), comma-joined. Field selectors accept ``=``, ``==`` and ``!=`` on
``metadata.name`` and ``metadata.namespace`` for every resource, plus the
per-kind fields declared in :data:`FIELD_PATHS` (e.g. ``status.phase`` and
``spec.nodeName`` for pods).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

__all__ = [
    "FIELD_PATHS",
    "FieldRequirement",
    "LabelRequirement",
    "make_predicate",
    "parse_field_selector",
    "parse_label_selector",
    "selector_string",
]

Obj = dict[str, Any]

#: Fields a selector may name beyond metadata.name/namespace, by kind.
FIELD_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": ("status.phase", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "status.podIP"),
    "Event": (
        "involvedObject.kind",
        "involvedObject.name",
        "involvedObject.namespace",
        "involvedObject.uid",
        "reason",
        "type",
        "source",
    ),
    "Secret": ("type",),
    "Namespace": ("status.phase",),
    "Node": ("spec.unschedulable",),
}


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        op = self.op
        if op == "exists":
            return self.key in labels
        if op == "!":
            return self.key not in labels
        if op in ("=", "in"):
            return self.key in labels and labels[self.key] in self.values
        if op in ("!=", "notin"):
            return self.key not in labels or labels[self.key] not in self.values
        if op in ("gt", "lt"):
            try:
                v = int(labels[self.key])
            except (KeyError, ValueError):
                return False
            return v > int(self.values[0]) if op == "gt" else v < int(self.values[0])
        raise AssertionError(op)


_LABEL_KEY = re.compile(
    r"^([a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$"
)


def _split_top(expr: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in expr:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(expr: str | None) -> list[LabelRequirement]:
    """Parse a labelSelector query string; raises 400 BadRequest naming the bad term."""
    if not expr:
        return []
    out = []
    for term in _split_top(expr):
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s*\(([^)]*)\)", term)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            out.append(LabelRequirement(_check_key(m.group(1), expr), m.group(2), values))
            continue
        m = re.fullmatch(r"(\S+?)\s*(==|!=|=)\s*(\S*)", term)
        if m:
            op = "=" if m.group(2) in ("=", "==") else "!="
            out.append(LabelRequirement(_check_key(m.group(1), expr), op, (m.group(3),)))
            continue
        m = re.fullmatch(r"(\S+?)\s*(gt|lt)\s*(\d+)", term)
        if m:
            out.append(LabelRequirement(_check_key(m.group(1), expr), m.group(2), (m.group(3),)))
            continue
        m = re.fullmatch(r"!\s*(\S+)", term)
        if m:
            out.append(LabelRequirement(_check_key(m.group(1), expr), "!"))
            continue
        if re.fullmatch(r"\S+", term):
            out.append(LabelRequirement(_check_key(term, expr), "exists"))
            continue
        raise ApiError.bad_request(f"unable to parse requirement: {term!r} in label selector {expr!r}")
    return out


def _check_key(key: str, expr: str) -> str:
    if not _LABEL_KEY.match(key):
        raise ApiError.bad_request(
            f"unable to parse requirement: invalid label key {key!r} in label selector {expr!r}"
        )
    return key


def selector_string(sel: Obj | None) -> str:
    """A metav1.LabelSelector rendered as a selector string (as in Scale.status.selector)."""
    if not sel:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((sel.get("matchLabels") or {}).items())]
    for e in sel.get("matchExpressions") or []:
        op = e["operator"]
        if op == "Exists":
            parts.append(e["key"])
        elif op == "DoesNotExist":
            parts.append("!" + e["key"])
        else:
            parts.append(f"{e['key']} {op.lower()} ({','.join(e.get('values') or ())})")
    return ",".join(parts)


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    negate: bool
    value: str

    def matches(self, obj: Obj) -> bool:
        cur: Any = obj
        for part in self.path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if isinstance(cur, bool):
            actual = "true" if cur else "false"
        elif cur is None:
            actual = ""
        else:
            actual = str(cur)
        return (actual != self.value) if self.negate else (actual == self.value)


def parse_field_selector(expr: str | None, kind: str) -> list[FieldRequirement]:
    """Parse a fieldSelector for ``kind``; unsupported fields are 400 BadRequest as in the API."""
    if not expr:
        return []
    allowed = {"metadata.name", "metadata.namespace", *FIELD_PATHS.get(kind, ())}
    out = []
    for term in _split_top(expr):
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*)", term)
        if not m:
            raise ApiError.bad_request(f"invalid selector: {term!r}; expected FIELD=VALUE or FIELD!=VALUE")
        path = m.group(1)
        if path not in allowed:
            raise ApiError.bad_request(
                f'field label not supported: "{path}" (for {kind} the supported fields are '
                f"{', '.join(sorted(allowed))})"
            )
        out.append(FieldRequirement(path, m.group(2) == "!=", m.group(3).strip()))
    return out


def make_predicate(
    namespace: str | None, labels: list[LabelRequirement], fields: list[FieldRequirement]
) -> Callable[[Obj], bool]:
    """One predicate for a list/watch: namespace, then labels, then fields."""
    if namespace is None and not labels and not fields:
        return lambda obj: True

    def pred(obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if namespace is not None and meta.get("namespace", "") != namespace:
            return False
        if labels:
            lab = meta.get("labels") or {}
            if not all(r.matches(lab) for r in labels):
                return False
        return all(f.matches(obj) for f in fields)

    return pred

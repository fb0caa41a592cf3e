"""What the registry's operations take and return, and small helpers on stored objects.

Shared by :mod:`.registry` and the subresources it delegates to (:mod:`.scale`,
:mod:`.namespaces`); :mod:`.registry` re-exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from enum import Enum
from typing import Any

from .errors import ApiError
from .resources import ResourceType

__all__ = [
    "DeleteOptions",
    "FieldValidation",
    "ListResult",
    "Obj",
    "PatchType",
    "WriteResult",
    "check_preconditions",
    "get_path",
    "now_rfc3339",
    "set_path",
]

Obj = dict[str, Any]


def now_rfc3339(delta: float = 0.0) -> str:
    """Now (plus ``delta`` seconds) as the API writes timestamps: ``2024-01-02T03:04:05Z``."""
    t = datetime.now(timezone.utc) + timedelta(seconds=delta)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class PatchType(str, Enum):
    """The Content-Type of a PATCH request."""

    JSON = "application/json-patch+json"
    MERGE = "application/merge-patch+json"
    STRATEGIC = "application/strategic-merge-patch+json"
    APPLY = "application/apply-patch+yaml"


class FieldValidation(str, Enum):
    """``fieldValidation``: what an unknown or duplicate field in a request body does."""

    IGNORE = "Ignore"
    WARN = "Warn"
    STRICT = "Strict"


@dataclass
class DeleteOptions:
    """A DELETE request's options (its DeleteOptions body and query)."""

    propagation: str | None = None  # Background, Foreground, Orphan
    grace_period: int | None = None
    precondition_uid: str | None = None
    precondition_rv: str | None = None
    dry_run: bool = False


@dataclass
class ListResult:
    """One page of a LIST: the items, the list's resourceVersion, the token of the next page."""

    items: list[Obj]
    resource_version: str
    continue_token: str = ""
    remaining: int | None = None


@dataclass
class WriteResult:
    """A written object, the warnings for the client, and whether it was created (201)."""

    obj: Obj
    warnings: list[str] = field(default_factory=list)
    created: bool = False


def get_path(obj: Obj, dotted: str) -> Any:
    """The value at a ``.spec.replicas``-style path, or None where the path is missing."""
    cur: Any = obj
    for part in dotted.strip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def set_path(obj: Obj, dotted: str, value: Any) -> None:
    """Set the value at a ``.spec.replicas``-style path, creating missing objects on the way."""
    parts = dotted.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value


def check_preconditions(rt: ResourceType, old: Obj, meta: Obj) -> None:
    """409 Conflict when ``meta`` names another resourceVersion or uid than the stored object."""
    name = old["metadata"]["name"]
    rv = meta.get("resourceVersion")
    if rv and rv != old["metadata"]["resourceVersion"]:
        raise ApiError.conflict(
            rt.group,
            rt.plural,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    uid = meta.get("uid")
    if uid and uid != old["metadata"]["uid"]:
        raise ApiError.conflict(
            rt.group,
            rt.plural,
            name,
            f"Precondition failed: UID in precondition: {uid}, UID in object meta: {old['metadata']['uid']}",
        )

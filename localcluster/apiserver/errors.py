"""Kubernetes ``Status`` errors raised by the API server.

Every failure a client can see is an :class:`ApiError`; the HTTP layer turns it
into a ``Status`` object with the code and reason the Kubernetes API conventions
prescribe, so kubectl and the official client print the same messages as against
a real cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ApiError", "FieldCause", "status_object"]


@dataclass(frozen=True)
class FieldCause:
    """One field-level reason of a 422 Invalid (``details.causes`` entry)."""

    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    message: str
    field: str

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}


@dataclass
class ApiError(Exception):
    """A request failure with its HTTP code, Kubernetes reason and message."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    causes: list[FieldCause] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def to_status(self) -> dict[str, Any]:
        details = dict(self.details)
        for key in ("group", "name"):
            if not details.get(key):
                details.pop(key, None)  # empty ones are omitted (the core group), as the API server does
        if self.causes:
            details["causes"] = [c.to_dict() for c in self.causes]
        return status_object("Failure", self.code, self.reason, self.message, details)

    # Constructors for the common reasons; each names what is wrong.
    @classmethod
    def _about(cls, code: int, reason: str, group: str, plural: str, name: str, message: str) -> ApiError:
        """An error about one object; ``message`` may use {resource} (plural.group) and {name}."""
        resource = f"{plural}.{group}" if group else plural
        details = {"name": name, "group": group, "kind": plural}
        return cls(code, reason, message.format(resource=resource, name=name), details)

    @classmethod
    def not_found(cls, group: str, plural: str, name: str) -> ApiError:
        return cls._about(404, "NotFound", group, plural, name, '{resource} "{name}" not found')

    @classmethod
    def already_exists(cls, group: str, plural: str, name: str) -> ApiError:
        return cls._about(409, "AlreadyExists", group, plural, name, '{resource} "{name}" already exists')

    @classmethod
    def conflict(cls, group: str, plural: str, name: str, why: str) -> ApiError:
        message = 'Operation cannot be fulfilled on {resource} "{name}": ' + why.replace("{", "{{").replace(
            "}", "}}"
        )
        return cls._about(409, "Conflict", group, plural, name, message)

    @classmethod
    def invalid(cls, group: str, kind: str, name: str, causes: list[FieldCause]) -> ApiError:
        qualified = f"{kind}.{group}" if group else kind
        parts = [f"{c.field}: {c.message}" if c.field else c.message for c in causes]
        joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
        return cls(
            422,
            "Invalid",
            f'{qualified} "{name}" is invalid: {joined}',
            {"name": name, "group": group, "kind": kind},
            causes,
        )

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)

    @classmethod
    def method_not_allowed(cls, message: str) -> ApiError:
        return cls(405, "MethodNotAllowed", message)

    @classmethod
    def gone(cls, message: str) -> ApiError:
        return cls(410, "Expired", message)


def status_object(
    status: str, code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` ``Status`` as the API returns it."""
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": status,
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        out["details"] = details
    if status == "Success":
        out.pop("reason")
        out.pop("message")
    return out

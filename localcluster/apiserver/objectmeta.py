"""A written object's envelope: the body's kind, version and namespace, its name, and the
metadata the server sets on a new object.

- :func:`check_body`: a create or update body must be an object of the URL's kind and
  version, in the URL's namespace (400 otherwise).
- :func:`name_of`: the new object's name, or one made from ``generateName`` (five
  characters of the real server's alphabet, never a taken name); 422 for neither or
  for a name the kind refuses.
- :func:`set_new_metadata`: what the server sets on a new object (uid,
  creationTimestamp, generation 1, the namespace) and drops from the body (a
  resourceVersion, a deletionTimestamp, ...).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from typing import Any

from . import kinds
from .errors import ApiError, FieldCause
from .registry_types import Obj, now_rfc3339
from .resources import ResourceType

__all__ = ["check_body", "name_of", "set_new_metadata"]

#: The characters of a generated name's suffix (the real server's: no vowels, no 0/1/3).
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"

#: What a create body may carry in its metadata and the server drops.
_DROPPED_ON_CREATE = (
    "resourceVersion",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
    "managedFields",
)


def check_body(rt: ResourceType, body: Any, namespace: str) -> Obj:
    """``body`` when it is an ``rt`` object for ``namespace``; 400 BadRequest otherwise."""
    if not isinstance(body, dict):
        raise ApiError.bad_request(f"the request body must be a {rt.kind} object, got {type(body).__name__}")
    kind = body.get("kind")
    if kind and kind != rt.kind:
        raise ApiError.bad_request(
            f"the object provided is unrecognized (must be of type {rt.kind}): kind {kind!r} in the body"
        )
    api_version = body.get("apiVersion")
    if api_version and api_version != rt.api_version and not rt.crd:
        raise ApiError.bad_request(
            f"the API version in the data ({api_version}) does not match the expected API version "
            f"({rt.api_version})"
        )
    meta = body.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ApiError.bad_request("metadata must be an object")
    if rt.namespaced:
        given = meta.get("namespace")
        if given and given != namespace:
            raise ApiError.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
    return body


def name_of(rt: ResourceType, meta: Obj, taken: Callable[[str], bool]) -> str:
    """The name of a new object (set in ``meta`` when made from ``generateName``, avoiding
    names ``taken`` says exist); 422 Invalid without either, or for a name ``rt`` refuses."""
    if not meta.get("name"):
        if not meta.get("generateName"):
            raise ApiError.invalid(
                rt.group,
                rt.kind,
                "",
                [
                    FieldCause(
                        "FieldValueRequired",
                        "Required value: name or generateName is required",
                        "metadata.name",
                    )
                ],
            )
        meta["name"] = _generated(meta["generateName"], taken)
    name = str(meta["name"])
    causes = kinds.name_causes(rt, name)
    if causes:
        raise ApiError.invalid(rt.group, rt.kind, name, causes)
    return name


def _generated(prefix: str, taken: Callable[[str], bool]) -> str:
    for _ in range(20):
        name = prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
        if not taken(name):
            return name
    raise ApiError(500, "AlreadyExists", f"could not generate a free name with prefix {prefix!r}")


def set_new_metadata(rt: ResourceType, meta: Obj, ns: str, managed: list[Obj] | None) -> None:
    """Set what the server sets on a new object in ``ns`` (``managed`` seeds managedFields)."""
    if rt.namespaced:
        meta["namespace"] = ns
    else:
        meta.pop("namespace", None)
    for f in _DROPPED_ON_CREATE:
        meta.pop(f, None)
    if managed:
        meta["managedFields"] = managed
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now_rfc3339()
    meta["generation"] = 1

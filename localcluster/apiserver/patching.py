"""PATCH: a request's patch applied to the stored object, with the API's answers.

- :func:`patched`: a JSON patch, a JSON merge patch or a strategic merge patch (built-in
  kinds only: a custom resource answers 415, as the real server does) applied to the
  object as served; a malformed patch is 422 (JSON patch) or 400.
- :func:`apply_fields` and :func:`applied`: server-side apply. A field another manager
  owns with another value is a 409 Conflict naming each field unless ``force``, which
  takes the fields over; fields the manager applied before and no longer applies are
  removed unless another manager shares them; managedFields records the result.

The formats themselves are :mod:`.patch` and the field sets :mod:`.ssa`; the registry
writes the result through its update path. Every function here is pure.
"""

from __future__ import annotations

from typing import Any

from . import ssa
from .errors import ApiError, FieldCause
from .patch import PatchError, clone, json_patch, merge_patch, strategic_merge_patch
from .registry_types import Obj, PatchType, now_rfc3339
from .resources import ResourceType

__all__ = ["applied", "apply_fields", "patched"]


def apply_fields(rt: ResourceType, patch: Any, field_manager: str | None) -> Any:
    """The field set an apply patch sets; 422 without a field manager, 400 for a non-object."""
    if not field_manager:
        raise ApiError.invalid(
            "meta.k8s.io",
            "PatchOptions",
            "",
            [FieldCause("FieldValueRequired", "Required value: is required for apply patch", "fieldManager")],
        )
    if not isinstance(patch, dict):
        raise ApiError.bad_request("an apply patch must be an object")
    return ssa.applied_fields(patch, merge_keys=not rt.crd)


def applied(
    rt: ResourceType,
    current: Obj,
    old: Obj,
    patch: Obj,
    field_manager: str,
    fields_set: Any,
    force: bool,
) -> Obj:
    """What server-side apply of ``patch`` by ``field_manager`` makes of ``old`` (``current``
    is it as served), managedFields included; 409 Conflict for fields others own, unless
    ``force``."""
    config = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    previous_managers = old["metadata"].get("managedFields")
    clashes = ssa.conflicts(current, field_manager, fields_set, config)
    if clashes and not force:
        message, causes = ssa.conflict_message(clashes)
        raise ApiError(  # no details but the causes, as the real server answers
            409,
            "Conflict",
            message,
            {},
            [FieldCause("FieldManagerConflict", m, f) for m, f in causes],
        )
    if clashes:
        previous_managers = ssa.release(previous_managers, clashes)
    stripped = ssa.without_fields(current, ssa.unshared_removal(old, field_manager, fields_set))
    try:
        new = merge_patch(stripped, config) if rt.crd else strategic_merge_patch(stripped, config)
    except PatchError as exc:
        raise ApiError.bad_request(str(exc)) from None
    new.setdefault("metadata", {})["managedFields"] = ssa.record(
        previous_managers, field_manager, rt.api_version, fields_set, now_rfc3339()
    )
    return new


def patched(rt: ResourceType, current: Obj, patch_type: PatchType, patch: Any) -> Obj:
    """``current`` with a JSON, merge or strategic merge ``patch`` applied (a new object)."""
    if patch_type is PatchType.STRATEGIC and rt.crd:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: "
            f"{PatchType.JSON.value}, {PatchType.MERGE.value}, {PatchType.APPLY.value}",
        )
    try:
        if patch_type is PatchType.JSON:
            new = json_patch(current, patch)
        elif patch_type is PatchType.MERGE:
            if not isinstance(patch, dict):
                raise PatchError("a merge patch must be a JSON object")
            new = merge_patch(current, patch)
        else:
            if not isinstance(patch, dict):
                raise PatchError("a strategic merge patch must be a JSON object")
            new = strategic_merge_patch(current, patch)
    except PatchError as exc:
        raise ApiError(
            422 if patch_type is PatchType.JSON else 400,
            "Invalid" if patch_type is PatchType.JSON else "BadRequest",
            str(exc),
        ) from None
    if not isinstance(new, dict):
        raise ApiError.bad_request("the patch must leave an object")
    return clone(new)

"""The scale subresource (autoscaling/v1 Scale) of the kinds that have one.

Deployments, ReplicaSets, StatefulSets and custom resources whose CRD declares
``subresources.scale`` expose ``.../scale``: a Scale whose ``spec.replicas`` reads and
writes the object's replicas field, and whose ``status`` shows its current replicas and
label selector (``kubectl scale`` and autoscalers use it). Writes go through the
registry's update path, so preconditions, validation and watch events are the object's.
"""

from __future__ import annotations

import json
from typing import Any

from . import schema
from .errors import ApiError, FieldCause
from .patch import PatchError, clone, json_patch, merge_patch
from .registry_types import (
    FieldValidation,
    Obj,
    PatchType,
    WriteResult,
    check_preconditions,
    get_path,
    set_path,
)
from .registry_view import RegistryView
from .resources import ResourceType
from .selectors import selector_string

__all__ = ["ScaleSubresource"]


class ScaleSubresource:
    """``.../scale`` of one registry's objects."""

    def __init__(self, registry: RegistryView) -> None:
        self._registry = registry

    def paths(self, rt: ResourceType) -> tuple[str, str, str | None]:
        """(spec replicas, status replicas, label selector) paths of ``rt``'s scale; 404 without one."""
        if rt.crd:
            if not rt.scale:
                raise ApiError.not_found(rt.group, f"{rt.plural}/scale", "")
            return (
                rt.scale["specReplicasPath"],
                rt.scale["statusReplicasPath"],
                rt.scale.get("labelSelectorPath"),
            )
        return ".spec.replicas", ".status.replicas", None

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        """GET .../scale: the object's Scale; 404 when the object or its scale does not exist."""
        reg = self._registry
        return self.view(rt, reg._stored(rt, reg._ns(rt, namespace), name))

    def view(self, rt: ResourceType, obj: Obj) -> Obj:
        """``obj`` seen through its scale subresource: an autoscaling/v1 Scale."""
        spec_path, status_path, selector_path = self.paths(rt)
        m = obj["metadata"]
        if selector_path:
            selector = get_path(obj, selector_path) or ""
        else:
            selector = selector_string((obj.get("spec") or {}).get("selector"))
        status: Obj = {"replicas": int(get_path(obj, status_path) or 0)}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: m[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in m
            },
            "spec": {"replicas": int(get_path(obj, spec_path) or 0)},
            "status": status,
        }

    def update(
        self, rt: ResourceType, namespace: str | None, name: str, body: Any, *, dry_run: bool = False
    ) -> WriteResult:
        """PUT .../scale: set the object's replicas from a Scale (its resourceVersion and uid
        preconditions apply); returns the new Scale."""
        reg = self._registry
        old = reg._stored(rt, reg._ns(rt, namespace), name)
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body must be an autoscaling/v1 Scale")
        check_preconditions(rt, old, body.get("metadata") or {})
        return self._apply(rt, old, body, dry_run)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch_type: PatchType,
        patch: Any,
        *,
        dry_run: bool = False,
    ) -> WriteResult:
        """PATCH .../scale (JSON or merge patch of the Scale); returns the new Scale."""
        reg = self._registry
        old = reg._stored(rt, reg._ns(rt, namespace), name)
        scale = self.view(rt, old)
        try:
            if patch_type is PatchType.JSON:
                new_scale = json_patch(scale, patch)
            elif isinstance(patch, dict):
                new_scale = merge_patch(scale, patch)
            else:
                raise PatchError("a scale patch must be a JSON object")
        except PatchError as exc:
            raise ApiError.bad_request(str(exc)) from None
        return self._apply(rt, old, new_scale, dry_run)

    def _apply(self, rt: ResourceType, old: Obj, scale: Obj, dry_run: bool) -> WriteResult:
        replicas = (scale.get("spec") or {}).get("replicas")
        spec_path, _, _ = self.paths(rt)
        if rt.crd and isinstance(replicas, int) and not isinstance(replicas, bool) and replicas < 0:
            # A custom resource is judged as the object the Scale makes of it: its schema's
            # errors, then the scale's own rule on the replicas field, then its CEL rules
            # (unless a schema error blocks them).
            new = clone(old)
            set_path(new, spec_path, replicas)
            causes = schema.validate(new, rt.schema) if rt.schema else []
            why = f"Invalid value: {replicas}: should be a non-negative integer"
            causes.append(FieldCause("FieldValueInvalid", why, spec_path))
            if rt.schema and not any(c.reason in schema.BLOCKING_REASONS for c in causes):
                body = {k: v for k, v in new.items() if k not in ("metadata", "apiVersion", "kind")}
                before = {k: v for k, v in old.items() if k not in ("metadata", "apiVersion", "kind")}
                causes += schema.validate_rules(body, rt.schema, before)
            raise ApiError.invalid(rt.group, rt.kind, old["metadata"]["name"], causes)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError.invalid(
                "autoscaling",
                "Scale",
                old["metadata"]["name"],
                [
                    FieldCause(
                        "FieldValueInvalid",
                        f"Invalid value: {json.dumps(replicas)}: must be greater than or equal to 0",
                        "spec.replicas",
                    )
                ],
            )
        new = clone(old)
        set_path(new, spec_path, replicas)
        reg = self._registry
        result = reg._write_update(rt, old, new, "", FieldValidation.WARN, dry_run)
        stored = reg.store.get(rt.key, old["metadata"].get("namespace", ""), old["metadata"]["name"])
        return WriteResult(self.view(rt, stored or result.obj), result.warnings)

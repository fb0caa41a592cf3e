"""OpenAPI documents: ``/openapi/v3`` (root + one document per group/version) and ``/openapi/v2``.

What kubectl (1.32 to 1.37) needs from them:

- ``kubectl apply``/``create`` with validation on (the default) asks the v3
  document of the object's group/version whether the PATCH operation of that
  kind accepts the ``fieldValidation`` query parameter; if it does, validation
  is left to the server (``fieldValidation=Strict``), which enforces CRD schemas.
  Every PATCH operation here declares it, so kubectl never needs the protobuf
  v2 document.
- ``kubectl explain`` reads the kind's schema from ``components.schemas`` (found
  by ``x-kubernetes-group-version-kind``); custom resources get their CRD
  schema there.
- Built-in kinds' PATCH operations do not advertise strategic merge in the v3
  document: kubectl then computes strategic merge patches from its own compiled
  types, which carry the patch merge keys.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .fields import component_schemas
from .resources import ResourceType, TypeRegistry

__all__ = ["gv_document", "gv_path", "swagger_v2", "v3_root"]

Obj = dict[str, Any]

_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_QUERY_PARAMS = ("dryRun", "fieldManager", "fieldValidation", "pretty")


def gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _reverse_domain(group: str) -> str:
    return ".".join(reversed(group.split("."))) if group else "io.k8s.api.core"


def schema_name(rt: ResourceType) -> str:
    return f"{_reverse_domain(rt.group)}.{rt.version}.{rt.kind}"


def _param(name: str, where: str = "query", required: bool = False) -> Obj:
    return {
        "name": name,
        "in": where,
        "required": required,
        "schema": {"type": "string", "uniqueItems": True},
    }


_PATCH_TYPES = ("application/apply-patch+yaml", "application/json-patch+json", "application/merge-patch+json")

#: (HTTP method, verb, operation prefix, on the item path?, takes a body?, x-kubernetes-action)
_OPERATIONS = (
    ("get", "list", "list", False, False, "list"),
    ("post", "create", "create", False, True, "post"),
    ("get", "get", "read", True, False, "get"),
    ("put", "update", "replace", True, True, "put"),
    ("patch", "patch", "patch", True, True, "patch"),
    ("delete", "delete", "delete", True, False, "delete"),
)


def _ops(rt: ResourceType, item: bool) -> Obj:
    """The operations of ``rt``'s collection path (or item path): every write declares fieldValidation."""
    gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
    ref = {"$ref": f"#/components/schemas/{schema_name(rt)}"} if rt.crd else {"type": "object"}
    ok = {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}}
    common = [_param(p) for p in _QUERY_PARAMS]
    ops: Obj = {}
    for method, verb, prefix, on_item, has_body, action in _OPERATIONS:
        if on_item != item or verb not in rt.verbs:
            continue
        op: Obj = {
            "operationId": f"{prefix}{rt.kind}",
            "responses": ok,
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk,
        }
        if has_body:
            op["parameters"] = [*common, _param("force")] if verb == "patch" else common
            content = (
                {t: {"schema": {"type": "object"}} for t in _PATCH_TYPES}
                if verb == "patch"
                else {"*/*": {"schema": ref}}
            )
            op["requestBody"] = {"content": content, "required": True}
        ops[method] = op
    return ops


def _crd_component(rt: ResourceType) -> Obj:
    base = json.loads(json.dumps(rt.schema or {"type": "object"}))
    props = base.setdefault("properties", {})
    props["apiVersion"] = {
        "type": "string",
        "description": "APIVersion defines the versioned schema of this representation of an object.",
    }
    props["kind"] = {
        "type": "string",
        "description": "Kind is a string value representing the REST resource this object represents.",
    }
    props["metadata"] = {
        "allOf": [{"$ref": f"#/components/schemas/{_OBJECT_META}"}],
        "description": "Standard object's metadata.",
    }
    base.setdefault("type", "object")
    base["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
    return base


def _object_meta() -> Obj:
    s = {"type": "string"}
    return {
        "description": "ObjectMeta is metadata that all persisted resources must have.",
        "type": "object",
        "properties": {
            "name": {**s, "description": "Name must be unique within a namespace."},
            "generateName": {**s, "description": "Optional prefix used to generate a unique name."},
            "namespace": {
                **s,
                "description": "Namespace defines the space within which each name must be unique.",
            },
            "uid": s,
            "resourceVersion": s,
            "generation": {"type": "integer", "format": "int64"},
            "creationTimestamp": {**s, "format": "date-time"},
            "deletionTimestamp": {**s, "format": "date-time"},
            "deletionGracePeriodSeconds": {"type": "integer", "format": "int64"},
            "labels": {"type": "object", "additionalProperties": {**s, "default": ""}},
            "annotations": {"type": "object", "additionalProperties": {**s, "default": ""}},
            "finalizers": {"type": "array", "items": {**s, "default": ""}},
            "ownerReferences": {"type": "array", "items": {"type": "object"}},
        },
    }


def gv_document(types: TypeRegistry, group: str, version: str) -> Obj | None:
    """The OpenAPI v3 document of one group/version."""
    ts = sorted(types.in_group_version(group, version), key=lambda t: t.plural)
    if not ts:
        return None
    root = f"/apis/{group}/{version}" if group else f"/api/{version}"
    paths: Obj = {}
    schemas: Obj = {}
    for t in ts:
        base = f"{root}/namespaces/{{namespace}}/{t.plural}" if t.namespaced else f"{root}/{t.plural}"
        paths[base] = _ops(t, item=False)
        paths[f"{base}/{{name}}"] = _ops(t, item=True)
        if t.crd:
            schemas[schema_name(t)] = _crd_component(t)
    schemas[_OBJECT_META] = _object_meta()
    for name, schema in component_schemas(ts).items():
        schemas.setdefault(name, schema)
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.37.2-kelastic"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _digest(doc: Obj) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()


def v3_root(types: TypeRegistry) -> Obj:
    """``/openapi/v3``: where each group/version's document lives (with a content hash)."""
    out: Obj = {}
    for group, versions in types.group_versions().items():
        for version in versions:
            doc = gv_document(types, group, version)
            if doc is None:
                continue
            path = gv_path(group, version)
            out[path] = {"serverRelativeURL": f"/openapi/{'v3'}/{path}?hash={_digest(doc)}"}
    return {"paths": out}


def swagger_v2(types: TypeRegistry) -> Obj:
    """``/openapi/v2`` as JSON: CRD definitions only (kubectl uses the v3 documents)."""
    definitions: Obj = {_OBJECT_META: _object_meta()}
    for t in types.all():
        if t.crd:
            definitions[schema_name(t)] = _crd_component(t)
    # The same schemas, with references in v2's form.
    definitions = json.loads(json.dumps(definitions).replace('"#/components/schemas/', '"#/definitions/'))
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.37.2-kelastic"},
        "paths": {},
        "definitions": definitions,
    }

"""Object semantics of the API server: create, read, update, patch, delete.

:class:`Registry` is the API's behaviour independent of HTTP: names and
generateName, uid, creationTimestamp, resourceVersion preconditions (409
Conflict), generation bumped on spec changes only, status and scale
subresources, CRD schemas (prune, default, validate → 422), finalizers and
deletionTimestamp, graceful pod deletion, and registration of CRD types. It runs
on the server's event loop thread; every method is synchronous.
"""

from __future__ import annotations

import base64
import builtins
import json
import secrets
import uuid
from collections.abc import Callable
from typing import Any

from . import fields, kinds, podsecurity, schema, ssa
from .cel import MISSING
from .errors import ApiError, FieldCause
from .namespaces import Namespaces
from .patch import PatchError, clone, json_patch, merge_patch, strategic_merge_patch
from .registry_types import (
    DeleteOptions,
    FieldValidation,
    ListResult,
    Obj,
    PatchType,
    WriteResult,
    check_preconditions,
    now_rfc3339,
)
from .resources import ResourceType, TypeRegistry
from .scale import ScaleSubresource
from .selectors import make_predicate, parse_field_selector, parse_label_selector
from .storage import EventType, Gone, Store

__all__ = [
    "FINALIZER_FOREGROUND",
    "FINALIZER_ORPHAN",
    "DeleteOptions",
    "FieldValidation",
    "ListResult",
    "PatchType",
    "Registry",
    "WriteResult",
    "now_rfc3339",
]

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"

FINALIZER_ORPHAN = "orphan"
FINALIZER_FOREGROUND = "foregroundDeletion"


#: Metadata the server sets and a write cannot change.
_SERVER_METADATA = (
    "name",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)


def _carry_over(rt: ResourceType, old: Obj, new: Obj, subresource: str) -> Obj:
    """``new`` with what this write may not change taken from ``old``.

    A ``status`` write changes the status only: the rest is ``old``'s. Any other write
    keeps ``old``'s status (when the kind has the subresource), the metadata the server
    sets, the namespace, and managedFields unless it sends its own. Adding a finalizer
    to an object being deleted is 422 Invalid. ``new`` is changed in place.
    """
    if subresource == "status":
        status = new.get("status")
        new = clone(old)
        if status is None:
            new.pop("status", None)
        else:
            new["status"] = status
        return new
    if rt.has_status:
        if "status" in old:
            new["status"] = clone(old["status"])
        else:
            new.pop("status", None)
    meta = new.setdefault("metadata", {})
    if meta is None:
        meta = new["metadata"] = {}
    om = old["metadata"]
    for f in _SERVER_METADATA:
        if f in om:
            meta[f] = om[f]
        else:
            meta.pop(f, None)
    if "namespace" in om:
        meta["namespace"] = om["namespace"]
    if meta.get("managedFields") is None:
        # Server-side apply's records survive writes that do not mention them.
        meta.pop("managedFields", None)
        if om.get("managedFields"):
            meta["managedFields"] = om["managedFields"]
    meta.pop("selfLink", None)
    if om.get("deletionTimestamp"):
        added = set(meta.get("finalizers") or ()) - set(om.get("finalizers") or ())
        if added:
            raise ApiError.invalid(
                rt.group,
                rt.kind,
                om["name"],
                [
                    FieldCause(
                        "FieldValueForbidden",
                        "Forbidden: no new finalizers can be added if the object is being deleted",
                        "metadata.finalizers",
                    )
                ],
            )
    return new


def _strip(obj: Obj, *, keep_status: bool) -> Obj:
    """The object without metadata (and status when it is a subresource): what generation tracks."""
    return {k: v for k, v in obj.items() if k != "metadata" and (keep_status or k != "status")}


def _strip_meta(obj: Obj) -> Obj:
    """A custom resource as CEL rules at its root see it (without metadata, apiVersion and kind)."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "apiVersion", "kind")}


class Registry:
    """The API's object semantics over a :class:`Store` (see module docstring)."""

    def __init__(self, store: Store, types: TypeRegistry) -> None:
        self.store = store
        self.types = types
        self.services = kinds.ServiceAddresses()
        #: Hooks run after a CRD's types change (discovery/openapi caches).
        self.on_types_changed: list[Callable[[], None]] = []
        #: ``.../scale`` of the kinds that have one.
        self.scale = ScaleSubresource(self)
        #: Creating into, deleting and finalizing namespaces.
        self.namespaces = Namespaces(self)

    # ---- bootstrap -----------------------------------------------------------
    def bootstrap(self) -> None:
        """Re-register stored CRDs and services, and create the default namespaces."""
        for crd in self.store.list("apiextensions.k8s.io/customresourcedefinitions"):
            self.types.register_crd(crd)
        for svc in self.store.list("/services"):
            self.services.restore(svc)
        ns_type = self.types.lookup("", "v1", "namespaces")
        assert ns_type is not None
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            if self.store.get(ns_type.key, "", name) is None:
                self.create(ns_type, None, {"metadata": {"name": name}})
        # The priority classes every API server makes for itself.
        pc_type = self.types.lookup("scheduling.k8s.io", "v1", "priorityclasses")
        assert pc_type is not None
        for name, value in (("system-node-critical", 2000001000), ("system-cluster-critical", 2000000000)):
            if self.store.get(pc_type.key, "", name) is None:
                body = {
                    "metadata": {"name": name},
                    "value": value,
                    "description": "Used for system critical pods that must not be moved from their current node."
                    if name == "system-node-critical"
                    else "Used for system critical pods that must run in the cluster, but can be moved to "
                    "another node if necessary.",
                }
                self.create(pc_type, None, body)
        self._types_changed()

    def _types_changed(self) -> None:
        for hook in self.on_types_changed:
            hook()

    # ---- helpers -------------------------------------------------------------
    def _core_events(self) -> ResourceType:
        rt = self.types.lookup("", "v1", "events")
        assert rt is not None
        return rt

    def present(self, rt: ResourceType, obj: Obj) -> Obj:
        """``obj`` as served at ``rt``'s version (apiVersion and kind set)."""
        if rt.shared_key == "/events":
            return kinds.event_to_events_v1(obj)
        if obj.get("apiVersion") == rt.api_version and obj.get("kind") == rt.kind:
            return obj
        out = dict(obj)
        out["apiVersion"] = rt.api_version
        out["kind"] = rt.kind
        return out

    def _storage_type(self, rt: ResourceType) -> ResourceType:
        if rt.crd and rt.version != rt.storage_version:
            st = self.types.lookup(rt.group, rt.storage_version, rt.plural)
            if st is not None:
                return st
        return rt

    def _ns(self, rt: ResourceType, namespace: str | None) -> str:
        if rt.namespaced:
            if not namespace:
                raise ApiError.bad_request(f"{rt.plural} is namespaced: the request must name a namespace")
            return namespace
        return ""

    def _stored(self, rt: ResourceType, ns: str, name: str) -> Obj:
        """The stored object, or 404 NotFound."""
        obj = self.store.get(rt.key, ns, name)
        if obj is None:
            raise ApiError.not_found(rt.group, rt.plural, name)
        return obj

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        """GET one object, as served at ``rt``'s version; 404 NotFound when it does not exist."""
        return self.present(rt, self._stored(rt, self._ns(rt, namespace), name))

    def _check_body(self, rt: ResourceType, body: Any, namespace: str) -> Obj:
        if not isinstance(body, dict):
            raise ApiError.bad_request(
                f"the request body must be a {rt.kind} object, got {type(body).__name__}"
            )
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

    def _schema_pass(
        self, rt: ResourceType, obj: Obj, validation: FieldValidation, name: str, old: Obj | None = None
    ) -> tuple[Obj, list[str]]:
        """Prune unknown fields (refused under Strict), default and validate; returns the object and warnings."""
        warnings: list[str] = []
        if not rt.crd:
            pruned, dropped, wrong = fields.prune_unknown(rt, obj)
            if wrong:
                raise ApiError.bad_request(
                    f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                    + "; ".join(wrong[:5])
                )
            self._unknown_fields(rt, dropped, validation, warnings)
            return pruned, warnings
        if not rt.schema:
            return obj, warnings
        pruned, dropped = schema.prune(obj, rt.schema)
        meta = obj.get("metadata") or {}
        unknown_meta = [f"metadata.{k}" for k in meta if k not in _OBJECT_META_FIELDS]
        # Sorted, as the real server reports the paths it pruned.
        self._unknown_fields(rt, sorted(unknown_meta + dropped), validation, warnings)
        obj = schema.apply_defaults(pruned, rt.schema)
        causes = schema.validate(obj, rt.schema)
        if schema.has_rules(rt.schema):
            # As the real server: CEL rules run unless the schema found an error that blocks
            # them (a wrong type, a missing field, ...), which it then says.
            if any(c.reason in schema.BLOCKING_REASONS for c in causes):
                causes.append(schema.RULES_NOT_CHECKED)
            else:
                before = _strip_meta(old) if old is not None else MISSING
                held: list[FieldCause] = []
                causes += schema.validate_rules(_strip_meta(obj), rt.schema, before, held=held)
                # What an update left as it was is not refused for a rule it breaks: warned of.
                warnings += [f"{c.field}: {c.message}" for c in held]
        if causes:
            raise ApiError.invalid(rt.group, rt.kind, name, causes)
        return obj, warnings

    @staticmethod
    def _unknown_fields(
        rt: ResourceType, dropped: list[str], validation: FieldValidation, warnings: list[str]
    ) -> None:
        if dropped and validation is FieldValidation.STRICT:
            detail = ", ".join(f'unknown field "{p}"' for p in dropped)
            raise ApiError.bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict decoding '
                f"error: {detail}"
            )
        if dropped and validation is FieldValidation.WARN:
            warnings.extend(f'unknown field "{p}"' for p in dropped)

    def _validate(self, rt: ResourceType, obj: Obj, name: str) -> None:
        causes = kinds.metadata_causes(obj) + kinds.validate_builtin(rt, obj)
        if causes:
            raise ApiError.invalid(rt.group, rt.kind, name, causes)

    def _new_name(self, rt: ResourceType, ns: str, prefix: str) -> str:
        for _ in range(20):
            name = prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
            if self.store.get(rt.key, ns, name) is None:
                return name
        raise ApiError(500, "AlreadyExists", f"could not generate a free name with prefix {prefix!r}")

    # ---- create --------------------------------------------------------------
    def create(
        self,
        rt: ResourceType,
        namespace: str | None,
        body: Any,
        *,
        validation: FieldValidation = FieldValidation.WARN,
        dry_run: bool = False,
        managed: list[Obj] | None = None,
    ) -> WriteResult:
        """POST: create ``body`` (``generateName`` honoured) in ``namespace``.

        Assigns uid, creationTimestamp, resourceVersion and generation 1; prunes, defaults
        and validates against the kind's schema (422 Invalid, naming each field); admits
        pods (Pod Security); 409 AlreadyExists for a taken name, 403/404 for a namespace
        that is terminating or missing. ``dry_run`` checks everything and stores nothing;
        ``managed`` seeds managedFields (server-side apply's create).
        """
        if rt.shared_key == "/events":
            res = self.create(
                self._core_events(),
                namespace,
                kinds.event_to_core(self._check_body(rt, body, self._ns(rt, namespace))),
                validation=validation,
                dry_run=dry_run,
            )
            return WriteResult(self.present(rt, res.obj), res.warnings, res.created)
        ns = self._ns(rt, namespace)
        body = self._check_body(rt, body, ns)
        obj = clone(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = self._new_name(rt, ns, meta["generateName"])
            else:
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
        name = meta["name"]
        causes = kinds.name_causes(rt, name)
        if causes:
            raise ApiError.invalid(rt.group, rt.kind, name, causes)
        self.namespaces.check_open(rt, ns)
        if self.store.get(rt.key, ns, name) is not None:
            raise ApiError.already_exists(rt.group, rt.plural, name)
        if rt.namespaced:
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        for f in (
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "managedFields",
        ):
            meta.pop(f, None)
        if managed:
            meta["managedFields"] = managed
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        st = self._storage_type(rt)
        obj["apiVersion"] = st.api_version
        obj["kind"] = rt.kind
        if rt.crd and rt.has_status:
            obj.pop("status", None)
        obj, warnings = self._schema_pass(rt, obj, validation, name)
        if rt.kind == "Pod" and not rt.crd:
            self._admit_priority(obj, name)
        try:
            kinds.prepare_create(rt, obj, self.services)
        except ValueError as exc:
            raise ApiError.invalid(
                rt.group, rt.kind, name, [FieldCause("FieldValueInvalid", str(exc), "")]
            ) from None
        self._validate(rt, obj, name)
        if rt.kind == "CustomResourceDefinition" and not rt.crd:
            self._check_crd_names(obj)
        warnings += self._pod_security(rt, obj, ns, name)
        if dry_run:
            if rt.kind == "Service" and not rt.crd:
                self.services.release(obj)
            return WriteResult(self.present(rt, obj), warnings, True)
        self.store.put(rt.key, obj, EventType.ADDED)
        self._after_write(rt, obj, None)
        return WriteResult(self.present(rt, obj), warnings, True)

    def _admit_priority(self, pod: Obj, name: str) -> None:
        """Priority admission: a pod's ``priority`` and ``preemptionPolicy`` come from its
        PriorityClass (else the global default one, else 0); an unknown class is 403."""
        spec = pod.setdefault("spec", {})
        pc_type = self.types.lookup("scheduling.k8s.io", "v1", "priorityclasses")
        if pc_type is None:
            return
        wanted = spec.get("priorityClassName")
        classes = self.store.list(pc_type.key, "")
        if wanted:
            found = next((c for c in classes if c["metadata"]["name"] == wanted), None)
            if found is None:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'pods "{name}" is forbidden: no PriorityClass with name {wanted} was found',
                    {"name": name, "kind": "pods"},
                )
        else:
            found = next((c for c in classes if c.get("globalDefault")), None)
            if found is not None:
                spec["priorityClassName"] = found["metadata"]["name"]
        if found is not None:
            spec["priority"] = int(found.get("value", 0))
            spec.setdefault("preemptionPolicy", found.get("preemptionPolicy") or "PreemptLowerPriority")

    def _pod_security(self, rt: ResourceType, obj: Obj, ns: str, name: str) -> list[str]:
        """Pod Security admission of a created pod or written workload: a pod that violates the
        enforced standard is refused (403); a pod or pod template that violates the warned one
        gets its warning (workloads are never refused)."""
        spec = None if rt.crd else podsecurity.pod_template_spec(rt.kind, obj)
        if spec is None:
            return []
        nsobj = self.store.get("/namespaces", "", ns) or {}
        (level, version), (warn, warn_version) = podsecurity.policy_of(
            (nsobj.get("metadata") or {}).get("labels") or {}
        )
        if rt.kind == "Pod":
            found = podsecurity.violations(spec, level)
            if found:
                raise ApiError(
                    403,
                    "Forbidden",
                    podsecurity.forbidden_message(name, level, version, found),
                    {"name": name, "kind": "pods"},
                )
        found = podsecurity.violations(spec, warn)
        return [podsecurity.warning_message(warn, warn_version, found)] if found else []

    def _check_crd_names(self, crd: Obj) -> None:
        spec = crd["spec"]
        for v in spec.get("versions") or ():
            existing = self.types.lookup(spec["group"], v["name"], spec["names"]["plural"])
            if existing is not None and not existing.crd:
                raise ApiError.invalid(
                    "apiextensions.k8s.io",
                    "CustomResourceDefinition",
                    crd["metadata"]["name"],
                    [
                        FieldCause(
                            "FieldValueInvalid",
                            "Invalid value: a built-in resource already serves this group and plural",
                            "spec.names.plural",
                        )
                    ],
                )

    def _after_write(self, rt: ResourceType, obj: Obj, old: Obj | None) -> None:
        if rt.crd:
            return
        if rt.kind == "CustomResourceDefinition":
            for served in self.types.register_crd(obj):
                self.store.open_history(served.key)
            self._types_changed()
        elif rt.kind == "Namespace" and old is None:
            sa = self.types.lookup("", "v1", "serviceaccounts")
            name = obj["metadata"]["name"]
            if sa is not None and self.store.get(sa.key, name, "default") is None:
                self.create(sa, name, {"metadata": {"name": "default"}})

    # ---- list ----------------------------------------------------------------
    def list(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        resource_version: str | None = None,
        resource_version_match: str | None = None,
    ) -> ListResult:
        """LIST ``rt`` objects (all namespaces when ``namespace`` is None), filtered by label
        and field selectors, in pages of ``limit`` with ``continue_token``; 410 Gone for a
        continue token or resourceVersion older than the retained history."""
        ns = namespace if rt.namespaced and namespace else None
        pred = make_predicate(
            ns, parse_label_selector(label_selector), parse_field_selector(field_selector, rt.kind)
        )
        if resource_version_match and resource_version_match not in ("NotOlderThan", "Exact"):
            raise ApiError.bad_request(
                f"resourceVersionMatch: Unsupported value: {resource_version_match!r}: supported values: "
                '"Exact", "NotOlderThan"'
            )
        if resource_version_match and not resource_version:
            raise ApiError.bad_request("resourceVersionMatch is forbidden unless resourceVersion is provided")
        current = self.store.rv
        if resource_version and resource_version != "0":
            try:
                wanted = int(resource_version)
            except ValueError:
                raise ApiError.bad_request(f"invalid resourceVersion {resource_version!r}") from None
            if resource_version_match == "Exact" and wanted != current:
                raise ApiError.gone(
                    f"too old resource version: {wanted} ({current}); only the current version can be listed "
                    "exactly"
                )
            if wanted > current:
                raise ApiError(
                    504,
                    "Timeout",
                    f"Too large resource version: {wanted}, current: {current}",
                    {
                        "causes": [
                            {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                        ],
                        "retryAfterSeconds": 1,
                    },
                )
        start_after: tuple[str, str] | None = None
        list_rv = str(current)
        if continue_token:
            try:
                tok = json.loads(base64.urlsafe_b64decode(continue_token.encode()))
                start_after = (tok["ns"], tok["name"])
                list_rv = str(tok["rv"])
            except (ValueError, KeyError, TypeError):
                raise ApiError.bad_request(f"invalid continue token {continue_token!r}") from None
        objs = self.store.list(rt.key, ns)
        if start_after is not None:
            objs = [
                o for o in objs if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start_after
            ]
        items = [self.present(rt, o) for o in objs if pred(o)]
        cont = ""
        remaining = None
        if limit and limit > 0 and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            cont = base64.urlsafe_b64encode(
                json.dumps({"ns": last.get("namespace", ""), "name": last["name"], "rv": list_rv}).encode()
            ).decode()
        return ListResult(items, list_rv, cont, remaining)

    # ---- update --------------------------------------------------------------
    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str = "",
        validation: FieldValidation = FieldValidation.WARN,
        dry_run: bool = False,
        manager: str | None = None,
    ) -> WriteResult:
        """PUT: replace an object (or its ``status`` subresource) with ``body``; ``manager``
        is recorded in managedFields for the fields it changed.

        ``metadata.resourceVersion``, when given, must match (409 Conflict); the other
        part (status for the main resource, everything else for ``status``) is kept;
        generation moves only when the spec changes. Schema checks as for :meth:`create`.
        """
        if rt.shared_key == "/events":
            res = self.update(
                self._core_events(),
                namespace,
                name,
                kinds.event_to_core(self._check_body(rt, body, self._ns(rt, namespace))),
                subresource=subresource,
                validation=validation,
                dry_run=dry_run,
            )
            return WriteResult(self.present(rt, res.obj), res.warnings)
        ns = self._ns(rt, namespace)
        body = self._check_body(rt, body, ns)
        old = self._stored(rt, ns, name)
        meta = body.get("metadata") or {}
        if meta.get("name") and meta["name"] != name:
            raise ApiError.bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        check_preconditions(rt, old, meta)
        return self._write_update(rt, old, clone(body), subresource, validation, dry_run, manager)

    def _write_update(
        self,
        rt: ResourceType,
        old: Obj,
        new: Obj,
        subresource: str,
        validation: FieldValidation,
        dry_run: bool,
        manager: str | None = None,
    ) -> WriteResult:
        """Write ``new`` over ``old`` (update, patch and their ``status`` forms end here):
        keep what the write may not change, check it, record ``manager``'s changed fields,
        bump generation, store it."""
        name = old["metadata"]["name"]
        new = _carry_over(rt, old, new, subresource)
        new["apiVersion"] = self._storage_type(rt).api_version
        new["kind"] = rt.kind
        new, warnings = self._schema_pass(rt, new, validation, name, old)
        kinds.prepare_update(rt, new, old)
        self._validate(rt, new, name)
        causes = kinds.update_causes(rt, new, old, status=subresource == "status")
        if causes:
            raise ApiError.invalid(rt.group, rt.kind, name, causes)
        if not subresource and rt.kind != "Pod":  # a pod's spec cannot change in what is checked
            warnings += self._pod_security(rt, new, old["metadata"].get("namespace", ""), name)
        if rt.kind == "CustomResourceDefinition" and not rt.crd:
            new["status"] = kinds.crd_status({**new, "status": old.get("status")})
        if manager:
            changed = ssa.changed_fields(old, new, merge_keys=not rt.crd, subresource=subresource)
            if changed:
                new["metadata"]["managedFields"] = ssa.record_update(
                    new["metadata"].get("managedFields"), manager, rt.api_version, changed, now_rfc3339(),
                    subresource,
                )  # fmt: skip
        # Generation follows the spec (everything but metadata, and status when it is a subresource).
        if _strip(new, keep_status=not rt.has_status) != _strip(old, keep_status=not rt.has_status):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return WriteResult(self.present(rt, old), warnings)
        if dry_run:
            return WriteResult(self.present(rt, new), warnings)
        return WriteResult(self.present(rt, self._store_update(rt, old, new)), warnings)

    def _store_update(self, rt: ResourceType, old: Obj, new: Obj) -> Obj:
        """Store a changed object; one being deleted that has no finalizer (and whose grace
        period is over) is removed instead. Returns what was stored or removed."""
        nm = new["metadata"]
        if nm.get("deletionTimestamp") and not nm.get("finalizers") and self._grace_done(rt, new):
            final = self.store.remove(rt.key, new)
            self._after_remove(rt, final)
            return final
        self.store.put(rt.key, new, EventType.MODIFIED)
        self._after_write(rt, new, old)
        return new

    def _grace_done(self, rt: ResourceType, obj: Obj) -> bool:
        """Whether an object being deleted may go once its finalizers are gone."""
        return not (rt.kind == "Pod" and not rt.crd and obj["metadata"].get("deletionGracePeriodSeconds"))

    def bind(self, rt: ResourceType, namespace: str, name: str, node: str) -> Obj:
        """Assign a pod to ``node`` (the ``binding`` subresource): spec.nodeName and PodScheduled at once."""
        old = self._stored(rt, namespace, name)
        current = (old.get("spec") or {}).get("nodeName")
        if current:
            raise ApiError.conflict(
                rt.group, rt.plural, name, f"pod {name} is already assigned to node {current!r}"
            )
        if old["metadata"].get("deletionTimestamp"):
            raise ApiError.conflict(
                rt.group, rt.plural, name, f"pod {name} is being deleted, cannot be assigned"
            )
        new = clone(old)
        new["spec"]["nodeName"] = node
        status = new.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": now_rfc3339(),
            }
        )
        status["conditions"] = conditions
        self.store.put(rt.key, new, EventType.MODIFIED)
        return self.present(rt, new)

    # ---- patch ---------------------------------------------------------------
    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch_type: PatchType,
        patch: Any,
        *,
        subresource: str = "",
        validation: FieldValidation = FieldValidation.WARN,
        dry_run: bool = False,
        field_manager: str | None = None,
        force: bool = False,
    ) -> WriteResult:
        """PATCH an object (or its ``status`` or ``scale`` subresource): JSON, merge,
        strategic-merge, or server-side apply (``field_manager``; a field another manager
        owns is a 409 Conflict unless ``force``). Then as :meth:`update`."""
        ns = self._ns(rt, namespace)
        old = self.store.get(rt.key, ns, name)
        if patch_type is PatchType.APPLY:
            if not field_manager:
                raise ApiError.invalid(
                    "meta.k8s.io",
                    "PatchOptions",
                    "",
                    [
                        FieldCause(
                            "FieldValueRequired",
                            "Required value: is required for apply patch",
                            "fieldManager",
                        )
                    ],
                )
            if not isinstance(patch, dict):
                raise ApiError.bad_request("an apply patch must be an object")
            fields_set = ssa.applied_fields(patch, merge_keys=not rt.crd)
            if old is None:
                if subresource:
                    raise ApiError.not_found(rt.group, rt.plural, name)
                body = clone(patch)
                body.setdefault("metadata", {})["name"] = name
                managed = ssa.record(None, field_manager, rt.api_version, fields_set, now_rfc3339())
                return self.create(
                    rt, namespace, body, validation=validation, dry_run=dry_run, managed=managed
                )
            current = self.present(rt, old)
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
            check_preconditions(rt, old, patch.get("metadata") or {})
            return self._write_update(rt, old, new, subresource, validation, dry_run)
        if old is None:
            raise ApiError.not_found(rt.group, rt.plural, name)
        if subresource == "scale":
            return self.scale.patch(rt, namespace, name, patch_type, patch, dry_run=dry_run)
        if patch_type is PatchType.STRATEGIC and rt.crd:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{PatchType.JSON.value}, {PatchType.MERGE.value}, {PatchType.APPLY.value}",
            )
        current = self.present(rt, old)
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
        meta = new.get("metadata") or {}
        check_preconditions(rt, old, meta)
        new = clone(new)
        if rt.shared_key == "/events":
            res = self._write_update(
                self._core_events(), old, kinds.event_to_core(new), subresource, validation, dry_run
            )
            return WriteResult(self.present(rt, res.obj), res.warnings)
        return self._write_update(rt, old, new, subresource, validation, dry_run, field_manager)

    # ---- delete --------------------------------------------------------------
    def delete(
        self, rt: ResourceType, namespace: str | None, name: str, options: DeleteOptions | None = None
    ) -> tuple[Obj, bool]:
        """Delete one object. Returns (object, removed): removed is False while deletion is pending."""
        opts = options or DeleteOptions()
        ns = self._ns(rt, namespace)
        obj = self._stored(rt, ns, name)
        meta = obj["metadata"]
        if opts.precondition_uid and opts.precondition_uid != meta.get("uid"):
            raise ApiError.conflict(
                rt.group,
                rt.plural,
                name,
                f"Precondition failed: UID in precondition: {opts.precondition_uid}, UID in "
                f"object meta: {meta.get('uid')}",
            )
        if opts.precondition_rv and opts.precondition_rv != meta.get("resourceVersion"):
            raise ApiError.conflict(
                rt.group,
                rt.plural,
                name,
                f"Precondition failed: ResourceVersion in precondition: "
                f"{opts.precondition_rv}, ResourceVersion in object meta: "
                f"{meta.get('resourceVersion')}",
            )
        is_pod = rt.kind == "Pod" and not rt.crd
        grace = kinds.pod_grace_period(obj, opts.grace_period) if is_pod else 0
        finalizers = list(meta.get("finalizers") or ())
        policy = opts.propagation
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise ApiError.bad_request(
                f'propagationPolicy: Unsupported value: "{policy}": supported values: "Background", '
                '"Foreground", "Orphan"'
            )
        if policy == "Orphan" and FINALIZER_ORPHAN not in finalizers and self.store.dependents(meta["uid"]):
            finalizers.append(FINALIZER_ORPHAN)
        if (
            policy == "Foreground"
            and FINALIZER_FOREGROUND not in finalizers
            and self.store.dependents(meta["uid"])
        ):
            finalizers.append(FINALIZER_FOREGROUND)
        if rt.kind == "Namespace" and not rt.crd:
            return self.namespaces.delete(rt, obj, opts)
        if opts.dry_run:
            return self.present(rt, obj), False
        if meta.get("deletionTimestamp"):
            # Already being deleted: only a shorter grace period changes anything.
            current = meta.get("deletionGracePeriodSeconds") or 0
            if is_pod and grace < current:
                new = clone(obj)
                nm = new["metadata"]
                nm["deletionGracePeriodSeconds"] = grace
                nm["deletionTimestamp"] = now_rfc3339(grace)
                if grace == 0 and not nm.get("finalizers"):
                    return self.present(rt, self._remove(rt, new)), True
                self.store.put(rt.key, new, EventType.MODIFIED)
                return self.present(rt, new), False
            if set(finalizers) - set(meta.get("finalizers") or ()):
                new = clone(obj)
                new["metadata"]["finalizers"] = finalizers
                self.store.put(rt.key, new, EventType.MODIFIED)
                return self.present(rt, new), False
            return self.present(rt, obj), False
        if finalizers or grace > 0:
            new = clone(obj)
            nm = new["metadata"]
            nm["deletionTimestamp"] = now_rfc3339(grace)
            nm["deletionGracePeriodSeconds"] = grace
            if finalizers:
                nm["finalizers"] = finalizers
            self.store.put(rt.key, new, EventType.MODIFIED)
            return self.present(rt, new), False
        return self.present(rt, self._remove(rt, obj)), True

    def _remove(self, rt: ResourceType, obj: Obj) -> Obj:
        final = self.store.remove(rt.key, obj)
        self._after_remove(rt, final)
        return final

    def _after_remove(self, rt: ResourceType, obj: Obj) -> None:
        if rt.crd:
            return
        if rt.kind == "Service":
            self.services.release(obj)
        elif rt.kind == "CustomResourceDefinition":
            removed = self.types.unregister_crd(obj["metadata"]["name"])
            for t in removed[:1]:
                for cr in self.store.list(t.key):
                    self.store.remove(t.key, cr)
                self.store.drop_key(t.key)
                self.store.close_history(t.key)
            self._types_changed()

    def delete_collection(
        self,
        rt: ResourceType,
        namespace: str | None,
        options: DeleteOptions,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> builtins.list[Obj]:
        """DELETE a collection: :meth:`delete` each matching object; returns them."""
        result = self.list(rt, namespace, label_selector=label_selector, field_selector=field_selector)
        out = []
        for obj in result.items:
            m = obj["metadata"]
            try:
                out.append(self.delete(rt, m.get("namespace"), m["name"], options)[0])
            except ApiError as exc:
                if exc.code != 404:
                    raise
        return out

    # ---- watch ---------------------------------------------------------------
    def events_since(self, rt: ResourceType, rv: int) -> builtins.list[Any]:
        """The stored watch events of ``rt`` after resourceVersion ``rv``; 410 Gone when
        ``rv`` is older than the retained history (the client must list again)."""
        try:
            return list(self.store.events_since(rt.key, rv))
        except Gone as exc:
            raise ApiError.gone(str(exc)) from None


_OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)

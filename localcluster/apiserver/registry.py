"""Object semantics of the API server: create, read, update, patch, delete.

:class:`Registry` is the API's behaviour independent of HTTP: names and
generateName, uid, creationTimestamp, resourceVersion preconditions (409
Conflict), generation bumped on spec changes only, status and scale
subresources, CRD schemas (prune, default, validate → 422), finalizers and
deletionTimestamp, graceful pod deletion, and registration of CRD types. It runs
on the server's event loop thread; every method is synchronous.

The registry holds the store and the order of each operation; the rules of each request
are pure decisions in their own modules: :mod:`.objectmeta` (a body's envelope, a new
object's name and metadata), :mod:`.admission`, :mod:`.listing`, :mod:`.patching` and
:mod:`.deletion`, beside :mod:`.kinds` (per-kind rules) and :mod:`.schema` (CRD schemas).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

from . import admission, deletion, fields, kinds, listing, objectmeta, patching, schema, ssa
from .cel import MISSING
from .deletion import FINALIZER_FOREGROUND, FINALIZER_ORPHAN
from .errors import ApiError, FieldCause
from .namespaces import Namespaces
from .patch import clone
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
        for name, (value, description) in admission.SYSTEM_PRIORITY_CLASSES.items():
            if self.store.get(pc_type.key, "", name) is None:
                body = {"metadata": {"name": name}, "value": value, "description": description}
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
                kinds.event_to_core(objectmeta.check_body(rt, body, self._ns(rt, namespace))),
                validation=validation,
                dry_run=dry_run,
            )
            return WriteResult(self.present(rt, res.obj), res.warnings, res.created)
        ns = self._ns(rt, namespace)
        body = objectmeta.check_body(rt, body, ns)
        obj = clone(body)
        meta = obj.setdefault("metadata", {})
        name = objectmeta.name_of(rt, meta, lambda taken: self.store.get(rt.key, ns, taken) is not None)
        self.namespaces.check_open(rt, ns)
        if self.store.get(rt.key, ns, name) is not None:
            raise ApiError.already_exists(rt.group, rt.plural, name)
        objectmeta.set_new_metadata(rt, meta, ns, managed)
        st = self._storage_type(rt)
        obj["apiVersion"] = st.api_version
        obj["kind"] = rt.kind
        if rt.crd and rt.has_status:
            obj.pop("status", None)
        obj, warnings = self._schema_pass(rt, obj, validation, name)
        if rt.kind == "Pod" and not rt.crd:
            admission.admit_priority(self.store, self.types, obj, name)
        try:
            kinds.prepare_create(rt, obj, self.services)
        except ValueError as exc:
            raise ApiError.invalid(
                rt.group, rt.kind, name, [FieldCause("FieldValueInvalid", str(exc), "")]
            ) from None
        self._validate(rt, obj, name)
        if rt.kind == "CustomResourceDefinition" and not rt.crd:
            admission.check_crd_names(self.types, obj)
        warnings += admission.pod_security(self.store, rt, obj, ns, name)
        if dry_run:
            if rt.kind == "Service" and not rt.crd:
                self.services.release(obj)
            return WriteResult(self.present(rt, obj), warnings, True)
        self.store.put(rt.key, obj, EventType.ADDED)
        self._after_write(rt, obj, None)
        return WriteResult(self.present(rt, obj), warnings, True)

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
        return listing.list_objects(
            self.store,
            rt,
            namespace,
            self.present,
            label_selector=label_selector,
            field_selector=field_selector,
            limit=limit,
            continue_token=continue_token,
            resource_version=resource_version,
            resource_version_match=resource_version_match,
        )

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
                kinds.event_to_core(objectmeta.check_body(rt, body, self._ns(rt, namespace))),
                subresource=subresource,
                validation=validation,
                dry_run=dry_run,
            )
            return WriteResult(self.present(rt, res.obj), res.warnings)
        ns = self._ns(rt, namespace)
        body = objectmeta.check_body(rt, body, ns)
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
            warnings += admission.pod_security(
                self.store, rt, new, old["metadata"].get("namespace", ""), name
            )
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
        new = kinds.bound_pod(rt, self._stored(rt, namespace, name), node, now_rfc3339())
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
            fields_set = patching.apply_fields(rt, patch, field_manager)
            assert field_manager is not None  # apply_fields refuses an apply without one
            if old is None:
                if subresource:
                    raise ApiError.not_found(rt.group, rt.plural, name)
                body = clone(patch)
                body.setdefault("metadata", {})["name"] = name
                managed = ssa.record(None, field_manager, rt.api_version, fields_set, now_rfc3339())
                return self.create(
                    rt, namespace, body, validation=validation, dry_run=dry_run, managed=managed
                )
            new = patching.applied(rt, self.present(rt, old), old, patch, field_manager, fields_set, force)
            check_preconditions(rt, old, patch.get("metadata") or {})
            return self._write_update(rt, old, new, subresource, validation, dry_run)
        if old is None:
            raise ApiError.not_found(rt.group, rt.plural, name)
        if subresource == "scale":
            return self.scale.patch(rt, namespace, name, patch_type, patch, dry_run=dry_run)
        new = patching.patched(rt, self.present(rt, old), patch_type, patch)
        check_preconditions(rt, old, new.get("metadata") or {})
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
        deletion.check_preconditions(rt, meta, opts)
        is_pod = rt.kind == "Pod" and not rt.crd
        grace = kinds.pod_grace_period(obj, opts.grace_period) if is_pod else 0
        finalizers = deletion.finalizers_for(
            opts.propagation, meta, lambda: bool(self.store.dependents(meta["uid"]))
        )
        if rt.kind == "Namespace" and not rt.crd:
            return self.namespaces.delete(rt, obj, opts)
        if opts.dry_run:
            return self.present(rt, obj), False
        if meta.get("deletionTimestamp"):
            new, goes = deletion.deleted_again(obj, is_pod, grace, finalizers)
            if new is None:
                return self.present(rt, obj), False
            if goes:
                return self.present(rt, self._remove(rt, new)), True
            self.store.put(rt.key, new, EventType.MODIFIED)
            return self.present(rt, new), False
        if finalizers or grace > 0:
            new = deletion.marked(obj, grace, finalizers)
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

"""The resource types the API server serves: built-in kinds and CRD-registered kinds.

A :class:`ResourceType` is everything discovery, routing, validation and table
printing need to know about one resource at one group/version. Built-ins are
declared in :data:`BUILTINS`; :func:`types_from_crd` derives the types a
CustomResourceDefinition registers (one per served version, sharing storage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTINS", "ResourceType", "TypeRegistry", "types_from_crd"]

Obj = dict[str, Any]

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    #: Subresources beyond the object itself: "status", "scale", "log", "binding", "eviction".
    subresources: tuple[str, ...] = ()
    #: CRD-only: the version's openAPIV3Schema, printer columns and scale paths.
    schema: Obj | None = None
    printer_columns: tuple[Obj, ...] = ()
    scale: Obj | None = None
    crd: bool = False
    #: The version objects are kept in (CRDs: the storage version; conversion is "None").
    storage_version: str = ""
    #: Storage shared with another resource (events.k8s.io Events are core Events).
    shared_key: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """The storage key, shared by every version of the resource."""
        return self.shared_key or f"{self.group}/{self.plural}"

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def group_version(self) -> str:
        return self.api_version


def _t(
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool = True,
    short: tuple[str, ...] = (),
    cats: tuple[str, ...] = (),
    subs: tuple[str, ...] = (),
    verbs: tuple[str, ...] = ALL_VERBS,
) -> ResourceType:
    return ResourceType(group, version, plural, kind.lower(), kind, namespaced, short, cats, verbs, subs)


BUILTINS: tuple[ResourceType, ...] = (
    _t(
        "",
        "v1",
        "namespaces",
        "Namespace",
        False,
        ("ns",),
        subs=("status", "finalize"),
        verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
    ),
    _t("", "v1", "nodes", "Node", False, ("no",), subs=("status",)),
    _t("", "v1", "pods", "Pod", True, ("po",), ("all",), ("status", "log", "binding", "eviction")),
    _t(
        "",
        "v1",
        "services",
        "Service",
        True,
        ("svc",),
        ("all",),
        ("status",),
        verbs=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"),
    ),
    _t("", "v1", "endpoints", "Endpoints", True, ("ep",)),
    _t("", "v1", "events", "Event", True, ("ev",)),
    _t("", "v1", "configmaps", "ConfigMap", True, ("cm",)),
    _t("", "v1", "secrets", "Secret", True),
    _t("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",)),
    _t("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), subs=("status",)),
    _t("", "v1", "resourcequotas", "ResourceQuota", True, ("quota",), subs=("status",)),
    _t("", "v1", "limitranges", "LimitRange", True, ("limits",)),
    _t("apps", "v1", "deployments", "Deployment", True, ("deploy",), ("all",), ("status", "scale")),
    _t("apps", "v1", "replicasets", "ReplicaSet", True, ("rs",), ("all",), ("status", "scale")),
    _t("apps", "v1", "statefulsets", "StatefulSet", True, ("sts",), ("all",), ("status", "scale")),
    _t("apps", "v1", "daemonsets", "DaemonSet", True, ("ds",), ("all",), ("status",)),
    _t("batch", "v1", "jobs", "Job", True, (), ("all",), ("status",)),
    _t("batch", "v1", "cronjobs", "CronJob", True, ("cj",), ("all",), ("status",)),
    _t("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType("events.k8s.io", "v1", "events", "event", "Event", True, ("ev",), shared_key="/events"),
    _t("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True),
    _t("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), subs=("status",)),
    _t("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ("netpol",)),
    _t("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, ("pc",)),
    _t(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("crd", "crds"),
        ("api-extensions",),
        ("status",),
    ),
    _t("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
    _t("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
    _t("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _t("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _t(
        "authorization.k8s.io",
        "v1",
        "selfsubjectaccessreviews",
        "SelfSubjectAccessReview",
        False,
        verbs=("create",),
    ),
    _t("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview", False, verbs=("create",)),
)

#: The preferred version of every group, in discovery order.
GROUP_ORDER = (
    "",
    "apps",
    "batch",
    "coordination.k8s.io",
    "events.k8s.io",
    "discovery.k8s.io",
    "policy",
    "scheduling.k8s.io",
    "apiextensions.k8s.io",
    "rbac.authorization.k8s.io",
    "authorization.k8s.io",
)


def types_from_crd(crd: Obj) -> list[ResourceType]:
    """The resource types a CRD registers: one per served version."""
    spec = crd["spec"]
    names = spec["names"]
    plural = names["plural"]
    kind = names["kind"]
    namespaced = spec.get("scope", "Namespaced") == "Namespaced"
    storage = next((v["name"] for v in spec["versions"] if v.get("storage")), spec["versions"][0]["name"])
    out = []
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        subs = v.get("subresources") or {}
        sub_names = tuple(s for s in ("status", "scale") if s in subs)
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        out.append(
            ResourceType(
                group=spec["group"],
                version=v["name"],
                plural=plural,
                singular=names.get("singular") or kind.lower(),
                kind=kind,
                namespaced=namespaced,
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=sub_names,
                schema=schema,
                printer_columns=tuple(v.get("additionalPrinterColumns") or ()),
                scale=subs.get("scale"),
                crd=True,
                storage_version=storage,
            )
        )
    return out


class TypeRegistry:
    """Lookup of served resource types by group/version/plural, kind and storage key."""

    def __init__(self) -> None:
        self._by_gvr: dict[tuple[str, str, str], ResourceType] = {}
        self._crd_types: dict[str, list[ResourceType]] = {}
        #: Bumped whenever the set of served types changes (cache key for discovery documents).
        self.generation = 0
        for t in BUILTINS:
            self._by_gvr[(t.group, t.version, t.plural)] = t

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._by_gvr.get((group, version, plural))

    def all(self) -> list[ResourceType]:
        return list(self._by_gvr.values())

    def by_key(self, key: str) -> ResourceType | None:
        """The preferred (storage) type of a storage key."""
        found = None
        for t in self._by_gvr.values():
            if t.key == key:
                if not t.crd or t.version == t.storage_version:
                    return t
                found = found or t
        return found

    def by_group_kind(self, group: str, kind: str) -> ResourceType | None:
        found = None
        for t in self._by_gvr.values():
            if t.group == group and t.kind == kind:
                if not t.crd or t.version == t.storage_version:
                    return t
                found = found or t
        return found

    def group_versions(self) -> dict[str, list[str]]:
        """Served versions per group (the preferred one first)."""
        out: dict[str, list[str]] = {}
        for t in self._by_gvr.values():
            versions = out.setdefault(t.group, [])
            if t.version not in versions:
                if t.crd and t.version == t.storage_version:
                    versions.insert(0, t.version)
                else:
                    versions.append(t.version)
        order = {g: i for i, g in enumerate(GROUP_ORDER)}
        return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [t for t in self._by_gvr.values() if t.group == group and t.version == version]

    def register_crd(self, crd: Obj) -> list[ResourceType]:
        """(Re)register the types of ``crd``; returns them."""
        name = crd["metadata"]["name"]
        self.unregister_crd(name)
        types = types_from_crd(crd)
        for t in types:
            self._by_gvr[(t.group, t.version, t.plural)] = t
        self._crd_types[name] = types
        self.generation += 1
        return types

    def unregister_crd(self, name: str) -> list[ResourceType]:
        types = self._crd_types.pop(name, [])
        for t in types:
            self._by_gvr.pop((t.group, t.version, t.plural), None)
        self.generation += 1
        return types

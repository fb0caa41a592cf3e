"""Legacy discovery documents: ``/version``, ``/api``, ``/apis`` and APIResourceLists.

kubectl and the official client fall back to these when aggregated discovery is
not offered, so the server serves only the legacy forms (plain
``application/json``). Documents are derived from the :class:`TypeRegistry` on
each request; they change when a CRD is applied or deleted.
"""

from __future__ import annotations

from typing import Any

from .resources import ResourceType, TypeRegistry

__all__ = ["api_group", "api_group_list", "api_versions", "resource_list", "version_info"]

Obj = dict[str, Any]

_SUB_VERBS = {
    "status": ["get", "patch", "update"],
    "scale": ["get", "patch", "update"],
    "log": ["get"],
    "binding": ["create"],
    "eviction": ["create"],
    "finalize": ["update"],
}


def version_info() -> Obj:
    return {
        "major": "1",
        "minor": "37",
        "gitVersion": "v1.37.2-kelastic",
        "gitCommit": "kelastic-local",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.26",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def api_versions(server_address: str) -> Obj:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def api_group(types: TypeRegistry, group: str) -> Obj | None:
    versions = types.group_versions().get(group)
    if not versions:
        return None
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": gvs,
        "preferredVersion": gvs[0],
    }


def api_group_list(types: TypeRegistry) -> Obj:
    groups = []
    for group in types.group_versions():
        if group:
            doc = api_group(types, group)
            assert doc is not None
            doc.pop("kind")
            doc.pop("apiVersion")
            groups.append(doc)
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def _entry(t: ResourceType) -> Obj:
    out: Obj = {
        "name": t.plural,
        "singularName": t.singular,
        "namespaced": t.namespaced,
        "kind": t.kind,
        "verbs": list(t.verbs),
    }
    if t.short_names:
        out["shortNames"] = list(t.short_names)
    if t.categories:
        out["categories"] = list(t.categories)
    return out


def resource_list(types: TypeRegistry, group: str, version: str) -> Obj | None:
    ts = sorted(types.in_group_version(group, version), key=lambda t: t.plural)
    if not ts:
        return None
    resources = []
    for t in ts:
        resources.append(_entry(t))
        for sub in t.subresources:
            entry: Obj = {
                "name": f"{t.plural}/{sub}",
                "singularName": "",
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": _SUB_VERBS[sub],
            }
            if sub == "scale":
                entry.update(group="autoscaling", version="v1", kind="Scale")
            elif sub == "binding":
                entry["kind"] = "Binding"
            elif sub == "eviction":
                entry.update(group="policy", version="v1", kind="Eviction")
            resources.append(entry)
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

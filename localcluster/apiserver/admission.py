"""Admission of written objects: what the real server's admission plugins decide.

- :func:`admit_priority`: the ``Priority`` plugin: a pod's ``priority`` and
  ``preemptionPolicy`` come from its PriorityClass (else the global default one, else 0);
  an unknown class is 403. :data:`SYSTEM_PRIORITY_CLASSES` are the classes every API
  server makes for itself.
- :func:`pod_security`: Pod Security admission of a created pod or a written workload
  (the standards themselves are :mod:`.podsecurity`).
- :func:`check_crd_names`: a CustomResourceDefinition may not take the group and plural
  of a built-in resource.

Each reads the store or the served types and decides; none writes.
"""

from __future__ import annotations

from . import podsecurity
from .errors import ApiError, FieldCause
from .registry_types import Obj
from .resources import ResourceType, TypeRegistry
from .storage import Store

__all__ = ["SYSTEM_PRIORITY_CLASSES", "admit_priority", "check_crd_names", "pod_security"]

#: name → (value, description) of the priority classes an API server creates at start.
SYSTEM_PRIORITY_CLASSES = {
    "system-node-critical": (
        2000001000,
        "Used for system critical pods that must not be moved from their current node.",
    ),
    "system-cluster-critical": (
        2000000000,
        "Used for system critical pods that must run in the cluster, but can be moved to "
        "another node if necessary.",
    ),
}


def admit_priority(store: Store, types: TypeRegistry, pod: Obj, name: str) -> None:
    """Priority admission: a pod's ``priority`` and ``preemptionPolicy`` come from its
    PriorityClass (else the global default one, else 0); an unknown class is 403.
    ``pod`` is changed in place."""
    spec = pod.setdefault("spec", {})
    pc_type = types.lookup("scheduling.k8s.io", "v1", "priorityclasses")
    if pc_type is None:
        return
    wanted = spec.get("priorityClassName")
    classes = store.list(pc_type.key, "")
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


def pod_security(store: Store, rt: ResourceType, obj: Obj, ns: str, name: str) -> list[str]:
    """Pod Security admission of a created pod or written workload: a pod that violates the
    enforced standard is refused (403); a pod or pod template that violates the warned one
    gets its warning (workloads are never refused)."""
    spec = None if rt.crd else podsecurity.pod_template_spec(rt.kind, obj)
    if spec is None:
        return []
    nsobj = store.get("/namespaces", "", ns) or {}
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


def check_crd_names(types: TypeRegistry, crd: Obj) -> None:
    """422 Invalid when ``crd`` names the group and plural of a built-in resource."""
    spec = crd["spec"]
    for v in spec.get("versions") or ():
        existing = types.lookup(spec["group"], v["name"], spec["names"]["plural"])
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

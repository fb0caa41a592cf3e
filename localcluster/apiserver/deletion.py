"""DELETE: what a delete request does to an object, decided without touching the store.

An object goes at once unless it has finalizers or is a pod with a grace period; then it
is marked (``deletionTimestamp``, ``deletionGracePeriodSeconds``) and goes when the last
finalizer is removed (for a pod: when its kubelet deletes it with grace 0). The
propagation policy adds the garbage collector's finalizer (``orphan`` or
``foregroundDeletion``) to an object that has dependents. Deleting an object that is
already being deleted only shortens a pod's grace period or adds such a finalizer.
Preconditions (uid, resourceVersion) that do not match are 409 Conflict.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import ApiError
from .patch import clone
from .registry_types import DeleteOptions, Obj, now_rfc3339
from .resources import ResourceType

__all__ = [
    "FINALIZER_FOREGROUND",
    "FINALIZER_ORPHAN",
    "check_preconditions",
    "deleted_again",
    "finalizers_for",
    "marked",
]

FINALIZER_ORPHAN = "orphan"
FINALIZER_FOREGROUND = "foregroundDeletion"


def check_preconditions(rt: ResourceType, meta: Obj, opts: DeleteOptions) -> None:
    """409 Conflict when the request's uid or resourceVersion precondition is not the object's."""
    name = meta.get("name", "")
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


def finalizers_for(policy: str | None, meta: Obj, has_dependents: Callable[[], bool]) -> list[str]:
    """The object's finalizers once deletion under ``policy`` starts (400 for an unknown policy):
    ``Orphan`` and ``Foreground`` add the garbage collector's finalizer when it has dependents."""
    finalizers = list(meta.get("finalizers") or ())
    if policy not in (None, "Background", "Foreground", "Orphan"):
        raise ApiError.bad_request(
            f'propagationPolicy: Unsupported value: "{policy}": supported values: "Background", '
            '"Foreground", "Orphan"'
        )
    wanted = {"Orphan": FINALIZER_ORPHAN, "Foreground": FINALIZER_FOREGROUND}.get(policy or "")
    if wanted is not None and wanted not in finalizers and has_dependents():
        finalizers.append(wanted)
    return finalizers


def marked(obj: Obj, grace: int, finalizers: list[str]) -> Obj:
    """``obj`` marked for deletion in ``grace`` seconds, with ``finalizers`` (a new object)."""
    new = clone(obj)
    nm = new["metadata"]
    nm["deletionTimestamp"] = now_rfc3339(grace)
    nm["deletionGracePeriodSeconds"] = grace
    if finalizers:
        nm["finalizers"] = finalizers
    return new


def deleted_again(obj: Obj, is_pod: bool, grace: int, finalizers: list[str]) -> tuple[Obj | None, bool]:
    """A delete of an object already being deleted: (the changed object or None when nothing
    changes, whether it goes now). Only a shorter grace period of a pod (grace 0 and no
    finalizers: it goes) or a finalizer the policy adds changes anything."""
    meta = obj["metadata"]
    current = meta.get("deletionGracePeriodSeconds") or 0
    if is_pod and grace < current:
        new = clone(obj)
        nm = new["metadata"]
        nm["deletionGracePeriodSeconds"] = grace
        nm["deletionTimestamp"] = now_rfc3339(grace)
        return new, grace == 0 and not nm.get("finalizers")
    if set(finalizers) - set(meta.get("finalizers") or ()):
        new = clone(obj)
        new["metadata"]["finalizers"] = finalizers
        return new, False
    return None, False

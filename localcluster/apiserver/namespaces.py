"""The namespace lifecycle: creating into a namespace, deleting it, finalizing it.

A namespace being deleted turns ``Terminating`` and refuses new content (403
NamespaceTerminating); the garbage collector (:mod:`.gc`) deletes what it holds and
calls :meth:`Namespaces.finish`, which removes the namespace once it is empty and has no
finalizers left (the ``finalize`` subresource clears them). ``default``, ``kube-system``
and ``kube-public`` cannot be deleted.
"""

from __future__ import annotations

from .errors import ApiError
from .patch import clone
from .registry_types import DeleteOptions, FieldValidation, Obj, now_rfc3339
from .registry_view import RegistryView
from .resources import ResourceType
from .storage import EventType

__all__ = ["PROTECTED", "Namespaces"]

#: Namespaces that cannot be deleted.
PROTECTED = frozenset({"default", "kube-system", "kube-public"})


class Namespaces:
    """The namespace lifecycle of one registry."""

    def __init__(self, registry: RegistryView) -> None:
        self._registry = registry

    def check_open(self, rt: ResourceType, ns: str) -> None:
        """Before creating an ``rt`` object in ``ns``: 404 when the namespace does not exist,
        403 (NamespaceTerminating) while it is being deleted."""
        if not rt.namespaced:
            return
        nsobj = self._registry.store.get("/namespaces", "", ns)
        if nsobj is None:
            raise ApiError(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        if nsobj["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f'{rt.plural} "" is forbidden: unable to create new content in '
                f"namespace {ns} because it is being terminated",
                {
                    "kind": rt.plural,
                    "causes": [
                        {
                            "reason": "NamespaceTerminating",
                            "message": f"namespace {ns} is being terminated",
                            "field": "metadata.namespace",
                        }
                    ],
                },
            )

    def delete(self, rt: ResourceType, obj: Obj, opts: DeleteOptions) -> tuple[Obj, bool]:
        """DELETE of a namespace: 403 for the protected ones; else it turns Terminating (the
        garbage collector empties it, :meth:`finish` removes it). Returns (object, False)."""
        name = obj["metadata"]["name"]
        if name in PROTECTED:
            raise ApiError(
                403,
                "Forbidden",
                f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                {"name": name, "kind": "namespaces"},
            )
        reg = self._registry
        if opts.dry_run or obj["metadata"].get("deletionTimestamp"):
            return reg.present(rt, obj), False
        new = clone(obj)
        new["metadata"]["deletionTimestamp"] = now_rfc3339()
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        new["status"] = {"phase": "Terminating"}
        reg.store.put(rt.key, new, EventType.MODIFIED)
        return reg.present(rt, new), False

    def finalize(self, name: str, finalizers: list[str]) -> Obj:
        """The ``finalize`` subresource: set spec.finalizers; a terminating namespace left empty goes."""
        reg = self._registry
        rt = self._type()
        old = reg._stored(rt, "", name)
        new = clone(old)
        new["spec"] = {"finalizers": finalizers}
        result = reg._write_update(rt, old, new, "", FieldValidation.IGNORE, False).obj
        self.finish(name)
        return result

    def finish(self, name: str) -> bool:
        """Remove a terminating namespace once it holds nothing; True if removed."""
        reg = self._registry
        ns = reg.store.get("/namespaces", "", name)
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return False
        for t in reg.types.all():
            if t.namespaced and reg.store.count(t.key, name):
                return False
        if ns["metadata"].get("finalizers"):
            return False
        reg._remove(self._type(), ns)
        return True

    def _type(self) -> ResourceType:
        rt = self._registry.types.lookup("", "v1", "namespaces")
        assert rt is not None  # a built-in kind
        return rt

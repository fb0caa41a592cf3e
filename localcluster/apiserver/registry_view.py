"""What the registry's helpers (the namespace lifecycle, the scale subresource) see of it.

They are parts of one registry and call back into its write path; a Protocol here, below
both, lets them name that path without importing the registry's module, which imports
them (no import circle).
"""

from __future__ import annotations

from typing import Protocol

from .registry_types import FieldValidation, Obj, WriteResult
from .resources import ResourceType, TypeRegistry
from .storage import Store

__all__ = ["RegistryView"]


class RegistryView(Protocol):
    """The registry as its helpers use it: its store and types, and its write path."""

    store: Store
    types: TypeRegistry

    def present(self, rt: ResourceType, obj: Obj) -> Obj: ...

    def _ns(self, rt: ResourceType, namespace: str | None) -> str: ...

    def _stored(self, rt: ResourceType, ns: str, name: str) -> Obj: ...

    def _remove(self, rt: ResourceType, obj: Obj) -> Obj: ...

    def _write_update(
        self,
        rt: ResourceType,
        old: Obj,
        new: Obj,
        subresource: str,
        validation: FieldValidation,
        dry_run: bool,
        manager: str | None = None,
    ) -> WriteResult: ...

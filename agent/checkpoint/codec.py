"""A checkpoint's metadata as bytes, read back without running code.

torch.distributed.checkpoint's ``Metadata`` is a pickle (DCP itself writes ``.metadata``
with ``pickle.dump`` and reads it with ``pickle.load``, which can run any code the bytes
name). kelastic encodes it the same way (:func:`dumps`), so that a durable copy stays
DCP's own layout, but reads every metadata it did not just make with :func:`loads`: an
unpickler that builds only the classes a DCP metadata consists of (its dataclasses, the
per-item storage records of kelastic and of DCP's file system layout, ``torch.Size``,
torch's dtypes, layouts and memory formats, plain containers) and refuses any other
global with :class:`UnsafeMetadata`, naming it. So metadata that crossed the network, or
lies in a durable directory, cannot run code in the process that reads it.

The items of a checkpoint that are not tensors (``BYTE_IO``: a step counter, a dict of
hyperparameters, any object in the state) are ``torch.save`` archives, which DCP's load
planners read with ``torch.load(..., weights_only=False)``, a full unpickling. kelastic's
readers hand a planner only an item that :func:`check_item` read first with torch's own
``weights_only`` unpickler (tensors, plain containers, numbers, strings, what
``torch.serialization.add_safe_globals`` allows, and ``io.BytesIO``, which DCP saves as
such): an item that needs more is refused with :class:`UnsafeItem`, naming it and what it
needs, and never reaches the full unpickler.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["UnsafeItem", "UnsafeMetadata", "check_commit", "check_item", "dumps", "loads"]

#: (module, name) globals a DCP metadata may name, beside torch's dtypes, layouts and
#: memory formats (checked by type in :meth:`_Unpickler.find_class`).
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("kelastic.agent.checkpoint.storage", "MemoryItem"),
        ("torch", "Size"),
        # rebuilds a torch.layout from its name (a lookup in torch's own layouts)
        ("torch.serialization", "_get_layout"),
        # DCP's file system writer records its checkpoint_id as a path
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafeMetadata(pickle.UnpicklingError):
    """Metadata that names something a DCP metadata never holds (refused, nothing run)."""


#: Python 3.11.0 to 3.11.3 (Debian bookworm's python3 among them) pickle an Enum member as
#: ``getattr(EnumClass, "NAME")``; the unpicklers answer that global with a lookup of an
#: allowed Enum's member by name, never with getattr itself.
_GETATTR = ("builtins", "getattr")


def _enum_member(cls: Any, member: Any) -> Any:
    import enum

    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(member, str)
        and member in cls.__members__
    ):
        return cls[member]
    raise UnsafeMetadata(
        f"checkpoint metadata calls getattr({getattr(cls, '__name__', type(cls).__name__)}, {member!r}), "
        "which is no member of an allowed Enum; refused without running it"
    )


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _GETATTR:
            return _enum_member
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeMetadata(
            f"checkpoint metadata names {module}.{name}, which a torch.distributed.checkpoint "
            "metadata never holds; refused without running it"
        )


class UnsafeItem(pickle.UnpicklingError):
    """A checkpoint item whose bytes name more than torch's weights_only unpickler allows
    (refused, nothing run)."""


def check_item(blob: bytes, name: str) -> None:
    """Read the non-tensor item ``name`` (a ``torch.save`` archive) with torch's
    ``weights_only`` unpickler, ``io.BytesIO`` allowed too; UnsafeItem naming it and what it
    needs when it needs more (or is no such archive), so that it never reaches DCP's full
    unpickling."""
    import torch

    try:
        with torch.serialization.safe_globals([io.BytesIO]):
            torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # refusals and malformed bytes fail in many ways; all mean "refused"
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next(
            (ln for ln in lines if "Unsupported" in ln or "global" in ln.lower()), lines[-1] if lines else ""
        )
        raise UnsafeItem(
            f"checkpoint item {name!r} needs more than torch's weights_only unpickler allows ({why}); "
            "refused without running it. Save plain values and tensors, or allow the classes it names "
            "with torch.serialization.add_safe_globals in the restoring process"
        ) from None


def dumps(metadata: Any) -> bytes:
    """DCP's encoding of ``metadata`` (a pickle)."""
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def loads(blob: bytes) -> Any:
    """The metadata in ``blob``, built from allowed classes only; UnsafeMetadata otherwise
    (also for bytes that are no pickle at all)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        value = _Unpickler(io.BytesIO(blob)).load()
    except UnsafeMetadata:
        raise
    except Exception as e:  # bytes that are no pickle fail in many ways; all mean "refused"
        raise UnsafeMetadata(f"checkpoint metadata is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(value, Metadata):
        raise UnsafeMetadata(f"checkpoint metadata is a {type(value).__name__}, not a DCP Metadata")
    return value


class _Stub:
    """Stands for an allowed dataclass while a commit is checked: built and filled by the
    unpickler's own C code (``NEWOBJ``, then ``BUILD`` into ``__dict__``), running nothing."""


class _StateStub(_Stub):
    """A stub for a class with its own ``__setstate__`` (DCP's ``TensorProperties``)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _path_stub(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


#: What stands for the allowed callables while a commit is checked: builtins that take the
#: same arguments and run nothing of interest.
_CALLABLE_STUBS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): str,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): str,
    ("collections", "OrderedDict"): dict,
    ("pathlib", "PosixPath"): _path_stub,
    ("pathlib", "PurePosixPath"): _path_stub,
}
_STUBS: dict[tuple[str, str], Any] = {}


def _stub_member(cls: Any, member: Any) -> str:
    """``getattr(_MEM_FORMAT_ENCODING, NAME)`` while a commit is checked: the Enum's stub is
    ``str``; the member's name stands for it. Anything else is refused."""
    if cls is _CALLABLE_STUBS[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] and (
        isinstance(member, str) and member.isidentifier()
    ):
        return member
    raise UnsafeMetadata(
        f"checkpoint metadata calls getattr on {getattr(cls, '__name__', type(cls).__name__)}, "
        "which is no allowed Enum; refused without running it"
    )


class _Skeleton(_Unpickler):
    """The allow-list of :class:`_Unpickler`, building stubs instead of DCP's classes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _GETATTR:
            return _stub_member
        if (module, name) not in _ALLOWED:
            return super().find_class(module, name)  # torch's dtypes and the like, or UnsafeMetadata
        stub = _STUBS.get((module, name))
        if stub is None:
            base = _StateStub if name == "TensorProperties" else _Stub
            stub = _CALLABLE_STUBS.get((module, name)) or type(name, (base,), {"__module__": module})
            _STUBS[(module, name)] = stub
        return stub


def _fields(obj: Any, name: str) -> dict[str, Any] | None:
    """The fields of a stub of dataclass ``name``, or None."""
    if not isinstance(obj, _Stub) or type(obj).__name__ != name:
        return None
    return vars(obj)


def check_commit(blob: bytes, required: dict[str, int]) -> None:
    """What the checkpoint service checks of a commit before it takes it: ``blob`` is a DCP
    metadata naming nothing but what :func:`loads` allows (checked without building it and
    without importing torch.distributed.checkpoint), every item of which is a memory
    checkpoint record lying in a file of ``required`` (the commit's manifest) within its
    size. UnsafeMetadata saying what is wrong otherwise."""
    try:
        top = _Skeleton(io.BytesIO(blob)).load()
    except UnsafeMetadata:
        raise
    except Exception as e:
        raise UnsafeMetadata(f"checkpoint metadata is unreadable: {type(e).__name__}: {e}") from None
    metadata = _fields(top, "Metadata")
    if metadata is None:
        raise UnsafeMetadata(f"checkpoint metadata is a {type(top).__name__}, not a DCP Metadata")
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise UnsafeMetadata("checkpoint metadata has no storage records")
    for n, where in enumerate(storage.values()):
        item = _fields(where, "MemoryItem")
        if item is None:
            raise UnsafeMetadata(f"item {n} is stored as a {type(where).__name__}, not a MemoryItem")
        path, offset, length = item.get("relative_path"), item.get("offset"), item.get("length")
        if not (isinstance(path, str) and type(offset) is int and type(length) is int):
            raise UnsafeMetadata(f"item {n} has a malformed storage record")
        size = required.get(path)
        if length and (size is None or not 0 <= offset <= offset + length <= size):
            raise UnsafeMetadata(
                f"item {n} lies at {path}[{offset}:{offset + length}], outside the files the commit names"
            )

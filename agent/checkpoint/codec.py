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
hyperparameters, any object in the state) are a different matter: DCP's load planners
read them with ``torch.load(..., weights_only=False)``, a full unpickling, in torch 2.13
as before. Whoever can write a checkpoint's part bytes can therefore run code in a rank
that restores it; kelastic lets only the job's authenticated agents and workers write
them (docs/security.md).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["UnsafeMetadata", "check_commit", "dumps", "loads"]

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


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
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


def check_commit(blob: bytes, required: dict[str, int]) -> None:
    """What the checkpoint service checks of a commit before it takes it: ``blob`` is a DCP
    metadata (:func:`loads`), every item of which lies in a file of ``required`` (the
    commit's manifest) within its size. UnsafeMetadata saying what is wrong otherwise."""
    from kelastic.agent.checkpoint.storage import MemoryItem

    metadata = loads(blob)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeMetadata("checkpoint metadata has no storage records")
    for index, where in storage.items():
        if not isinstance(where, MemoryItem):
            raise UnsafeMetadata(f"item {index} is stored as a {type(where).__name__}, not a MemoryItem")
        if not (
            isinstance(where.relative_path, str) and type(where.offset) is int and type(where.length) is int
        ):
            raise UnsafeMetadata(f"item {index} has a malformed storage record")
        size = required.get(where.relative_path)
        if where.length and (size is None or not 0 <= where.offset <= where.offset + where.length <= size):
            raise UnsafeMetadata(
                f"item {index} lies at {where.relative_path}[{where.offset}:{where.offset + where.length}], "
                "outside the files the commit names"
            )

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

__all__ = ["UnsafeMetadata", "dumps", "loads"]

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

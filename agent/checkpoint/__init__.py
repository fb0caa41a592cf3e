"""Checkpoints at memory speed, kept by the kelastic agent (public name ``kelastic.checkpoint``).

Training scripts use :class:`MemoryWriter` and :class:`MemoryReader` as
torch.distributed.checkpoint storage (``dcp.save(state, storage_writer=MemoryWriter())``,
``dcp.load(state, storage_reader=MemoryReader())``; see :mod:`.storage` for the contract), or
:class:`OverlappingSaver`, whose saves copy while the next step computes (:mod:`.overlap`), and
:func:`restore`, which rolls a replicated state forward from a survivor's live memory when
it can and restores the newest checkpoint otherwise (:mod:`.rollforward`).
The agent side is :class:`CheckpointService` (:mod:`.service`) over a
:class:`CheckpointKeeper` (:mod:`.keeper`); the decisions are pure functions in
:mod:`.plan`; :mod:`.persist` writes the durable copy in DCP's own layout.

Names are imported on first use: the agent imports the service without the storage classes'
torch.distributed.checkpoint.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointService",
    "CheckpointSettings",
    "CheckpointTooLarge",
    "MemoryReader",
    "MemoryWriter",
    "NotInKelasticWorker",
    "OverlappingSaver",
    "Restored",
    "restore",
]

_HOME = {
    "CheckpointError": "errors",
    "CheckpointNotFound": "errors",
    "CheckpointTooLarge": "errors",
    "NotInKelasticWorker": "errors",
    "CheckpointService": "service",
    "CheckpointSettings": "settings",
    "MemoryReader": "storage",
    "MemoryWriter": "storage",
    "OverlappingSaver": "overlap",
    "Restored": "rollforward",
    "restore": "rollforward",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

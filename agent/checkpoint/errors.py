"""The errors of ``kelastic.checkpoint``: each message says what failed, where, and what to do."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointTooLarge",
    "NotInKelasticWorker",
    "SecretMismatch",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the previous complete checkpoint stands."""


class NotInKelasticWorker(CheckpointError):
    """``MemoryWriter``/``MemoryReader`` used outside a worker that ``kelastic-agent`` started."""


class CheckpointTooLarge(CheckpointError):
    """A save needs more memory than the node's checkpoint memory limit allows."""


class CheckpointNotFound(CheckpointError):
    """No complete checkpoint in the nodes' memory, their peers' replicas or the durable directory."""


class SecretMismatch(CheckpointError):
    """A checkpoint service and this process do not hold the same job secret (one of the two
    was given another ``--job-secret-file``)."""

"""What the agent's checkpoint service is configured with, and how the memory limit is derived.

One type, :class:`CheckpointSettings`, goes from the command line (``--checkpoint-*``) to the
keeper: the command line fills in what the flags say, :meth:`CheckpointSettings.for_node`
adds what only the node knows (its own folder, its name, the ``auto`` limit).

Pure parsing and arithmetic; the only I/O is :func:`container_memory_limit`, which reads the
cgroup the agent runs in.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kelastic.agent import contract

__all__ = [
    "AUTO_FRACTION",
    "DEFAULT_DIR",
    "CheckpointSettings",
    "ServiceLimits",
    "auto_limit",
    "container_memory_limit",
    "format_bytes",
    "parse_quantity",
]

#: Where an agent keeps its checkpoint memory unless ``--checkpoint-dir`` says otherwise:
#: a tmpfs (``/dev/shm`` is one in every container; the operator gives it a ``sizeLimit``).
DEFAULT_DIR = "/dev/shm/kelastic-checkpoints"

#: ``--checkpoint-memory auto``: this share of the container's memory limit. tmpfs pages
#: count against the container's memory, beside the training processes themselves, so the
#: checkpoint may take well under half of it.
AUTO_FRACTION = 0.4
#: Without a container limit: this share of the machine's memory (or less, when the tmpfs
#: has less room).
AUTO_FRACTION_UNLIMITED = 0.25

_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def parse_quantity(text: str) -> int:
    """Bytes of a Kubernetes memory quantity (``512Mi``, ``4Gi``, ``2G``, ``1073741824``).

    ValueError, naming the text, for anything else (negative, a fraction of a byte, an
    unknown suffix).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kMGT]i?)?\s*", text)
    if m is None:
        raise ValueError(f"not a memory quantity: {text!r} (use bytes or a suffix: 512Mi, 4Gi, 2G)")
    value = float(m.group(1)) * _SUFFIXES[m.group(2) or ""]
    return int(value)


def format_bytes(n: float) -> str:
    """``3.0 GiB``, ``512 MiB``, ``12 KiB``, ``100 B``: for messages."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def container_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None where there is none or it cannot be read."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        # cgroup v1 reports "no limit" as a huge page-aligned number
        return value if value < 2**60 else None
    return None


def auto_limit(container_limit: int | None, machine_memory: int, tmpfs_free: int | None) -> tuple[int, str]:
    """The ``auto`` limit and the sentence that explains it (pure).

    With a container limit: :data:`AUTO_FRACTION` of it. Without: the smaller of
    :data:`AUTO_FRACTION_UNLIMITED` of the machine's memory and the tmpfs's free room.
    """
    if container_limit is not None:
        limit = int(container_limit * AUTO_FRACTION)
        return (
            limit,
            f"{AUTO_FRACTION:.0%} of the container's memory limit of {format_bytes(container_limit)}",
        )
    limit = int(machine_memory * AUTO_FRACTION_UNLIMITED)
    why = f"{AUTO_FRACTION_UNLIMITED:.0%} of the machine's {format_bytes(machine_memory)}"
    if tmpfs_free is not None and tmpfs_free < limit:
        return tmpfs_free, f"the free room of its tmpfs ({why} would not fit)"
    return limit, why + " (no container memory limit)"


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class CheckpointSettings:
    """One node's checkpoint service, from the ``--checkpoint-*`` flags to the keeper.

    ``root`` is this node's own folder (on a tmpfs); ``limit`` the bytes it may hold there
    (its own parts, its replicas of peers' parts and files kept for reuse, together);
    ``replicas`` how many ring successors receive a copy of each of this node's parts;
    ``persist_dir`` (optional) the durable directory, written every ``persist_every``-th
    checkpoint and/or when ``persist_interval`` seconds passed since the last durable copy
    (0 turns either rule off; with a directory and both 0, every checkpoint is persisted).
    ``limit_reason`` says where the limit came from, for the start-up line.

    As the command line builds it, ``root`` is ``--checkpoint-dir`` (the folder of every
    node's), ``node`` is empty and ``limit`` None stands for ``--checkpoint-memory auto``;
    :meth:`for_node` gives the node's own settings, which the keeper and the service take.
    ValueError, naming the flag, for values no flag may have.
    """

    root: Path
    limit: int | None
    node: str
    replicas: int = 1
    #: A directory or an fsspec URL (``s3://…``); see :mod:`kelastic.agent.checkpoint.durable`.
    persist_dir: str | os.PathLike[str] | None = None
    persist_every: int = 0
    persist_interval: float = 0.0
    limit_reason: str = f"set by {contract.FLAG_CHECKPOINT_MEMORY}"
    #: Durable copies kept in ``persist_dir`` (older ones are removed after a new one lands).
    persist_keep: int = 2

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"{contract.FLAG_CHECKPOINT_REPLICAS} must be 0 or more, got {self.replicas}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"the checkpoint memory limit must be positive, not {self.limit}")
        if self.persist_every < 0:
            raise ValueError(
                f"{contract.FLAG_CHECKPOINT_PERSIST_EVERY} must be 0 or more, got {self.persist_every}"
            )
        if self.persist_interval < 0:
            raise ValueError(
                f"{contract.FLAG_CHECKPOINT_PERSIST_INTERVAL} must be 0 or more seconds, got {self.persist_interval}"
            )

    def node_folder(self, run_id: str, node: str) -> Path:
        """Where node ``node`` of run ``run_id`` keeps its memory: ``<root>/<run id>/<node>``
        (pure; names made safe for a path)."""
        return Path(self.root) / _safe(run_id) / _safe(node)

    def for_node(self, root: Path, node: str, limit: int, limit_reason: str) -> CheckpointSettings:
        """These settings as node ``node`` runs them: in its own folder ``root``
        (:meth:`node_folder`), with ``limit`` bytes (``auto`` derived: :func:`auto_limit`)."""
        return dataclasses.replace(self, root=root, node=node, limit=limit, limit_reason=limit_reason)

    def persist_due(self, checkpoint_id: int, since_last: float | None) -> bool:
        """Whether checkpoint ``checkpoint_id`` goes to the durable directory (pure).

        ``since_last``: seconds since the last durable copy began, None before the first.
        """
        if self.persist_dir is None:
            return False
        if self.persist_every <= 0 and self.persist_interval <= 0:
            return True
        if self.persist_every > 0 and checkpoint_id % self.persist_every == 0:
            return True
        return self.persist_interval > 0 and (since_last is None or since_last >= self.persist_interval)

    def summary(self) -> str:
        """A short line for the agent's start-up log (:meth:`describe` has the details)."""
        durable = ", a durable copy" if self.persist_dir is not None else ""
        limit = "auto" if self.limit is None else format_bytes(self.limit)
        return f"checkpoint memory: up to {limit}, {self.replicas} replica(s){durable}"

    def describe(self) -> str:
        """Every detail, for the agent's debug log."""
        durable = "off"
        if self.persist_dir is not None:
            rules = []
            if self.persist_every > 0:
                rules.append(f"every {self.persist_every} checkpoints")
            if self.persist_interval > 0:
                rules.append(f"every {self.persist_interval:g} s")
            durable = f"{self.persist_dir} ({' or '.join(rules) or 'every checkpoint'})"
        limit = "auto" if self.limit is None else format_bytes(self.limit)
        return (
            f"checkpoint memory: up to {limit} in {self.root} ({self.limit_reason}); "
            f"{self.replicas} replica(s) on the ring's next node(s); durable copy: {durable}"
        )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


@dataclass(frozen=True)
class ServiceLimits:
    """What one checkpoint service takes at once and how long it waits (docs/security.md).

    ``connections`` authenticated connections are served at once; a new one past that
    replaces the one idle longest, or waits up to ``io_timeout`` for a free place and is
    then closed. ``handshakes`` connections may be proving the key at once (a new one
    past that replaces the oldest), each for at most ``handshake_timeout`` seconds. Inside a
    message every read and write must progress within ``io_timeout``; a connection with no
    request for ``idle_timeout`` is closed (a client reconnects on its next request).
    ``max_header`` caps a message's header, ``max_metadata`` a commit's metadata.
    """

    connections: int = 256
    handshakes: int = 32
    handshake_timeout: float = 10.0
    io_timeout: float = 30.0
    idle_timeout: float = 300.0
    max_header: int = 4 * 2**20
    max_metadata: int = 256 * 2**20

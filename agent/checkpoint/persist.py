"""The durable copy: a memory checkpoint written to a directory in DCP's own layout.

:func:`write_durable` turns checkpoint N (raw parts in the nodes' memory, metadata whose
storage data are :class:`~kelastic.agent.checkpoint.storage.MemoryItem`) into
``<dir>/checkpoint-N``: one ``.distcp`` file per part with every tensor written by
``torch.save`` and every object as its bytes, and a ``.metadata`` whose storage data are
torch.distributed.checkpoint's own, so that ``dcp.load(state,
storage_reader=FileSystemReader(".../checkpoint-N"))`` reads it without kelastic.

Complete or nothing (:class:`~kelastic.agent.checkpoint.durable.DurableStore`): a local copy
is written under a temporary name, synced, and renamed into place; at a URL ``.metadata`` is
written last. Only then are copies older than the newest ``keep`` removed.

The metadata is read with :func:`kelastic.agent.checkpoint.codec.loads` (no code runs from
it); parts the node does not hold come from its peers over authenticated connections.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

# DCP's own per-item storage record: the file layout FileSystemReader reads.
from torch.distributed.checkpoint.filesystem import _StorageInfo

from kelastic.agent.checkpoint import codec
from kelastic.agent.checkpoint.client import ServiceClient
from kelastic.agent.checkpoint.durable import METADATA, DurableStore
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.keeper import CheckpointKeeper

__all__ = ["write_durable"]


class _PartReader:
    """Byte ranges of checkpoint ``cid``'s parts: from this node's memory when it holds the
    part, else from the ring's other nodes (one connection each, closed by :meth:`close`)."""

    def __init__(
        self, keeper: CheckpointKeeper, cid: int, ring: list[str], connect: Callable[[str], ServiceClient]
    ) -> None:
        self.keeper, self.cid, self.ring, self.connect = keeper, cid, ring, connect
        self.clients: dict[str, ServiceClient] = {}

    def read(self, name: str, offset: int, length: int) -> bytes:
        try:
            path = self.keeper.readable(self.cid, name)
        except CheckpointError:
            path = None
        if path is not None:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)
        buf = bytearray(length)
        last: Exception | None = None
        for endpoint in self.ring:
            if endpoint == self.keeper.endpoint:
                continue
            client = self.clients.get(endpoint)
            if client is None:
                client = self.clients[endpoint] = self.connect(endpoint)
            try:
                client.call(
                    {"op": "get", "id": self.cid, "name": name, "offset": offset, "length": length},
                    into=memoryview(buf),
                )
                return bytes(buf)
            except CheckpointError as e:
                last = e
        raise CheckpointError(f"no node holds {name} of checkpoint {self.cid}: {last}")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def write_durable(
    keeper: CheckpointKeeper,
    cid: int,
    ring: list[str],
    store: DurableStore,
    keep: int,
    connect: Callable[[str], ServiceClient],
) -> str:
    """Write checkpoint ``cid`` to ``<store>/checkpoint-<cid>``; return where it is.

    Parts this node does not hold are read from the ring's other nodes (``connect(endpoint)``
    opens an authenticated connection to one). Raises
    CheckpointError (or OSError) when a part cannot be read or the copy written; the
    memory checkpoint is not affected either way.
    """
    from kelastic.agent.checkpoint.storage import MemoryItem, _dtype

    metadata = codec.loads(keeper.metadata(cid))
    parts = _PartReader(keeper, cid, ring, connect)
    try:
        with store.writing(cid) as out_dir:
            by_file: dict[str, list[tuple[Any, MemoryItem]]] = {}
            for index, where in metadata.storage_data.items():
                by_file.setdefault(where.relative_path, []).append((index, where))
            storage: dict[Any, _StorageInfo] = {}
            for name, entries in sorted(by_file.items()):
                out_name = f"{name.removesuffix('.mem')}.distcp"
                with out_dir.open(out_name) as out:
                    position = 0
                    for index, where in sorted(entries, key=lambda e: e[1].offset):
                        data = parts.read(name, where.offset, where.length) if where.length else b""
                        if where.dtype is None:
                            blob = data
                        else:
                            assert where.size is not None
                            dtype = _dtype(where.dtype)
                            if data:
                                tensor = torch.frombuffer(bytearray(data), dtype=dtype).view(where.size)
                            else:
                                tensor = torch.empty(where.size, dtype=dtype)
                            buf = io.BytesIO()
                            torch.save(tensor, buf)
                            blob = buf.getvalue()
                        out.write(blob)
                        storage[index] = _StorageInfo(out_name, position, len(blob))
                        position += len(blob)
            metadata.storage_data = storage
            with out_dir.open(METADATA) as f:  # last: its presence marks the copy complete
                f.write(codec.dumps(metadata))
    finally:
        parts.close()
    store.prune(keep)
    return store.path_of(cid)

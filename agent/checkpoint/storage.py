"""``MemoryWriter`` and ``MemoryReader``: torch.distributed.checkpoint storage in agent memory.

Inside a worker that ``kelastic-agent`` started::

    import torch.distributed.checkpoint as dcp
    from kelastic.checkpoint import MemoryReader, MemoryWriter

    reader = MemoryReader()
    if reader.exists():                       # every rank calls it: it is a collective
        dcp.load(state, storage_reader=reader)
    ...
    dcp.save(state, storage_writer=MemoryWriter(step=step))   # or dcp.async_save(...)

What a caller may rely on:

* **Where the bytes go.** Each rank copies its part (what DCP's planner gives it: replicated
  tensors once, shards by owner) into a file its node's agent allocated on the node's tmpfs,
  as raw bytes: a save costs about a memory copy. The files belong to the agent, so a
  worker that crashes or is restarted loses nothing.
* **Complete or nothing.** A checkpoint counts once every rank's part is written and the
  coordinating rank committed its metadata to every node of the group; a save that breaks
  off leaves the previous checkpoint standing, and no reader ever sees a torn one.
* **Replicated.** After the commit each node's agent copies its part to the next node(s) of
  the ring (``--checkpoint-replicas``, default 1); the next save waits until that copy is
  done, so losing any one node leaves a complete checkpoint among the survivors.
* **Restore at any world size.** ``MemoryReader`` gathers what every node holds (its own
  parts, its replicas, the durable directory), picks the newest complete checkpoint
  (:func:`~kelastic.agent.checkpoint.plan.choose_restore`) and reads each part from wherever
  it is (this node's memory, a peer's, or the durable directory); DCP's planners reshard.
  The agent logs and publishes which checkpoint it restored and from where, and the bytes
  read from its memory and fetched from other nodes (``MemoryReader.local_bytes``,
  ``MemoryReader.fetched_bytes``). A hot standby that took a lost member's place holds
  every member's part already, and fetches nothing.
* **How a restore reads.** The parts on this node's tmpfs are copied once into the state's
  tensors: a whole stored tensor whose target is that tensor as stored (contiguous, on the
  CPU, of its dtype and shape) is read from the file straight into the target, the rest
  through a private mapping of the file; a file shorter than its metadata says is refused
  (CheckpointError naming it), never read past its end. The parts this node lacks are
  fetched from their holders on threads of the reader's own (a lane per peer, its
  connections closed when the restore is done) while the local parts are read: a part that
  several nodes hold (its owner, its replica) comes from all of them at once, item by item,
  and a holder that fails an item hands it to the next. A whole stored tensor whose target
  is that tensor as stored is received straight into the target; others go through a
  buffer of their own. The planner (``resolve_tensor``, ``commit_tensor``, ``load_bytes``)
  is called only on the thread that called ``dcp.load``, and a load that fails raises only
  once every fetch has stopped writing into the state.
* **Too large.** A save that does not fit in a node's checkpoint memory writes nothing and
  leaves the previous checkpoint standing; it prints one error naming the sizes and training
  goes on. ``MemoryWriter(strict=True)`` raises :class:`CheckpointTooLarge` instead.
* **Authenticated.** Every connection to an agent proves the job's secret (the file
  ``$KELASTIC_JOB_SECRET_FILE`` names; the agent sets it) and checks that the agent holds it
  too; metadata is read without running code (:mod:`~kelastic.agent.checkpoint.codec`).
* Outside a kelastic worker both raise :class:`NotInKelasticWorker`.

The module imports only the standard library and torch.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from kelastic.agent import progress
from kelastic.agent.checkpoint import codec
from kelastic.agent.checkpoint.client import ServiceClient
from kelastic.agent.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointTooLarge,
    NotInKelasticWorker,
)
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.plan import Inventory, RestoreChoice, Source, choose_restore, next_id
from kelastic.agent.contract import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_ENDPOINT,
    ENV_INSECURE_NO_SECRET,
    ENV_JOB_SECRET_FILE,
)
from kelastic.agent.secret import SecretError, secret_from_env

__all__ = ["MemoryItem", "MemoryReader", "MemoryWriter"]

#: Parts are laid out on this alignment (a cache line; every dtype's element size divides it).
_ALIGN = 64


@dataclass(frozen=True)
class MemoryItem:
    """Where one write item's bytes are: DCP's per-item storage data for memory checkpoints.

    ``dtype``/``size`` describe a tensor's raw bytes (None for a serialized object).
    """

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None
    size: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _LocalInfo:
    endpoint: str
    node: str
    newest: int
    refused: str | None
    #: refused only because the node was still busy with earlier work (see ``skip_if_busy``)
    busy: bool = False


@dataclass(frozen=True)
class _SaveInfo:
    id: int
    ring: tuple[str, ...]
    file: str
    refused: str | None
    coordinator_endpoint: str
    #: every refusal was a busy node's: the save is skipped without a word (``skip_if_busy``)
    busy: bool = False


def _agent() -> tuple[str, str]:
    endpoint = os.environ.get(ENV_CHECKPOINT_ENDPOINT)
    folder = os.environ.get(ENV_CHECKPOINT_DIR)
    if not endpoint or not folder:
        raise NotInKelasticWorker(
            "kelastic.checkpoint keeps checkpoints in the memory of the kelastic agent, and this process "
            f"was not started by one (${ENV_CHECKPOINT_ENDPOINT} is not set). Run the script with "
            "kelastic-agent (or in an ElasticJob); without kelastic use torch.distributed.checkpoint's "
            "FileSystemWriter/FileSystemReader."
        )
    return endpoint, folder


_clients = threading.local()
_key: tuple[tuple[int, str | None, str | None], bytes] | None = None


def _job_key() -> bytes:
    """The job's key, read once per process (and per file the agent named) from that file."""
    global _key
    source = (os.getpid(), os.environ.get(ENV_JOB_SECRET_FILE), os.environ.get(ENV_INSECURE_NO_SECRET))
    if _key is None or _key[0] != source:
        try:
            _key = (source, secret_from_env().key)
        except SecretError as e:
            raise CheckpointError(
                f"kelastic.checkpoint cannot prove the job's secret to its agent: {e}"
            ) from None
    return _key[1]


def _client(endpoint: str) -> ServiceClient:
    """One connection per thread and endpoint (``dcp.async_save`` writes from a thread of its own)."""
    pool: dict[str, ServiceClient] | None = getattr(_clients, "pool", None)
    if pool is None or getattr(_clients, "pid", None) != os.getpid():
        pool = _clients.pool = {}
        _clients.pid = os.getpid()
    if endpoint not in pool:
        pool[endpoint] = ServiceClient(endpoint, _job_key())
    return pool[endpoint]


_pool: tuple[int, ThreadPoolExecutor] | None = None


def _commit_pool() -> ThreadPoolExecutor:
    """The coordinator's threads that send a commit to every node at once; kept for the
    process's life (per pid: a forked worker makes its own), so are their connections."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=16, thread_name_prefix="kelastic-commit"))
    return _pool[1]


def _rank(kwargs: dict[str, Any]) -> int:
    rank = kwargs.get("rank")
    if rank is not None:
        return int(rank)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a memory checkpoint")
    return value


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0  # a serialized object: small, sized when written
    numel = 1
    for d in item.tensor_data.size:
        numel *= d
    return numel * item.tensor_data.properties.dtype.itemsize


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _CheckedPlanner:
    """A load planner whose ``load_bytes`` hands on only items :func:`codec.check_item`
    read without running code (the planner's own ``torch.load`` is a full unpickling);
    everything else goes to the planner itself."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        blob = value.getvalue()
        try:
            codec.check_item(blob, read_item.dest_index.fqn)
        except codec.UnsafeItem as e:
            raise CheckpointError(str(e)) from None
        self._planner.load_bytes(read_item, io.BytesIO(blob))


def _checked(planner: LoadPlanner) -> Any:
    return planner if isinstance(planner, _CheckedPlanner) else _CheckedPlanner(planner)


class _Mappings:
    """The shared mappings of this process's latest checkpoint files, kept between saves.

    The agent hands a rank the file of a dropped checkpoint again (its pages are allocated
    already); a mapping kept from the save that wrote that file has its page tables filled
    as well, so the next copy into it runs at the speed of a copy into memory the process
    owns, without a page fault per page and without unmapping. A mapping is dropped as soon
    as the agent deleted its file (to free the memory for something else), before the next
    file is asked for, so it never holds memory the agent counts as free.
    """

    #: A rank cycles through the files of three checkpoints (newest, the one before, in progress).
    KEEP = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (st_dev, st_ino) -> (fd, mapping, size), least recently used first
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap, int]] = {}

    def prune(self) -> None:
        """Drop the mappings of files the agent deleted."""
        with self._lock:
            for key, (fd, _mm, _size) in list(self._maps.items()):
                if os.fstat(fd).st_nlink == 0:
                    self._drop(key)

    def get(self, path: str, size: int) -> mmap.mmap:
        """A shared writable mapping of the first ``size`` bytes of ``path``."""
        with self._lock:
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
            kept = self._maps.pop(key, None)
            if kept is not None:
                if kept[2] == size:
                    self._maps[key] = kept
                    return kept[1]
                self._close(kept)
            fd = os.open(path, os.O_RDWR)
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mm = mmap.mmap(fd, size, flags=flags)
            except BaseException:
                os.close(fd)
                raise
            self._maps[key] = (fd, mm, size)
            while len(self._maps) > self.KEEP:
                self._drop(next(iter(self._maps)))
            return mm

    def _drop(self, key: tuple[int, int]) -> None:
        self._close(self._maps.pop(key))

    @staticmethod
    def _close(kept: tuple[int, mmap.mmap, int]) -> None:
        fd, mm, _ = kept
        try:
            mm.close()
        finally:
            os.close(fd)


_mappings = _Mappings()


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (CheckpointError when the file ends first)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CheckpointError(
                f"{path.name} of this node ended at byte {offset + got}: the part is damaged"
            )
        got += n


@dataclass(frozen=True)
class _Fetch:
    """One item to fetch from a peer: from ``holders`` in turn, into ``into`` (the target's
    own memory, or ``buffer``'s when it cannot be received in place)."""

    name: str
    holders: tuple[str, ...]
    req: ReadItem
    where: MemoryItem
    into: memoryview
    target: torch.Tensor | None
    buffer: bytearray | None


#: Threads that fetch parts from peers during a restore (a lane per first holder, at most
#: this many at once).
_FETCH_LANES = 8
_fetchers: tuple[int, ThreadPoolExecutor] | None = None


def _fetch_pool() -> ThreadPoolExecutor:
    """The threads that fetch a restore's missing parts, kept for the process's life (per pid)."""
    global _fetchers
    if _fetchers is None or _fetchers[0] != os.getpid():
        _fetchers = (
            os.getpid(),
            ThreadPoolExecutor(max_workers=_FETCH_LANES, thread_name_prefix="kelastic-fetch"),
        )
    return _fetchers[1]


def _start_fetches(cid: int, jobs: Sequence[_Fetch]) -> list[Any]:
    """Start ``jobs``, one lane (a thread, its connections) per first holder; each lane's
    future gives its jobs with the error of each (None when it was received whole)."""
    lanes: dict[str, list[_Fetch]] = {}
    for job in jobs:
        lanes.setdefault(job.holders[0] if job.holders else "", []).append(job)
    return [_fetch_pool().submit(_fetch_lane, cid, lane) for lane in lanes.values()]


def _fetch_lane(cid: int, jobs: Sequence[_Fetch]) -> list[tuple[_Fetch, CheckpointError | None]]:
    """Fetch ``jobs`` in turn on connections of the lane's own, closed once it is done (a
    restore is once per worker: no idle connection is left on a peer's service)."""
    clients: dict[str, ServiceClient] = {}
    out: list[tuple[_Fetch, CheckpointError | None]] = []
    try:
        for job in jobs:
            try:
                _fetch_into(cid, job, clients)
                out.append((job, None))
            except CheckpointError as e:
                out.append((job, e))
    finally:
        for client in clients.values():
            client.close()
    return out


def _fetch_into(cid: int, job: _Fetch, clients: dict[str, ServiceClient]) -> None:
    last: Exception | None = None
    where = job.where
    for endpoint in job.holders:
        try:
            client = clients.get(endpoint)
            if client is None:
                client = clients[endpoint] = ServiceClient(endpoint, _job_key())
            client.call(
                {"op": "get", "id": cid, "name": job.name, "offset": where.offset, "length": where.length},
                into=job.into,
            )
            return
        except CheckpointError as e:
            last = e
    raise CheckpointError(
        f"no node could give {job.name} of checkpoint {cid} (held by {list(job.holders)}): {last}"
    )


class MemoryWriter(StorageWriter):
    """torch.distributed.checkpoint storage that writes into the kelastic agent's memory.

    ``step`` (optional) is recorded with the checkpoint and reported back on restore;
    ``strict`` makes a save that does not fit raise :class:`CheckpointTooLarge` instead of
    being skipped with an error message; ``timeout`` bounds the wait for the previous
    checkpoint's replica before a save (seconds). ``skip_if_busy``: instead of waiting, the
    save is skipped (every rank's, as one collective decision, before anything is copied;
    :attr:`skipped` says so afterwards) when a node is still sending the previous checkpoint's
    replica or writing an older one's durable copy, so saves come as often as replicas keep up.
    See the module docstring for the contract.
    """

    def __init__(
        self,
        *,
        step: int | None = None,
        strict: bool = False,
        timeout: float = 300.0,
        skip_if_busy: bool = False,
    ) -> None:
        super().__init__()
        self._endpoint, self._dir = _agent()
        self.step = step
        self.strict = strict
        self.timeout = timeout
        self.skip_if_busy = skip_if_busy
        self._rank = 0
        self._is_coordinator = True
        self._save: _SaveInfo | None = None
        self._label: str | None = None
        self._began: float | None = None  # monotonic start of the save under way

    # StorageWriter ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._label = None if checkpoint_id is None else str(checkpoint_id)
        self._save = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP from a checkpoint_id alone

    @property
    def checkpoint_id(self) -> str | None:
        return self._label

    @property
    def skipped(self) -> bool:
        """Whether the last save was skipped because a node was busy (``skip_if_busy``)."""
        return self._save is not None and self._save.busy and self._save.refused is not None

    def storage_meta(self) -> StorageMeta | None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        self._rank = _rank(kwargs)
        self._began = time.monotonic()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        nbytes = sum(_align(_item_bytes(i)) for i in plan.items)
        reply, _ = _client(self._endpoint).call(
            {
                "op": "begin", "rank": self._rank, "bytes": nbytes, "pid": os.getpid(),
                "timeout": 0 if self.skip_if_busy else self.timeout,
            },
            timeout=self.timeout + 30,
        )  # fmt: skip
        refused = reply.get("refused")
        info = _LocalInfo(
            self._endpoint,
            str(reply["node"]),
            int(reply["newest"]),
            refused and f"rank {self._rank}: {refused}",
            bool(refused) and reply.get("busy") is True,
        )
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        infos: list[_LocalInfo] = [p.storage_data for p in plans]
        ring = tuple(dict.fromkeys(i.endpoint for i in infos))
        cid = next_id([i.newest for i in infos])
        # A node out of memory is news; one still busy (the first refusal when all are) is not.
        refusals = sorted((i for i in infos if i.refused), key=lambda i: i.busy)
        refused = refusals[0].refused if refusals else None
        busy = bool(refusals) and refusals[0].busy
        return [
            dataclasses.replace(
                p, storage_data=_SaveInfo(cid, ring, f"__{r}.mem", refused, self._endpoint, busy)
            )
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info: _SaveInfo = plan.storage_data
        self._save = info
        client = _client(self._endpoint)
        try:
            results = [] if info.refused else self._write(client, info, plan.items, planner)
        finally:
            client.call({"op": "done", "rank": self._rank})
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(
        self, client: ServiceClient, info: _SaveInfo, items: Sequence[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        layout: list[tuple[WriteItem, Any, int, int]] = []
        offset = 0
        for item in items:
            resolved = planner.resolve_data(item)
            data: torch.Tensor | memoryview
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(resolved, io.BytesIO)
                data = resolved.getbuffer()
                n = len(data)
            else:
                assert isinstance(resolved, torch.Tensor)
                data = resolved.detach()
                n = data.numel() * data.element_size()
            layout.append((item, data, offset, n))
            offset = _align(offset + n)
        if offset == 0:
            return [self._result(item, info.file, 0, 0, data) for item, data, _, _ in layout]
        _mappings.prune()
        reply, _ = client.call(
            {"op": "open", "id": info.id, "name": info.file, "size": offset, "rank": self._rank}
        )
        mm = _mappings.get(reply["path"], offset)
        for _item, data, off, n in layout:
            if n == 0:
                continue
            if isinstance(data, torch.Tensor):
                dst = torch.frombuffer(mm, dtype=data.dtype, count=data.numel(), offset=off).view(data.shape)
                dst.copy_(data)
                del dst
            else:
                mm[off : off + n] = data
        return [self._result(item, info.file, off, n, data) for item, data, off, n in layout]

    @staticmethod
    def _result(item: WriteItem, file: str, offset: int, n: int, data: Any) -> WriteResult:
        if isinstance(data, torch.Tensor):
            where = MemoryItem(file, offset, n, str(data.dtype), tuple(data.shape))
        else:
            where = MemoryItem(file, offset, n)
        return WriteResult(index=item.index, size_in_bytes=n, storage_data=where)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            # The coordinator's finish ends the save for every rank: the job's stall. A save
            # made on another thread (overlapping the step) stalls nobody.
            if self._began is not None and threading.current_thread() is threading.main_thread():
                progress.stalled(time.monotonic() - self._began)
            self._began = None

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        info = self._save
        assert info is not None, "finish() before write_data()"
        if info.refused and info.busy and self.skip_if_busy:
            return  # skipped by request: the caller counts it (OverlappingSaver.skipped)
        if info.refused:
            message = f"kelastic.checkpoint: checkpoint {info.id} not saved: {info.refused}"
            if self.strict:
                raise CheckpointTooLarge(message)
            print(
                f"{message}; the previous checkpoint stands and training goes on", file=sys.stderr, flush=True
            )
            return
        storage: dict[MetadataIndex, MemoryItem] = {}
        required: dict[str, int] = {}
        for per_rank in results:
            for wr in per_rank:
                where: MemoryItem = wr.storage_data
                storage[wr.index] = where
                if where.length:
                    end = where.offset + where.length
                    required[where.relative_path] = max(required.get(where.relative_path, 0), end)
        metadata.storage_data = storage
        blob = codec.dumps(metadata)
        # No ring: each node replicates on the ring of the current rendezvous round, which its
        # agent knows; a commit never names one.
        header = {"op": "commit", "id": info.id, "required": required, "step": self.step}

        def commit(endpoint: str) -> str | None:
            try:  # the pool's threads keep their connections from one save to the next
                _client(endpoint).call(header, blob)
            except CheckpointError as e:
                return str(e)
            return None

        errors = dict(zip(info.ring, _commit_pool().map(commit, info.ring), strict=True))
        if errors.get(self._endpoint):
            raise CheckpointError(f"checkpoint {info.id} was not committed: {errors[self._endpoint]}")
        for endpoint, error in errors.items():
            if error:
                warnings.warn(
                    f"kelastic.checkpoint: node {endpoint} did not take checkpoint {info.id}'s commit: {error}",
                    stacklevel=2,
                )


def choose_from(inventories: Sequence[Any], *, durable: bool = True) -> RestoreChoice | None:
    """The checkpoint a group restores from its nodes' inventories as gathered (JSON, one per
    rank, a node's repeated by each of its ranks); ``durable=False`` leaves the durable
    directory out."""
    seen: dict[str, Inventory] = {}
    for g in inventories:
        inv = Inventory.from_json(g)
        seen[inv.endpoint] = inv if durable else dataclasses.replace(inv, durable=())
    return choose_restore(list(seen.values()))


class MemoryReader(StorageReader):
    """torch.distributed.checkpoint storage that restores the newest complete checkpoint
    the group can reach: from the agents' memory, their replicas, or the durable directory.

    Choosing is a collective over ``process_group`` (default: the default group): every rank
    calls :meth:`exists` (or ``dcp.load``) together. ``durable=False`` leaves the durable
    directory out. See the module docstring for the contract.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, durable: bool = True) -> None:
        super().__init__()
        self._endpoint, self._dir = _agent()
        self._group = process_group
        self._durable = durable
        self._chosen = False
        self._choice: RestoreChoice | None = None
        self._began: float | None = None
        self._storage: dict[MetadataIndex, Any] = {}
        self._fs: Any = None
        #: Bytes of the checkpoint this rank read from its own node's memory, and fetched from
        #: other nodes (their memory or replicas), so far.
        self.local_bytes = 0
        self.fetched_bytes = 0

    # choosing ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the group can restore a complete checkpoint (a collective: every rank calls it)."""
        return self.choice is not None

    @property
    def choice(self) -> RestoreChoice | None:
        """The checkpoint a load restores (chosen on first use, the same on every rank)."""
        if not self._chosen:
            self._began = time.monotonic()
            # After the parts its agent is pulling for this restore (checkpoint.prefetch).
            local, _ = _client(self._endpoint).call({"op": "inventory", "wait": True})
            mine = local["inventory"]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
                gathered: list[Any] = [None] * dist.get_world_size(self._group)
                dist.all_gather_object(gathered, mine, group=self._group)
            else:
                gathered = [mine]
            self._choice = choose_from(gathered, durable=self._durable)
            self._chosen = True
        return self._choice

    # StorageReader ----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise CheckpointError(
                "MemoryReader restores the newest complete checkpoint by itself; it takes no checkpoint_id"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("memory checkpoints have no per-rank metadata")
        choice = self.choice
        if choice is None:
            raise CheckpointNotFound(
                "no complete checkpoint in the nodes' memory, their peers' replicas or the durable directory; "
                "call MemoryReader().exists() first and start from scratch when it is False"
            )
        if choice.source is Source.DURABLE:
            from kelastic.agent.checkpoint.durable import DurableStore

            assert choice.durable_path is not None
            store = DurableStore(choice.durable_path)
            self._fs = store.reader(choice.durable_path)
            try:
                durable: Metadata = store.read_metadata(choice.durable_path)
            except codec.UnsafeMetadata as e:
                raise CheckpointError(
                    f"the durable copy {choice.durable_path} was not restored: {e}"
                ) from None
            if durable.storage_meta is None:
                durable.storage_meta = StorageMeta()
            durable.storage_meta.load_id = getattr(self._fs, "load_id", None)
            return durable
        sources = sorted(choice.metadata_from, key=lambda e: e != self._endpoint)
        last: Exception | None = None
        for endpoint in sources:
            try:
                _, blob = _client(endpoint).call({"op": "metadata", "id": choice.id})
                metadata: Metadata = codec.loads(blob)
                return metadata
            except (CheckpointError, codec.UnsafeMetadata) as e:
                last = e
        raise CheckpointError(f"no node could give checkpoint {choice.id}'s metadata: {last}")

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        choice = self.choice
        assert choice is not None
        if self._fs is not None:
            self._fs.read_data(plan, _checked(planner)).wait()
        else:
            self._read(choice, plan.items, planner)
        seconds = time.monotonic() - (self._began or time.monotonic())
        _client(self._endpoint).call(
            {
                "op": "restored",
                "id": choice.id,
                "source": choice.source.value,
                "seconds": seconds,
                "step": choice.step,
                "pid": os.getpid(),
                "local": self.local_bytes,
                "fetched": self.fetched_bytes,
            }
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, choice: RestoreChoice, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Start the fetches of the parts this node lacks on threads of their own, copy the
        node's own parts meanwhile, then hand the fetched items to the planner (on this
        thread: the planner is never called from another)."""
        per_file: dict[str, list[ReadItem]] = {}
        for req in items:
            per_file.setdefault(self._storage[req.storage_index].relative_path, []).append(req)
        local_dir = Path(self._dir) / CheckpointKeeper.dir_name(choice.id)
        local: list[tuple[Path, list[ReadItem]]] = []
        remote: list[_Fetch] = []
        for name, reqs in per_file.items():
            holders = tuple(choice.holders.get(name, ()))
            path = local_dir / name
            if self._endpoint in holders and path.exists():
                local.append((path, reqs))
            else:
                remote.extend(self._fetch_job(name, holders, req, i, planner) for i, req in enumerate(reqs))
        running = _start_fetches(choice.id, remote)
        try:
            for path, reqs in local:
                self._read_local(path, reqs, planner)
        finally:
            outcomes = [f.result() for f in running]  # every lane done before any error is raised
        errors = [e for lane in outcomes for _, e in lane if e is not None]
        if errors:
            raise errors[0]
        for lane in outcomes:
            for job, _ in lane:
                self.fetched_bytes += job.where.length
                if job.buffer is None:
                    assert job.target is not None
                    planner.commit_tensor(job.req, job.target)
                else:
                    self._apply(job.req, job.buffer, dataclasses.replace(job.where, offset=0), planner)

    def _read_local(self, path: Path, reqs: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Read this node's file ``path``: a whole stored tensor whose target is that tensor as
        stored straight into the target (one copy, by the kernel: no mapping to fault in),
        everything else from a private mapping of the file."""
        rest: list[ReadItem] = []
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            for req in reqs:
                where: MemoryItem = self._storage[req.storage_index]
                if where.offset + where.length > size:
                    raise CheckpointError(
                        f"{path.name} of this node has {size} bytes; {req.storage_index.fqn} is stored at "
                        f"bytes {where.offset}..{where.offset + where.length}: the part is damaged"
                    )
                target = self._in_place_target(req, where, planner)
                if target is None:
                    rest.append(req)
                    continue
                _pread_into(fd, target.reshape(-1).view(torch.uint8).numpy().data, where.offset, path)
                planner.commit_tensor(req, target)
                self.local_bytes += where.length
            if not rest:
                return
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        try:
            for req in rest:
                self._apply(req, mm, self._storage[req.storage_index], planner)
                self.local_bytes += self._storage[req.storage_index].length
        finally:
            mm.close()

    def _fetch_job(
        self, name: str, holders: tuple[str, ...], req: ReadItem, index: int, planner: LoadPlanner
    ) -> _Fetch:
        """How to fetch one item: straight into its target when that is the tensor as stored
        (a contiguous CPU tensor of its dtype and shape), else into a buffer of its own; from
        its holders in turn, starting at a different one for each item of a part (so a part
        several nodes hold comes from all of them at once)."""
        where: MemoryItem = self._storage[req.storage_index]
        k = index % len(holders) if holders else 0
        order = holders[k:] + holders[:k]
        target = self._in_place_target(req, where, planner)
        if target is not None:
            view = target.reshape(-1).view(torch.uint8).numpy().data
            return _Fetch(name, order, req, where, view, target, None)
        buffer = bytearray(where.length)
        return _Fetch(name, order, req, where, memoryview(buffer), None, buffer)

    @staticmethod
    def _in_place_target(req: ReadItem, where: MemoryItem, planner: LoadPlanner) -> torch.Tensor | None:
        if req.type == LoadItemType.BYTE_IO or where.dtype is None or where.size is None or not where.length:
            return None
        if any(req.storage_offsets) or tuple(req.lengths) != tuple(where.size):
            return None
        target = planner.resolve_tensor(req).detach()
        if (
            target.device.type != "cpu"
            or not target.is_contiguous()
            or str(target.dtype) != where.dtype
            or tuple(target.shape) != tuple(where.size)
            or target.numel() * target.element_size() != where.length
        ):
            return None
        return target

    @staticmethod
    def _apply(req: ReadItem, buf: Any, where: MemoryItem, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            blob = bytes(memoryview(buf)[where.offset : where.offset + where.length])
            _checked(planner).load_bytes(req, io.BytesIO(blob))
            return
        assert where.dtype is not None and where.size is not None
        dtype = _dtype(where.dtype)
        numel = where.length // dtype.itemsize if dtype.itemsize else 0
        if numel:
            src = torch.frombuffer(buf, dtype=dtype, count=numel, offset=where.offset).view(where.size)
        else:
            src = torch.empty(where.size, dtype=dtype)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            src = src.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise CheckpointError(
                f"{req.storage_index.fqn}: stored {tuple(src.size())}, expected {tuple(target.size())}"
            )
        target.copy_(src)
        del src
        planner.commit_tensor(req, target)

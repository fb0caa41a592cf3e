"""One node's checkpoint memory: the files, what they belong to, and when they go.

:class:`CheckpointKeeper` is the state behind the agent's checkpoint service. It owns a
folder on a tmpfs (``settings.root``, laid out by :class:`~kelastic.agent.checkpoint.folder.
MemoryFolder`).

Rules it enforces (the contract ``MemoryWriter`` relies on), whoever asks:

* **Complete or nothing.** A checkpoint counts once its metadata arrived (``commit``), which
  the coordinating rank sends only after every rank's part was written. Replicas arrive under
  a temporary name and appear whole.
* **Committed is final.** A committed checkpoint's metadata and parts are never replaced: a
  second commit of it is taken only when it is the same (a retry), a part it holds is never
  written again (``open`` refuses a checkpoint not newer than the newest committed one, a
  replica never replaces a file held).
* **The last complete one and at most one in progress.** Opening a file of a newer
  checkpoint drops every checkpoint older than the newest committed one, and every
  uncommitted one (a save that broke off). After a restore of an older checkpoint than the
  newest committed here (the newer one turned out incomplete), the restored one is kept
  beside it until a checkpoint newer than it is committed; the abandoned newer one goes
  when memory is short, or with the restored one once a newer one is committed. These rules
  alone drop checkpoints: no request names one to drop.
* **A save waits for the previous replica.** ``begin`` returns only when no replication of
  this node's parts is in flight (so a lost node costs at most one checkpoint) and no
  durable copy of an older checkpoint is still being written; with a timeout of 0 it
  refuses at once instead (``Refusal.busy``): the caller skips that save.
* **Bounded memory.** ``begin`` refuses a save that would not fit in ``settings.limit``
  (:func:`~kelastic.agent.checkpoint.plan.memory_needed`), naming the sizes; ``open``,
  incoming replicas (counted while they arrive) and metadata never take the files held past
  the limit. A rank's files are allocated up front (``posix_fallocate``) so a full tmpfs is
  an error, never a SIGBUS in a worker; a replica's file grows as its bytes arrive, so a
  peer that announces one and sends nothing costs nothing.
* **Numbers in range.** A checkpoint number may run at most :data:`MAX_ID_JUMP` past the
  newest this node has seen (:data:`MAX_FIRST_ID` while it has seen none).
* **Only the node's own ranks save here.** Once the agent names the processes it started
  (``keeper.local.set``, :mod:`.ranks`), ``begin`` and ``restored`` must come from one of them or
  a process they started, a reservation goes when its process goes, and ``open`` needs the
  rank's reservation. A commit is superseded only by a newer checkpoint this node's own
  ranks opened, never by a peer's replica.
* **A standby keeps the newest whole set of copies.** A node that holds copies of parts of
  a checkpoint it neither wrote nor was sent the commit of (a hot standby, which the group's
  nodes send their parts to) keeps an older such checkpoint until it holds a copy of every
  one of its parts from a newer one, then drops it; when memory is short, the older copy of
  a part goes just before the newer one arrives.
* **What is buffered is counted.** Headers and a commit's metadata are reserved against the
  limit (:meth:`CheckpointKeeper.reserve`) before they are read.

Thread-safe; blocking waits are bounded by the caller's timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kelastic.agent.checkpoint.durable import DurableStore
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.folder import MemoryFolder
from kelastic.agent.checkpoint.plan import HeldCheckpoint, Inventory, memory_needed
from kelastic.agent.checkpoint.ranks import LocalRanks
from kelastic.agent.checkpoint.settings import CheckpointSettings, format_bytes

__all__ = ["MAX_FIRST_ID", "MAX_ID_JUMP", "CheckpointKeeper", "Refusal"]

_log = logging.getLogger(__name__)

#: How far past the newest checkpoint number this node has seen a request's number may run
#: (one save per step for a million steps while this node was away; no request exhausts them).
MAX_ID_JUMP = 2**20
#: The highest number a node that has seen none takes (a fresh node joins a group whose
#: numbers are far ahead: 2^40 saves are 35,000 years of one a second).
MAX_FIRST_ID = 2**40


@dataclass
class _Ckpt:
    id: int
    files: dict[str, int] = field(default_factory=dict)
    own: set[str] = field(default_factory=set)
    replicas: set[str] = field(default_factory=set)
    required: dict[str, int] | None = None
    ring: list[str] = field(default_factory=list)
    step: int | None = None
    #: bytes of the committed metadata (kept in the folder)
    meta_size: int = 0

    @property
    def committed(self) -> bool:
        return self.required is not None

    def nbytes(self) -> int:
        return sum(self.files.values()) + self.meta_size


@dataclass(frozen=True)
class Refusal:
    """Why ``begin`` refused a save (the message names the sizes). ``busy``: the save would
    have had to wait (longer than its timeout) for this node's earlier work, not too large."""

    reason: str
    busy: bool = False


@dataclass
class RestoreLog:
    """What this node's ranks restored: the newest restore (the status shows it) and how many
    restores each source served."""

    latest: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def record(
        self, cid: int, source: str, seconds: float, step: int | None, local: int = 0, fetched: int = 0
    ) -> bool:
        """One rank's restore of ``cid``, which read ``local`` bytes from this node's memory and
        fetched ``fetched`` from others; True the first time a rank reports that checkpoint.
        The newest restore keeps the longest time its ranks took and the bytes of them all."""
        first = self.latest is None or self.latest.get("id") != cid
        if first:
            self.counts[source] = self.counts.get(source, 0) + 1
            self.latest = {
                "id": cid,
                "source": source,
                "seconds": 0.0,
                "step": step,
                "local": 0,
                "fetched": 0,
            }
        latest = self.latest
        assert latest is not None
        latest["local"] += local
        latest["fetched"] += fetched
        if first or seconds > float(latest["seconds"]):
            latest.update(seconds=round(seconds, 3), time=time.time())
        return first


class CheckpointKeeper:
    """The state of one node's checkpoint memory; see the module docstring for its rules."""

    def __init__(self, settings: CheckpointSettings, endpoint: str) -> None:
        if settings.limit is None:
            raise ValueError(
                "the checkpoint memory limit is still 'auto': keep a node's own settings "
                "(CheckpointSettings.for_node), which have it derived"
            )
        self.settings = settings
        #: The bytes this node may hold (``settings.limit``, known to be set).
        self.limit: int = settings.limit
        self.endpoint = endpoint
        self.root = settings.root
        self.folder = MemoryFolder(settings.root)
        self._cond = threading.Condition()
        #: rank -> (worker pid, bytes) reserved by a save that rank began and has not finished
        #: writing; an entry whose process is gone (its group failed) no longer counts
        self._pending: dict[int, tuple[int, int]] = {}
        self._outgoing = 0
        self._pinned: dict[int, int] = {}
        #: (checkpoint, file) -> bytes of replicas arriving now: counted against the limit
        self._incoming: dict[tuple[int, str], int] = {}
        #: The checkpoint the group restored when this node holds it and it is older than the
        #: newest committed here (which turned out incomplete): kept until a newer one is
        #: committed; the newer ones are dropped first when memory is short
        self._base: int | None = None
        self._restores = RestoreLog()
        self._last_persist: float | None = None
        self._saves = 0
        #: time.monotonic() of the latest commits: the job's save cadence
        self._commit_times: deque[float] = deque(maxlen=2)
        self._refused = 0
        #: bytes of headers and metadata being read: counted against the limit
        self._buffered = 0
        #: the processes the agent started (its ranks); ``local.set`` names them
        self.local = LocalRanks(settings.node)
        self._ckpts: dict[int, _Ckpt] = _found(self.folder)
        self._newest = max(self._ckpts, default=0)
        if self._ckpts:
            _log.info("checkpoint memory: found %s from an earlier agent of this node", sorted(self._ckpts))

    # --- paths -------------------------------------------------------------------------------
    dir_name = staticmethod(MemoryFolder.dir_name)

    def dir_of(self, cid: int) -> Path:
        return self.folder.dir_of(cid)

    def path_of(self, cid: int, name: str) -> Path:
        return self.folder.path_of(cid, name)

    # --- accounting --------------------------------------------------------------------------
    def pool_bytes(self) -> int:
        return self.folder.pool_bytes()

    def held_bytes(self) -> int:
        """Bytes of checkpoint files held (own parts and replicas), without the reuse pool."""
        with self._cond:
            return sum(c.nbytes() for c in self._ckpts.values())

    def _newest_committed(self) -> _Ckpt | None:
        done = [c for c in self._ckpts.values() if c.committed]
        return max(done, key=lambda c: c.id) if done else None

    def _kept(self) -> set[int]:
        """Checkpoints a new save must not drop: the newest committed, a restored older one
        (see ``_base``) and those whose durable copy is being written."""
        newest = self._newest_committed()
        kept = {c.id for c in self._ckpts.values() if c.id in self._pinned}
        if newest is not None:
            kept.add(newest.id)
        if self._base is not None and self._base in self._ckpts:
            kept.add(self._base)
        return kept

    def _kept_bytes(self) -> int:
        return sum(self._ckpts[i].nbytes() for i in self._kept())

    def _used(self) -> int:
        """Bytes held (files, metadata), arriving (replicas) and being read (headers and
        metadata), without the reuse pool."""
        return sum(c.nbytes() for c in self._ckpts.values()) + sum(self._incoming.values()) + self._buffered

    def reserve(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` of ``what`` about to be read (until :meth:`release`); CheckpointError if over."""
        with self._cond:
            used = self._used()
            if used + nbytes > self.limit:
                raise CheckpointError(
                    f"node {self.settings.node} cannot read {format_bytes(nbytes)} of {what}: it holds "
                    f"{format_bytes(used)} of a {format_bytes(self.limit)} limit"
                )
            self._buffered += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._buffered -= nbytes
            self._cond.notify_all()

    def _check_id(self, cid: int) -> None:
        _check_id(self._newest, cid)

    def _drop_abandoned(self) -> None:
        """Memory is short after a restore: drop the committed checkpoints newer than the one
        the group restored (it restored an older one because they were incomplete)."""
        if self._base is None or self._base not in self._ckpts:
            return
        for cid in [c.id for c in self._ckpts.values() if c.committed and c.id > self._base]:
            if cid not in self._pinned:
                _log.info("checkpoint %d: dropped for memory (the group restored %d)", cid, self._base)
                self._drop(cid)

    # --- a save ------------------------------------------------------------------------------
    def new_group(self) -> None:
        """The workers are in a new group: the saves the old one began are void (a kept worker's
        may stay blocked on the broken group); their reservations go, a late ``open`` is refused."""
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()

    def _prune_pending(self, rank: int, pid: int) -> None:
        for r, (owner, _) in list(self._pending.items()):
            if (r == rank and owner != pid) or not self.local.holds(owner):
                del self._pending[r]

    def _busy(self, rank: int) -> str | None:
        if self._outgoing:
            return "the previous checkpoint's replica is still being sent"
        newest = self._newest_committed()
        if newest is not None and any(pid < newest.id for pid in self._pinned):
            return "an older checkpoint's durable copy is still being written"
        if rank in self._pending:
            return f"rank {rank}'s previous save is still being written"
        return None

    def begin(self, rank: int, nbytes: int, timeout: float, pid: int) -> tuple[int, Refusal | None]:
        """Reserve ``nbytes`` for rank ``rank``'s part of the next save.

        Waits (at most ``timeout`` seconds) until the previous checkpoint's replica and any
        older durable copy are done and the rank's previous save finished writing. Returns the
        newest checkpoint number this node has seen and None, or a :class:`Refusal` when the
        save would not fit (or the wait timed out). ``pid`` is the calling worker's (a process
        of this node): a reservation of a process that is gone (a save its failed group broke
        off) is dropped. CheckpointError for a pid that cannot be one.
        """
        if pid <= 0:
            raise CheckpointError(f"a save is reserved for a worker process of this node, not pid {pid}")
        deadline = time.monotonic() + timeout
        with self._cond:
            self.local.check(pid, "a save's reservation")
            self._prune_pending(rank, pid)
            while (busy := self._busy(rank)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._newest, Refusal(f"waited {timeout:g} s: {busy}", busy=True)
                self._cond.wait(min(left, 1.0))
                self._prune_pending(rank, pid)
            new_part = sum(b for _, b in self._pending.values()) + nbytes
            need = memory_needed(self._kept_bytes(), new_part, self.settings.replicas)
            if need > self.limit:
                self._drop_abandoned()
            kept = self._kept_bytes()
            need = memory_needed(kept, new_part, self.settings.replicas)
            if need > self.limit:
                self._refused += 1
                return self._newest, _over_limit(self.settings, self.limit, need, new_part, kept)
            newest = self._newest_committed()
            reusable = self.pool_bytes() + sum(
                c.nbytes() for c in self._ckpts.values() if c.id not in self._pinned and c is not newest
            )
            if (short := _tmpfs_short(self.root, reusable, rank, nbytes)) is not None:
                self._refused += 1
                return self._newest, short
            self._pending[rank] = (pid, nbytes)
            return self._newest, None

    def open(self, cid: int, name: str, size: int, rank: int) -> Path:
        """A file of ``size`` allocated bytes for rank ``rank``'s part of checkpoint ``cid``.

        Opening a newer checkpoint than any seen drops what the rules say (module docstring).
        Raises CheckpointError when the file would take the node past its limit (nothing is
        dropped then) or the tmpfs cannot allocate it.
        """
        path = self.path_of(cid, name)
        with self._cond:
            self._check_id(cid)
            self._prune_pending(-1, 0)
            if self.local.named and rank not in self._pending:
                raise CheckpointError(
                    f"rank {rank} has no save begun on node {self.settings.node}: only its own ranks open parts"
                )
            committed = [c.id for c in self._ckpts.values() if c.committed]
            if committed and cid <= max(committed):
                raise CheckpointError(
                    f"checkpoint {cid} is not newer than the committed checkpoint {max(committed)}, "
                    "whose parts are final"
                )
            superseded = self._superseded(cid)
            ck = self._ckpts.get(cid)
            held = ck.files.get(name, 0) if ck is not None else 0
            used = self._used() - held - sum(self._ckpts[c].nbytes() for c in superseded)
            if used + size > self.limit:
                raise CheckpointError(
                    f"node {self.settings.node} cannot open {format_bytes(size)} for {name} of checkpoint "
                    f"{cid}: it holds {format_bytes(used)} of a {format_bytes(self.limit)} limit"
                )
            for old in superseded:
                self._drop(old)
            self._newest = max(self._newest, cid)
            ck = self._ckpts.setdefault(cid, _Ckpt(cid))
            path.parent.mkdir(parents=True, exist_ok=True)
            self.folder.allocate(path, size)
            ck.files[name] = size
            ck.own.add(name)
            ck.replicas.discard(name)
            self._trim_pool()
            return path

    def done(self, rank: int) -> None:
        """Rank ``rank`` finished writing (or skipped) its part of the current save."""
        with self._cond:
            self._pending.pop(rank, None)
            self._cond.notify_all()

    def commit(
        self, cid: int, metadata: bytes, required: dict[str, int], ring: list[str], step: int | None
    ) -> bool:
        """Checkpoint ``cid`` is complete (every rank's part is written): keep its metadata,
        its manifest (``required``) and the ring it was saved on.

        True for a new commit, False for a repeat of the same commit (a retry: nothing to do).
        Raises CheckpointError when a newer checkpoint was opened meanwhile (an overlapping
        save superseded it), when ``cid`` is committed already with other contents (a
        committed checkpoint is final), or when its metadata would not fit.
        """
        with self._cond:
            self._check_id(cid)
            ck = self._ckpts.get(cid)
            if ck is not None and ck.committed:
                if (ck.required, ck.step) == (required, step) and self.folder.metadata(cid) == metadata:
                    return False
                raise CheckpointError(
                    f"checkpoint {cid} is committed already; a committed checkpoint is final"
                )
            # only a newer save of this node's own ranks supersedes it, never a peer's replica
            newer = [c.id for c in self._ckpts.values() if c.id > cid and c.own]
            if newer:
                raise CheckpointError(f"checkpoint {cid} was superseded by checkpoint {max(newer)}")
            if self._used() + len(metadata) > self.limit:
                raise CheckpointError(
                    f"node {self.settings.node} cannot keep {format_bytes(len(metadata))} of metadata of checkpoint "
                    f"{cid}: it holds {format_bytes(self._used())} of a {format_bytes(self.limit)} limit"
                )
            ck = self._ckpts.setdefault(cid, _Ckpt(cid))
            self.folder.write_commit(cid, metadata, {"required": required, "ring": ring, "step": step})
            ck.required, ck.ring, ck.step = dict(required), list(ring), step
            ck.meta_size = len(metadata)
            if self._base is not None and cid > self._base:
                self._base = None  # a newer checkpoint than the restored one is complete
            self._newest = max(self._newest, cid)
            self._saves += 1
            self._commit_times.append(time.monotonic())
            self._cond.notify_all()
            return True

    def cadence(self) -> tuple[int | None, float | None, float | None]:
        """The job's saves as this node saw them: the newest committed checkpoint, seconds
        since this agent saw its commit, and seconds between its two latest commits
        (None for what is not known: no commit yet, or only one since the agent started)."""
        with self._cond:
            newest = self._newest_committed()
            times = list(self._commit_times)
        now = time.monotonic()
        return (
            None if newest is None else newest.id,
            now - times[-1] if times else None,
            times[-1] - times[-2] if len(times) == 2 else None,
        )

    def wait_committed(self, after: int, timeout: float) -> bool:
        """Block up to ``timeout`` s until a checkpoint newer than ``after`` is committed."""

        def newer() -> bool:
            newest = self._newest_committed()
            return newest is not None and newest.id > after

        with self._cond:
            return self._cond.wait_for(newer, timeout=max(0.0, timeout))

    def own_files(self, cid: int) -> list[tuple[str, int]]:
        with self._cond:
            ck = self._ckpts.get(cid)
            return [] if ck is None else sorted((n, ck.files[n]) for n in ck.own if n in ck.files)

    # --- replicas ----------------------------------------------------------------------------
    def replica_target(self, cid: int, name: str, size: int) -> Path:
        """A temporary file for an incoming replica of ``size`` bytes, counted against the
        limit while it arrives; :meth:`replica_done` publishes it, :meth:`replica_failed`
        drops it. CheckpointError when it would replace a file held, belongs to a checkpoint
        older than the newest committed one, or would not fit."""
        final = self.path_of(cid, name)
        with self._cond:
            self._check_id(cid)
            newest = self._newest_committed()
            if newest is not None and cid < newest.id:
                raise CheckpointError(f"checkpoint {cid} is older than the committed checkpoint {newest.id}")
            ck = self._ckpts.get(cid)
            if (ck is not None and name in ck.files) or (cid, name) in self._incoming:
                raise CheckpointError(
                    f"node {self.settings.node} holds {name} of checkpoint {cid} already; a held part is "
                    "never replaced"
                )
            used = self._used()
            if used + size > self.limit:
                for old in _standby_copies(
                    self._ckpts.values(), self._pinned, cid, name
                ):  # short of memory: the older copy goes first
                    self._drop_file(old, name)
                used = self._used()
            if used + size > self.limit:
                raise CheckpointError(
                    f"node {self.settings.node} cannot hold a {format_bytes(size)} replica: it holds "
                    f"{format_bytes(used)} of a {format_bytes(self.limit)} limit"
                )
            self._incoming[(cid, name)] = size
            part = final.with_name(f".{name}.{uuid.uuid4().hex[:8]}.part")
            try:
                part.parent.mkdir(parents=True, exist_ok=True)
                self.folder.allocate(part, size, fill=False)
            except BaseException:
                del self._incoming[(cid, name)]
                raise
            self._trim_pool()
            return part

    def replica_done(self, cid: int, name: str, part: Path, size: int) -> None:
        with self._cond:
            self._incoming.pop((cid, name), None)
            newest = self._newest_committed()
            if newest is not None and cid < newest.id:  # superseded meanwhile
                part.unlink(missing_ok=True)
                self._cond.notify_all()
                return
            self._newest = max(self._newest, cid)
            ck = self._ckpts.setdefault(cid, _Ckpt(cid))
            os.replace(part, self.path_of(cid, name))
            ck.files[name] = size
            if name not in ck.own:
                ck.replicas.add(name)
            for old in _standby_copies(self._ckpts.values(), self._pinned, cid, name):
                if set(self._ckpts[old].files) <= set(ck.files):  # the newer one is as whole now
                    for held in list(self._ckpts[old].files):
                        self._drop_file(old, held)
            self._cond.notify_all()

    def _drop_file(self, cid: int, name: str) -> None:
        ck = self._ckpts[cid]
        ck.files.pop(name, None)
        ck.replicas.discard(name)
        self.folder.release_file(cid, name)
        if not ck.files:
            self._drop(cid)

    def replica_failed(self, cid: int, name: str, part: Path) -> None:
        """An incoming replica broke off: its file and its share of the limit are freed."""
        with self._cond:
            self._incoming.pop((cid, name), None)
            part.unlink(missing_ok=True)
            self._cond.notify_all()

    def outgoing(self, delta: int) -> None:
        """Count replication jobs of this node's parts in flight (``begin`` waits for 0)."""
        with self._cond:
            self._outgoing += delta
            self._cond.notify_all()

    # --- durable copies ----------------------------------------------------------------------
    def pin(self, cid: int) -> None:
        with self._cond:
            self._pinned[cid] = self._pinned.get(cid, 0) + 1
            self._last_persist = time.monotonic()

    def unpin(self, cid: int) -> None:
        with self._cond:
            left = self._pinned.get(cid, 0) - 1
            if left > 0:
                self._pinned[cid] = left
            else:
                self._pinned.pop(cid, None)
            self._cond.notify_all()

    def persist_due(self, cid: int) -> bool:
        with self._cond:
            since = None if self._last_persist is None else time.monotonic() - self._last_persist
            return self.settings.persist_due(cid, since)

    def durable(self) -> list[tuple[int, str]]:
        """Complete durable copies: (id, location), newest last."""
        target = self.settings.persist_dir
        return [] if target is None else DurableStore(target).copies()

    # --- reading -----------------------------------------------------------------------------
    def inventory(self) -> Inventory:
        with self._cond:
            held = tuple(
                HeldCheckpoint(c.id, dict(c.files), frozenset(c.replicas), c.required, c.step)
                for c in sorted(self._ckpts.values(), key=lambda c: c.id)
                if c.files or c.committed
            )
            newest = self._newest
        durable = tuple(self.durable())
        newest = max([newest, *(i for i, _ in durable)])
        return Inventory(self.settings.node, self.endpoint, held, durable, newest)

    def metadata(self, cid: int) -> bytes:
        with self._cond:
            ck = self._ckpts.get(cid)
            blob = self.folder.metadata(cid) if ck is not None and ck.committed else None
            if blob is None:
                raise CheckpointError(f"node {self.settings.node} holds no metadata of checkpoint {cid}")
            return blob

    def readable(self, cid: int, name: str, offset: int = 0, length: int = 0) -> Path:
        """The file ``name`` of checkpoint ``cid``, which holds bytes ``offset`` to
        ``offset + length``; CheckpointError when it is not held or shorter."""
        with self._cond:
            ck = self._ckpts.get(cid)
            if ck is None or name not in ck.files:
                raise CheckpointError(f"node {self.settings.node} holds no file {name} of checkpoint {cid}")
            if offset + length > ck.files[name]:
                raise CheckpointError(
                    f"{name} of checkpoint {cid} has {ck.files[name]} bytes; bytes {offset}..{offset + length} "
                    "are past its end"
                )
            return self.path_of(cid, name)

    def restored(
        self,
        cid: int,
        source: str,
        seconds: float,
        step: int | None,
        pid: int,
        local: int = 0,
        fetched: int = 0,
    ) -> bool:
        """A rank of this node (process ``pid``, else CheckpointError) restored checkpoint
        ``cid``: recorded for the status and the metrics. Drops nothing: when this node holds
        ``cid`` and it is older than the newest committed here (which was incomplete), it is
        kept beside it (module docstring). True the first time a rank reports it."""
        with self._cond:
            self.local.check(pid, "a restore report")
            self._check_id(cid)
            newest = self._newest_committed()
            held = self._ckpts.get(cid)
            if held is not None and held.committed and newest is not None and cid < newest.id:
                self._base = cid
            self._newest = max(self._newest, cid)
            return self._restores.record(cid, source, seconds, step, local, fetched)

    def status(self) -> dict[str, Any]:
        """What the agent publishes with its progress (the operator shows it)."""
        with self._cond:
            newest = self._newest_committed()
            return {
                "latest": None if newest is None else newest.id,
                "step": None if newest is None else newest.step,
                "restored": None if self._restores.latest is None else dict(self._restores.latest),
                "bytes": sum(c.nbytes() for c in self._ckpts.values()),
                "limit": self.limit,
                "saves": self._saves,
                "refused": self._refused,
                "restores": dict(self._restores.counts),
            }

    # --- dropping ----------------------------------------------------------------------------
    def _superseded(self, cid: int) -> list[int]:
        """What opening checkpoint ``cid`` drops: every older one the rules do not keep."""
        kept = self._kept()
        return [old for old in self._ckpts if old < cid and old not in kept]

    def _drop(self, cid: int) -> None:
        ck = self._ckpts.pop(cid, None)
        self.folder.release(cid, ck.files if ck is not None else ())
        self._cond.notify_all()

    def _trim_pool(self) -> None:
        """Free files kept for reuse that would take the tmpfs past the limit."""
        over = self._used() + self.pool_bytes() - self.limit
        if over > 0:
            self.folder.evict(over)

    def close(self, *, remove: bool) -> None:
        """Free the reuse pool; with ``remove``, everything (the job is over on this node)."""
        with self._cond:
            self.folder.evict(2**63)
            if remove:
                self.folder.remove()
                self._ckpts.clear()


def _found(folder: MemoryFolder) -> dict[int, _Ckpt]:
    """What a previous agent of this node left in ``folder`` (a restarted container)."""
    found: dict[int, _Ckpt] = {}
    for f in folder.load():
        info = f.manifest
        ck = _Ckpt(f.id, required=dict(info["required"]), ring=list(info["ring"]), step=info.get("step"))
        ck.meta_size = len(f.metadata)
        ck.files, ck.own = dict(f.files), set(f.files)
        found[f.id] = ck
    return found


def _check_id(newest: int, cid: int) -> None:
    """CheckpointError when ``cid`` runs too far past ``newest``, the newest number seen."""
    bound = newest + MAX_ID_JUMP if newest else MAX_FIRST_ID
    if cid > bound:
        raise CheckpointError(
            f"checkpoint {cid} is more than {bound - newest} past the newest this node has seen ({newest})"
        )


def _standby_copies(ckpts: Iterable[_Ckpt], pinned: Container[int], cid: int, name: str) -> list[int]:
    """The checkpoints older than ``cid`` with a copy of ``name`` that a node keeps outside any
    commit and wrote nothing of (a standby's copies): a newer copy of ``name`` supersedes them."""
    return [
        c.id
        for c in ckpts
        if c.id < cid and not c.committed and not c.own and name in c.files and c.id not in pinned
    ]


def _over_limit(settings: CheckpointSettings, limit: int, need: int, new_part: int, kept: int) -> Refusal:
    """Why a save that needs ``need`` bytes of checkpoint memory does not fit (pure)."""
    return Refusal(
        f"node {settings.node} needs {format_bytes(need)} of checkpoint memory for it "
        f"({format_bytes(new_part)} of its ranks' parts, x{1 + settings.replicas} with "
        f"{settings.replicas} replica(s), plus {format_bytes(kept)} of the previous "
        f"checkpoint kept meanwhile) but its limit is {format_bytes(limit)} ({settings.limit_reason})"
    )


def _tmpfs_short(root: Path, reusable: int, rank: int, nbytes: int) -> Refusal | None:
    """Why rank ``rank``'s ``nbytes`` do not fit in the tmpfs holding ``root`` (with
    ``reusable`` bytes this node can free), or None when they do."""
    free = _tmpfs_free(root)
    if free is None or free + reusable >= nbytes:
        return None
    return Refusal(
        f"the tmpfs holding {root} has {format_bytes(free)} free (and {format_bytes(reusable)} reusable) "
        f"but rank {rank} needs {format_bytes(nbytes)}: give /dev/shm a larger sizeLimit or lower "
        "--checkpoint-memory"
    )


def _tmpfs_free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize

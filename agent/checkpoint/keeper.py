"""One node's checkpoint memory: the files, what they belong to, and when they go.

:class:`CheckpointKeeper` is the state behind the agent's checkpoint service. It owns a
folder on a tmpfs (``settings.root``)::

    ckpt-<id>/<file>          a part written by a local rank, or a replica of a peer's part
    ckpt-<id>/.metadata       the checkpoint's torch.distributed.checkpoint metadata (pickled)
    ckpt-<id>/.manifest.json  the files the checkpoint consists of, the ring, the step
    free/<n>                  files of dropped checkpoints, kept allocated for the next save

Rules it enforces (the contract ``MemoryWriter`` relies on):

* **Complete or nothing.** A checkpoint counts once its metadata arrived (``commit``), which
  the coordinating rank sends only after every rank's part was written. Replicas arrive under
  a temporary name and appear whole.
* **The last complete one and at most one in progress.** Opening a file of a newer
  checkpoint drops every checkpoint older than the newest committed one, and every
  uncommitted one (a save that broke off); a restore drops what is newer than what the
  group restored (an abandoned lineage).
* **A save waits for the previous replica.** ``begin`` returns only when no replication of
  this node's parts is in flight (so a lost node costs at most one checkpoint) and no
  durable copy of an older checkpoint is still being written.
* **Bounded memory.** ``begin`` refuses a save that would not fit in ``settings.limit``
  (:func:`~kelastic.agent.checkpoint.plan.memory_needed`), naming the sizes; files are
  allocated up front (``posix_fallocate``) so a full tmpfs is an error, never a SIGBUS in a
  worker.

Thread-safe; blocking waits are bounded by the caller's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kelastic.agent.checkpoint.durable import DurableStore
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.plan import HeldCheckpoint, Inventory, memory_needed
from kelastic.agent.checkpoint.settings import CheckpointSettings, format_bytes

__all__ = ["CheckpointKeeper", "Refusal"]

_log = logging.getLogger(__name__)

METADATA = ".metadata"
MANIFEST = ".manifest.json"


@dataclass
class _Ckpt:
    id: int
    files: dict[str, int] = field(default_factory=dict)
    own: set[str] = field(default_factory=set)
    replicas: set[str] = field(default_factory=set)
    required: dict[str, int] | None = None
    ring: list[str] = field(default_factory=list)
    step: int | None = None

    @property
    def committed(self) -> bool:
        return self.required is not None

    def nbytes(self) -> int:
        return sum(self.files.values())


@dataclass(frozen=True)
class Refusal:
    """Why ``begin`` refused a save (the message names the sizes)."""

    reason: str


class CheckpointKeeper:
    """The state of one node's checkpoint memory; see the module docstring for its rules."""

    def __init__(self, settings: CheckpointSettings, endpoint: str) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self.root = settings.root
        self._pool = self.root / "free"
        self._pool.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._ckpts: dict[int, _Ckpt] = {}
        self._newest = 0
        #: rank -> (worker pid, bytes) reserved by a save that rank began and has not finished
        #: writing; an entry whose process is gone (its group failed) no longer counts
        self._pending: dict[int, tuple[int, int]] = {}
        self._outgoing = 0
        self._pinned: dict[int, int] = {}
        self._restored: dict[str, Any] | None = None
        self._last_persist: float | None = None
        self._saves = 0
        #: time.monotonic() of the latest commits: the job's save cadence
        self._commit_times: deque[float] = deque(maxlen=2)
        self._refused = 0
        self._restores: dict[str, int] = {}
        self._load_existing()

    # --- paths -------------------------------------------------------------------------------
    @staticmethod
    def dir_name(cid: int) -> str:
        """The folder of checkpoint ``cid`` under a node's root (workers read it directly)."""
        return f"ckpt-{cid:010d}"

    def dir_of(self, cid: int) -> Path:
        return self.root / self.dir_name(cid)

    def path_of(self, cid: int, name: str) -> Path:
        if "/" in name or name.startswith(".") or not name:
            raise CheckpointError(f"not a checkpoint file name: {name!r}")
        return self.dir_of(cid) / name

    def _load_existing(self) -> None:
        """Take over what a previous agent of this node left (a restarted container)."""
        for d in sorted(self.root.glob("ckpt-*")):
            try:
                cid = int(d.name.split("-", 1)[1])
            except ValueError:
                continue
            manifest = d / MANIFEST
            if not (d / METADATA).exists() or not manifest.exists():
                shutil.rmtree(d, ignore_errors=True)  # never committed here: torn
                continue
            info = json.loads(manifest.read_text())
            ck = _Ckpt(cid, required=dict(info["required"]), ring=list(info["ring"]), step=info.get("step"))
            for f in d.iterdir():
                if not f.name.startswith("."):
                    ck.files[f.name] = f.stat().st_size
                    ck.own.add(f.name)
            self._ckpts[cid] = ck
            self._newest = max(self._newest, cid)
        if self._ckpts:
            _log.info("checkpoint memory: found %s from an earlier agent of this node", sorted(self._ckpts))

    # --- accounting --------------------------------------------------------------------------
    def _pool_files(self) -> list[Path]:
        return sorted(self._pool.iterdir())

    def pool_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._pool_files())

    def held_bytes(self) -> int:
        """Bytes of checkpoint files held (own parts and replicas), without the reuse pool."""
        with self._cond:
            return sum(c.nbytes() for c in self._ckpts.values())

    def _newest_committed(self) -> _Ckpt | None:
        done = [c for c in self._ckpts.values() if c.committed]
        return max(done, key=lambda c: c.id) if done else None

    def _kept_bytes(self) -> int:
        newest = self._newest_committed()
        kept = {c.id for c in self._ckpts.values() if c.id in self._pinned}
        if newest is not None:
            kept.add(newest.id)
        return sum(self._ckpts[i].nbytes() for i in kept)

    # --- a save ------------------------------------------------------------------------------
    def _prune_pending(self, rank: int, pid: int) -> None:
        for r, (owner, _) in list(self._pending.items()):
            if (r == rank and owner != pid) or not _alive(owner):
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

    def begin(self, rank: int, nbytes: int, timeout: float, pid: int = 0) -> tuple[int, Refusal | None]:
        """Reserve ``nbytes`` for rank ``rank``'s part of the next save.

        Waits (at most ``timeout`` seconds) until the previous checkpoint's replica and any
        older durable copy are done and the rank's previous save finished writing. Returns the
        newest checkpoint number this node has seen and None, or a :class:`Refusal` when the
        save would not fit (or the wait timed out). ``pid`` is the calling worker's: a
        reservation of a process that is gone (a save its failed group broke off) is dropped.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._prune_pending(rank, pid)
            while (busy := self._busy(rank)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._newest, Refusal(f"waited {timeout:g} s: {busy}")
                self._cond.wait(min(left, 1.0))
                self._prune_pending(rank, pid)
            new_part = sum(b for _, b in self._pending.values()) + nbytes
            kept = self._kept_bytes()
            need = memory_needed(kept, new_part, self.settings.replicas)
            if need > self.settings.limit:
                self._refused += 1
                return self._newest, Refusal(
                    f"node {self.settings.node} needs {format_bytes(need)} of checkpoint memory for it "
                    f"({format_bytes(new_part)} of its ranks' parts, x{1 + self.settings.replicas} with "
                    f"{self.settings.replicas} replica(s), plus {format_bytes(kept)} of the previous "
                    f"checkpoint kept meanwhile) but its limit is {format_bytes(self.settings.limit)} "
                    f"({self.settings.limit_reason})"
                )
            free = _tmpfs_free(self.root)
            newest = self._newest_committed()
            reusable = self.pool_bytes() + sum(
                c.nbytes() for c in self._ckpts.values() if c.id not in self._pinned and c is not newest
            )
            if free is not None and free + reusable < nbytes:
                self._refused += 1
                return self._newest, Refusal(
                    f"the tmpfs holding {self.root} has {format_bytes(free)} free (and "
                    f"{format_bytes(reusable)} reusable) but rank {rank} needs {format_bytes(nbytes)}: "
                    "give /dev/shm a larger sizeLimit or lower --checkpoint-memory"
                )
            self._pending[rank] = (pid, nbytes)
            return self._newest, None

    def open(self, cid: int, name: str, size: int, rank: int) -> Path:
        """A file of ``size`` allocated bytes for rank ``rank``'s part of checkpoint ``cid``.

        Opening a newer checkpoint than any seen drops what the rules say (module docstring).
        Raises CheckpointError when the tmpfs cannot allocate it.
        """
        with self._cond:
            committed = [c.id for c in self._ckpts.values() if c.committed]
            if committed and cid <= max(committed):
                raise CheckpointError(
                    f"checkpoint {cid} is older than the committed checkpoint {max(committed)}"
                )
            self._drop_superseded(cid)
            self._newest = max(self._newest, cid)
            ck = self._ckpts.setdefault(cid, _Ckpt(cid))
            path = self.path_of(cid, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._allocate(path, size)
            ck.files[name] = size
            ck.own.add(name)
            ck.replicas.discard(name)
            return path

    def _allocate(self, path: Path, size: int) -> None:
        if not (path.exists() and path.stat().st_size == size):
            pool = self._pool_files()
            same = next((p for p in pool if p.stat().st_size == size), None)
            reuse = same or (pool[0] if pool else None)
            if reuse is not None:
                os.replace(reuse, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise CheckpointError(
                f"cannot allocate {format_bytes(size)} for {path.name} in {path.parent}: {e.strerror}; "
                "give /dev/shm a larger sizeLimit or lower --checkpoint-memory"
            ) from e
        os.close(fd)

    def done(self, rank: int) -> None:
        """Rank ``rank`` finished writing (or skipped) its part of the current save."""
        with self._cond:
            self._pending.pop(rank, None)
            self._cond.notify_all()

    def commit(
        self, cid: int, metadata: bytes, required: dict[str, int], ring: list[str], step: int | None
    ) -> _Ckpt:
        """Checkpoint ``cid`` is complete (every rank's part is written): keep its metadata.

        Raises CheckpointError when a newer checkpoint was opened meanwhile (an overlapping
        save superseded it).
        """
        with self._cond:
            newer = [c for c in self._ckpts if c > cid]
            if newer:
                raise CheckpointError(f"checkpoint {cid} was superseded by checkpoint {max(newer)}")
            ck = self._ckpts.setdefault(cid, _Ckpt(cid))
            d = self.dir_of(cid)
            d.mkdir(parents=True, exist_ok=True)
            _write_atomically(d / METADATA, metadata)
            _write_atomically(
                d / MANIFEST, json.dumps({"required": required, "ring": ring, "step": step}).encode()
            )
            ck.required, ck.ring, ck.step = dict(required), list(ring), step
            self._newest = max(self._newest, cid)
            self._saves += 1
            self._commit_times.append(time.monotonic())
            self._cond.notify_all()
            return ck

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
        """A temporary file for an incoming replica; :meth:`replica_done` publishes it."""
        with self._cond:
            used = sum(c.nbytes() for c in self._ckpts.values())
            if used + size > self.settings.limit:
                self._evict_pool(used + size - self.settings.limit)
                raise CheckpointError(
                    f"node {self.settings.node} cannot hold a {format_bytes(size)} replica: it holds "
                    f"{format_bytes(used)} of a {format_bytes(self.settings.limit)} limit"
                )
            self._newest = max(self._newest, cid)
            self._ckpts.setdefault(cid, _Ckpt(cid))
            final = self.path_of(cid, name)
            part = final.with_name(f".{name}.{uuid.uuid4().hex[:8]}.part")
            part.parent.mkdir(parents=True, exist_ok=True)
            self._allocate(part, size)
            return part

    def replica_done(self, cid: int, name: str, part: Path, size: int) -> None:
        with self._cond:
            ck = self._ckpts.get(cid)
            if ck is None:  # dropped meanwhile
                part.unlink(missing_ok=True)
                return
            os.replace(part, self.path_of(cid, name))
            ck.files[name] = size
            if name not in ck.own:
                ck.replicas.add(name)

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
        path = self.dir_of(cid) / METADATA
        try:
            return path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"node {self.settings.node} holds no metadata of checkpoint {cid}") from e

    def readable(self, cid: int, name: str) -> Path:
        with self._cond:
            ck = self._ckpts.get(cid)
            if ck is None or name not in ck.files:
                raise CheckpointError(f"node {self.settings.node} holds no file {name} of checkpoint {cid}")
            return self.path_of(cid, name)

    def restored(self, cid: int, source: str, seconds: float, step: int | None) -> bool:
        """The group restored checkpoint ``cid``: drop newer ones (an abandoned lineage).
        True the first time a rank of this node reports it (the agent logs it once)."""
        with self._cond:
            for newer in [c for c in self._ckpts if c > cid and c not in self._pinned]:
                self._drop(newer)
            first = self._restored is None or self._restored.get("id") != cid
            if first:
                self._restores[source] = self._restores.get(source, 0) + 1
            if first or seconds > float((self._restored or {}).get("seconds", 0)):
                self._restored = {
                    "id": cid,
                    "source": source,
                    "seconds": round(seconds, 3),
                    "time": time.time(),
                    "step": step,
                }
            self._newest = max(self._newest, cid)
            return first

    def status(self) -> dict[str, Any]:
        """What the agent publishes with its progress (the operator shows it)."""
        with self._cond:
            newest = self._newest_committed()
            return {
                "latest": None if newest is None else newest.id,
                "step": None if newest is None else newest.step,
                "restored": None if self._restored is None else dict(self._restored),
                "bytes": sum(c.nbytes() for c in self._ckpts.values()),
                "limit": self.settings.limit,
                "saves": self._saves,
                "refused": self._refused,
                "restores": dict(self._restores),
            }

    # --- dropping ----------------------------------------------------------------------------
    def _drop_superseded(self, cid: int) -> None:
        newest = self._newest_committed()
        for old in list(self._ckpts):
            if old >= cid or old in self._pinned:
                continue
            if newest is not None and old == newest.id:
                continue
            self._drop(old)

    def _drop(self, cid: int) -> None:
        ck = self._ckpts.pop(cid, None)
        d = self.dir_of(cid)
        if ck is not None:
            for name in ck.files:
                src = d / name
                if src.exists():
                    os.replace(src, self._pool / uuid.uuid4().hex)
        shutil.rmtree(d, ignore_errors=True)
        self._cond.notify_all()

    def _evict_pool(self, nbytes: int) -> None:
        for p in self._pool_files():
            if nbytes <= 0:
                return
            nbytes -= p.stat().st_size
            p.unlink(missing_ok=True)

    def close(self, *, remove: bool) -> None:
        """Free the reuse pool; with ``remove``, everything (the job is over on this node)."""
        with self._cond:
            self._evict_pool(2**63)
            if remove:
                shutil.rmtree(self.root, ignore_errors=True)
                self._ckpts.clear()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not told: trust the reservation
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _tmpfs_free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize

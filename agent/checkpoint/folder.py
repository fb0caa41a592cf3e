"""One node's checkpoint folder on a tmpfs: where each checkpoint's files are, and the files
kept for reuse.

::

    <root>/ckpt-<id>/<file>          a part written by a local rank, or a replica of a peer's part
    <root>/ckpt-<id>/.metadata       the checkpoint's torch.distributed.checkpoint metadata
    <root>/ckpt-<id>/.manifest.json  the files the checkpoint consists of, the ring, the step
    <root>/free/<n>                  files of dropped checkpoints, kept allocated for the next save

:class:`MemoryFolder` is the file system side of the
:class:`~kelastic.agent.checkpoint.keeper.CheckpointKeeper`, which decides what is kept;
it is not thread-safe on its own (the keeper calls it under its lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.requests import check_name
from kelastic.agent.checkpoint.settings import format_bytes

__all__ = ["MANIFEST", "METADATA", "FolderClaim", "Found", "MemoryFolder", "claim_folder"]

METADATA = ".metadata"
MANIFEST = ".manifest.json"


@dataclass(frozen=True)
class FolderClaim:
    """A node folder this process holds (an exclusive ``flock`` on the directory itself, which
    the kernel drops when the process dies: a restarted agent claims its folder back)."""

    path: Path
    fd: int

    def release(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def claim_folder(wanted: Path, tries: int = 64) -> FolderClaim:
    """``wanted`` made and held by this process, or, where another live agent holds it (two
    agents of one run on one host share a host name), the first of ``wanted-2``,
    ``wanted-3``, ... that no live process holds. CheckpointError after ``tries`` names."""
    for n in range(1, tries + 1):
        path = wanted if n == 1 else wanted.with_name(f"{wanted.name}-{n}")
        for _ in range(3):  # another agent may remove an empty parent, or this folder, meanwhile
            try:
                path.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                break  # held by a live agent: the next name
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return FolderClaim(path, fd)
            os.close(fd)  # removed (and perhaps made again) by its last holder: once more
    raise CheckpointError(
        f"no free checkpoint folder for this node: {wanted} and {tries - 1} others are held"
    )


@dataclass(frozen=True)
class Found:
    """A committed checkpoint an earlier agent of this node left."""

    id: int
    manifest: dict[str, Any]
    metadata: bytes
    files: dict[str, int]


class MemoryFolder:
    """The files of a node's checkpoint memory under ``root`` (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = root / "free"
        self.pool.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def dir_name(cid: int) -> str:
        """The folder of checkpoint ``cid`` under a node's root (workers read it directly)."""
        return f"ckpt-{cid:010d}"

    def dir_of(self, cid: int) -> Path:
        return self.root / self.dir_name(cid)

    def path_of(self, cid: int, name: str) -> Path:
        """CheckpointError for a name that is not a plain file name."""
        try:
            return self.dir_of(cid) / check_name(name)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def load(self) -> Iterator[Found]:
        """The committed checkpoints in the folder; torn ones (never committed) are removed."""
        for d in sorted(self.root.glob("ckpt-*")):
            try:
                cid = int(d.name.split("-", 1)[1])
            except ValueError:
                continue
            if not (d / METADATA).exists() or not (d / MANIFEST).exists():
                shutil.rmtree(d, ignore_errors=True)  # never committed here: torn
                continue
            files = {f.name: f.stat().st_size for f in d.iterdir() if not f.name.startswith(".")}
            yield Found(cid, json.loads((d / MANIFEST).read_text()), (d / METADATA).read_bytes(), files)

    def write_commit(self, cid: int, metadata: bytes, manifest: dict[str, Any]) -> None:
        d = self.dir_of(cid)
        d.mkdir(parents=True, exist_ok=True)
        _write_atomically(d / METADATA, metadata)
        _write_atomically(d / MANIFEST, json.dumps(manifest).encode())

    def metadata(self, cid: int) -> bytes | None:
        try:
            return (self.dir_of(cid) / METADATA).read_bytes()
        except OSError:
            return None

    # --- the reuse pool -----------------------------------------------------------------------
    def pool_files(self) -> list[Path]:
        return sorted(self.pool.iterdir())

    def pool_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.pool_files())

    def allocate(self, path: Path, size: int, *, fill: bool = True) -> None:
        """A file of ``size`` bytes at ``path``, from the reuse pool when it has one; with
        ``fill`` its pages are allocated now (CheckpointError when the tmpfs is full), else
        it is sized as it is written."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.exists() and path.stat().st_size == size):
            pool = self.pool_files()
            same = next((p for p in pool if p.stat().st_size == size), None)
            reuse = same or (pool[0] if pool else None)
            if reuse is not None:
                os.replace(reuse, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if fill:
                os.ftruncate(fd, size)
                if size:
                    os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise CheckpointError(
                f"cannot allocate {format_bytes(size)} for {path.name} in {path.parent}: {e.strerror}; "
                "give /dev/shm a larger sizeLimit or lower --checkpoint-memory"
            ) from e
        os.close(fd)

    def release(self, cid: int, names: Iterable[str]) -> None:
        """Drop checkpoint ``cid``'s folder, keeping its files ``names`` in the pool."""
        d = self.dir_of(cid)
        for name in names:
            src = d / name
            if src.exists():
                os.replace(src, self.pool / uuid.uuid4().hex)
        shutil.rmtree(d, ignore_errors=True)

    def release_file(self, cid: int, name: str) -> None:
        """Drop one file of checkpoint ``cid`` into the pool (its folder stays)."""
        src = self.dir_of(cid) / name
        if src.exists():
            os.replace(src, self.pool / uuid.uuid4().hex)

    def evict(self, nbytes: int) -> None:
        """Free at least ``nbytes`` of the pool (all of it when it holds less)."""
        for p in self.pool_files():
            if nbytes <= 0:
                return
            nbytes -= p.stat().st_size
            p.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

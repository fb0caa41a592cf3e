"""Where durable copies live: a local directory (a PersistentVolumeClaim's mount path) or,
through fsspec (which torch itself depends on), a URL such as ``s3://bucket/run``.

A copy is ``<location>/checkpoint-<N>/``, torch.distributed.checkpoint's own layout. It
counts once its ``.metadata`` exists: in a local directory the copy is written under a
temporary name and renamed into place; at a URL (object stores have no atomic rename) the
data files are written first and ``.metadata`` last.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["DURABLE_PREFIX", "DurableStore"]

#: Durable copies are ``<location>/checkpoint-<id>``.
DURABLE_PREFIX = "checkpoint-"
METADATA = ".metadata"


def _cid(name: str) -> int | None:
    tail = name.rstrip("/").rsplit("/", 1)[-1]
    if not tail.startswith(DURABLE_PREFIX) or not tail[len(DURABLE_PREFIX) :].isdigit():
        return None
    return int(tail[len(DURABLE_PREFIX) :])


class DurableStore:
    """The durable directory of a job; ``location`` is a path or an fsspec URL."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.location = str(location)
        self.is_url = "://" in self.location and not self.location.startswith("file://")

    def __str__(self) -> str:
        return self.location

    def _fs(self) -> tuple[Any, str]:
        import fsspec  # type: ignore[import-untyped]  # torch depends on it; it ships no types

        fs, root = fsspec.core.url_to_fs(self.location)
        return fs, str(root).rstrip("/")

    def path_of(self, cid: int) -> str:
        return f"{self.location.rstrip('/')}/{DURABLE_PREFIX}{cid}"

    def copies(self) -> list[tuple[int, str]]:
        """Complete copies, (id, location), oldest first; [] when the location is unreachable."""
        found: list[tuple[int, str]] = []
        if not self.is_url:
            d = Path(self.location.removeprefix("file://"))
            if not d.is_dir():
                return []
            for p in d.iterdir():
                cid = _cid(p.name)
                if cid is not None and (p / METADATA).exists():
                    found.append((cid, str(p)))
            return sorted(found)
        try:
            fs, root = self._fs()
            names = fs.ls(root, detail=False)
        except (OSError, ValueError):
            return []
        for name in names:
            cid = _cid(str(name))
            if cid is not None and fs.exists(f"{str(name).rstrip('/')}/{METADATA}"):
                found.append((cid, self.path_of(cid)))
        return sorted(found)

    @contextmanager
    def writing(self, cid: int) -> Iterator[Any]:
        """A writer for copy ``cid``: ``open(name)`` gives a binary file, data files first and
        ``.metadata`` last; the copy appears whole when the block ends without an error."""
        if self.is_url:
            fs, root = self._fs()
            folder = f"{root}/{DURABLE_PREFIX}{cid}"
            if fs.exists(folder):
                fs.rm(folder, recursive=True)
            fs.makedirs(folder, exist_ok=True)
            yield _UrlWriter(fs, folder)
            return
        dest = Path(self.location.removeprefix("file://"))
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / f"{DURABLE_PREFIX}{cid}"
        tmp = dest / f".{DURABLE_PREFIX}{cid}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        try:
            yield _LocalWriter(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def prune(self, keep: int) -> None:
        """Remove all but the newest ``keep`` complete copies."""
        copies = self.copies()
        old = copies[: max(0, len(copies) - keep)]
        if self.is_url and old:
            fs, _ = self._fs()
            for _, where in old:
                fs.rm(where, recursive=True)
            return
        for _, where in old:
            shutil.rmtree(where, ignore_errors=True)

    def read_metadata(self, where: str) -> Any:
        """Copy ``where``'s metadata, read with :func:`kelastic.agent.checkpoint.codec.loads`
        (DCP's own readers unpickle it unchecked). OSError when it cannot be read,
        ``codec.UnsafeMetadata`` when it names anything a DCP metadata does not hold."""
        from kelastic.agent.checkpoint import codec

        if self.is_url or "://" in where:
            fs, _ = self._fs()
            with fs.open(f"{where.rstrip('/')}/{METADATA}", "rb") as f:
                blob = f.read()
        else:
            blob = (Path(where.removeprefix("file://")) / METADATA).read_bytes()
        return codec.loads(blob)

    def reader(self, where: str) -> Any:
        """torch.distributed.checkpoint's reader for copy ``where`` (its data files; take the
        metadata from :meth:`read_metadata`)."""
        if self.is_url or "://" in where:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(where)
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(where)


class _LocalWriter:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        with open(self.folder / name, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


class _UrlWriter:
    def __init__(self, fs: Any, folder: str) -> None:
        self.fs = fs
        self.folder = folder

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        with self.fs.open(f"{self.folder}/{name}", "wb") as f:
            yield f


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

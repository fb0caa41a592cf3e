"""Where containers' logs lie on disk, and how a reader serves them.

The kubelet writes each run of a container to ``<restart>.log`` under
:func:`pod_log_dir`; whoever answers ``kubectl logs`` reads those files: the API
server emulator itself, and for a real kube-apiserver the kubelet's HTTPS endpoint.
The layout is the one thing the emulator and the kubelet share, so it lives here
rather than in either of them.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["log_files", "pod_log_dir", "select_lines"]


def pod_log_dir(data_dir: Path, namespace: str, name: str, uid: str) -> Path:
    """The directory of a pod's container logs: ``<data_dir>/pods/<ns>_<name>_<uid>``."""
    return data_dir / "pods" / f"{namespace}_{name}_{uid}"


def log_files(folder: Path) -> list[tuple[int, Path]]:
    """The ``<restart>.log`` files of one container, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((int(p.stem), p) for p in folder.glob("*.log") if p.stem.isdigit())


def select_lines(data: bytes, tail: int | None, limit: int | None) -> bytes:
    """Apply ``tailLines`` then ``limitBytes`` to a log's bytes."""
    if tail is not None:
        data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail > 0 else b""
    if limit is not None:
        data = data[:limit]
    return data

"""``pods/NAME/log``: a container's output, from the files the kubelet writes.

:func:`serve_logs` answers ``kubectl logs`` with ``container``, ``previous``,
``tailLines``, ``limitBytes``, ``timestamps`` and ``follow``; a follow ends when the
container's run ended (the next run's file exists, or its status says terminated), the
pod went, or the client did. The errors are the real server's (a pod of several
containers needs one named; a container that has not started yet has no log).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ..common.podlogs import log_files, pod_log_dir, select_lines
from .errors import ApiError
from .httpio import flag, int_param
from .registry import Registry
from .registry_types import Obj
from .resources import ResourceType

__all__ = ["serve_logs"]


def _container(pod: Obj, name: str, wanted: str | None) -> str:
    """The container a log request names (the only one when it names none); 400 otherwise."""
    spec = pod.get("spec") or {}
    containers = [c["name"] for c in spec.get("containers") or []]
    inits = [c["name"] for c in spec.get("initContainers") or []]
    if not wanted:
        if len(containers) != 1:
            raise ApiError.bad_request(
                f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
                + (f" or one of the init containers: [{' '.join(inits)}]" if inits else "")
            )
        return containers[0]
    if wanted not in containers and wanted not in inits:
        raise ApiError.bad_request(f"container {wanted} is not valid for pod {name}")
    return wanted


async def serve_logs(
    request: web.Request,
    registry: Registry,
    data_dir: Path,
    ns: str,
    name: str,
    stopping: Callable[[], bool],
) -> web.StreamResponse:
    """The log of one container of pod ``ns/name``, followed while it runs when asked."""
    rt = registry.types.lookup("", "v1", "pods")
    assert rt is not None
    q = request.query
    pod = registry.get(rt, ns, name)
    container = _container(pod, name, q.get("container"))
    folder = pod_log_dir(data_dir, ns, name, pod["metadata"]["uid"]) / container
    files = log_files(folder)
    if not files:
        raise ApiError.bad_request(
            f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
        )
    if flag(q.get("previous")):
        if len(files) < 2:
            raise ApiError.bad_request(
                f'previous terminated container "{container}" in pod "{name}" not found'
            )
        index, path = files[-2]
    else:
        index, path = files[-1]
    tail = int_param(q.get("tailLines"), "tailLines")
    limit = int_param(q.get("limitBytes"), "limitBytes")
    prefix: Callable[[bytes], bytes] = _stamp if flag(q.get("timestamps")) else (lambda b: b)
    data = path.read_bytes()
    offset = len(data)
    data = select_lines(data, tail, limit)
    if not flag(q.get("follow")):
        return web.Response(body=prefix(data), content_type="text/plain")
    resp = web.StreamResponse(status=200)
    resp.content_type = "text/plain"
    resp.enable_chunked_encoding()
    await resp.prepare(request)

    def done() -> bool:
        return _container_done(registry, rt, ns, name, pod["metadata"]["uid"], container, index, folder)

    try:
        if data:
            await resp.write(prefix(data))
        await _follow(request, resp, path, offset, prefix, done, stopping)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


async def _follow(
    request: web.Request,
    resp: web.StreamResponse,
    path: Path,
    offset: int,
    prefix: Callable[[bytes], bytes],
    done: Callable[[], bool],
    stopping: Callable[[], bool],
) -> None:
    """Write what the file gains from ``offset``, whole lines at a time, until ``done()``."""
    pending = b""
    while not stopping():
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
        offset += len(chunk)
        pending += chunk
        if pending:
            cut = pending.rfind(b"\n") + 1
            if cut:
                await resp.write(prefix(pending[:cut]))
                pending = pending[cut:]
        if chunk:
            continue
        if done():
            if pending:
                await resp.write(prefix(pending))
            break
        transport = request.transport
        if transport is None or transport.is_closing():
            break
        await asyncio.sleep(0.1)


def _container_done(
    registry: Registry,
    rt: ResourceType,
    ns: str,
    name: str,
    uid: str,
    container: str,
    index: int,
    folder: Path,
) -> bool:
    """Whether run ``index`` of the container ended (or its pod went): a follow ends then."""
    pod = registry.store.get(rt.key, ns, name)
    if pod is None or pod["metadata"].get("uid") != uid:
        return True
    if (folder / f"{index + 1}.log").exists():
        return True
    status = pod.get("status") or {}
    for s in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
        if s.get("name") == container:
            return int(s.get("restartCount", 0)) == index and "terminated" in (s.get("state") or {})
    return status.get("phase") in ("Succeeded", "Failed")


def _stamp(data: bytes) -> bytes:
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1e9):09d}Z "
    return b"".join(now.encode() + line for line in data.splitlines(keepends=True))

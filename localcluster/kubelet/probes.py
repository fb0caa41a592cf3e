"""Container probes: exec, httpGet and tcpSocket, for readiness, liveness and startup.

:class:`ProbeSpec` is a parsed probe; :class:`ProbeTracker` is the pure state
machine that turns a stream of probe results into "ready"/"healthy" with the
Kubernetes thresholds; :func:`probe_once` performs one probe against a local
process (exec runs the command in the container's environment and working
directory, in its own process group, killed at the timeout; httpGet and
tcpSocket connect to the pod IP unless ``host`` says otherwise) and says what it
saw in the real kubelet's words (``HTTP probe failed with statuscode: 503``, Go's
``dial tcp ...: connect: connection refused``), which the kubelet's ``Unhealthy``
event quotes; :func:`run_probe` is its result alone.
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .podenv import python_or

__all__ = [
    "ProbeKind",
    "ProbeResult",
    "ProbeSpec",
    "ProbeTracker",
    "probe_once",
    "resolve_port",
    "run_probe",
]

#: What the real kubelet keeps of an exec probe's output.
_MAX_OUTPUT = 10 * 1024


class ProbeKind(str, enum.Enum):
    EXEC = "exec"
    HTTP_GET = "httpGet"
    TCP_SOCKET = "tcpSocket"


class ProbeResult(str, enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"


@dataclass(frozen=True)
class ProbeSpec:
    """A probe as declared in a container (defaults as in the Kubernetes API)."""

    kind: ProbeKind
    handler: Mapping[str, Any]
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def parse(cls, probe: Mapping[str, Any] | None) -> ProbeSpec | None:
        """Parse a container's probe; ``None`` when it declares none.

        Raises ValueError for a probe that names no supported handler (grpc is not
        supported locally).
        """
        if not probe:
            return None
        for kind in ProbeKind:
            if kind.value in probe:
                return cls(
                    kind=kind,
                    handler=probe[kind.value] or {},
                    initial_delay=float(probe.get("initialDelaySeconds", 0)),
                    period=float(probe.get("periodSeconds", 10)),
                    timeout=float(probe.get("timeoutSeconds", 1)),
                    success_threshold=int(probe.get("successThreshold", 1)),
                    failure_threshold=int(probe.get("failureThreshold", 3)),
                )
        raise ValueError(
            f"probe {dict(probe)!r} has no exec, httpGet or tcpSocket handler (the only kinds kelastic local runs)"
        )


@dataclass
class ProbeTracker:
    """Consecutive-result counting with success/failure thresholds.

    ``ok`` starts at ``initial`` (False for readiness and startup, True for
    liveness) and flips only after ``success_threshold`` consecutive successes
    or ``failure_threshold`` consecutive failures.
    """

    spec: ProbeSpec
    initial: bool
    ok: bool = field(init=False)
    successes: int = field(default=0, init=False)
    failures: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ok = self.initial

    def record(self, result: ProbeResult) -> bool:
        """Record one result; return True when ``ok`` changed."""
        before = self.ok
        if result is ProbeResult.SUCCESS:
            self.successes += 1
            self.failures = 0
            if self.successes >= self.spec.success_threshold:
                self.ok = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= self.spec.failure_threshold:
                self.ok = False
        return self.ok != before

    def reset(self) -> None:
        self.ok = self.initial
        self.successes = self.failures = 0


def resolve_port(port: Any, container_ports: Sequence[Mapping[str, Any]]) -> int:
    """A probe or service port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container_ports:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is neither a number nor the name of a container port")


async def _run_exec(
    command: Sequence[str], env: Mapping[str, str], cwd: str | None, timeout: float
) -> tuple[ProbeResult, str]:
    proc = await asyncio.create_subprocess_exec(
        *command,
        env=dict(env),
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    stdout = proc.stdout
    assert stdout is not None

    async def finish() -> tuple[bytes, int]:
        kept = b""
        while chunk := await stdout.read(65536):  # keep the first 10 KiB, drain the rest
            kept += chunk[: max(0, _MAX_OUTPUT - len(kept))]
        return kept, await proc.wait()

    try:
        output, code = await asyncio.wait_for(finish(), timeout)
    except asyncio.TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        return ProbeResult.FAILURE, "command timed out"
    finally:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = output.decode("utf-8", errors="replace")
    return (ProbeResult.SUCCESS if code == 0 else ProbeResult.FAILURE), text


def _dial_error(host: str, port: int, exc: BaseException) -> str:
    """A failed connection as Go's net package words it (``dial tcp H:P: connect: connection refused``)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(exc, asyncio.TimeoutError):
        return f"dial tcp {where}: i/o timeout"
    errno = exc.errno if isinstance(exc, OSError) else None
    reason = (os.strerror(errno) if errno else str(exc)).lower()
    return f"dial tcp {where}: connect: {reason}"


async def run_probe(
    spec: ProbeSpec,
    *,
    pod_ip: str,
    env: Mapping[str, str],
    cwd: str | None,
    container_ports: Sequence[Mapping[str, Any]] = (),
) -> ProbeResult:
    """Perform one probe; every error (refused, timeout, bad exit) is a failure."""
    result, _ = await probe_once(spec, pod_ip=pod_ip, env=env, cwd=cwd, container_ports=container_ports)
    return result


async def probe_once(
    spec: ProbeSpec,
    *,
    pod_ip: str,
    env: Mapping[str, str],
    cwd: str | None,
    container_ports: Sequence[Mapping[str, Any]] = (),
) -> tuple[ProbeResult, str]:
    """Perform one probe: its result and its output as the real kubelet words it.

    Every error (refused, timeout, bad exit) is a failure. An exec probe's
    ``python``/``python3`` is this interpreter, as for containers.
    """
    handler = spec.handler
    if spec.kind is ProbeKind.EXEC:
        command = [str(a) for a in handler.get("command") or []]
        if not command:
            return ProbeResult.FAILURE, "no command"
        command[0] = python_or(command[0])
        try:
            return await _run_exec(command, env, cwd, spec.timeout)
        except OSError as exc:
            return ProbeResult.FAILURE, str(exc)
    host = str(handler.get("host") or pod_ip)
    try:
        port = resolve_port(handler.get("port"), container_ports)
    except ValueError as exc:
        return ProbeResult.FAILURE, str(exc)
    if spec.kind is ProbeKind.TCP_SOCKET:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), spec.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            return ProbeResult.FAILURE, _dial_error(host, port, exc)
        writer.close()
        return ProbeResult.SUCCESS, ""
    scheme = str(handler.get("scheme", "HTTP")).lower()
    path = handler.get("path", "/") or "/"
    if not path.startswith("/"):
        path = "/" + path
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    url = f"{scheme}://{netloc}{path}"
    headers = {h["name"]: str(h.get("value", "")) for h in handler.get("httpHeaders") or []}
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, headers=headers, ssl=False) as resp,
        ):
            if 200 <= resp.status < 400:
                return ProbeResult.SUCCESS, ""
            return ProbeResult.FAILURE, f"HTTP probe failed with statuscode: {resp.status}"
    except aiohttp.ClientConnectorError as exc:
        return ProbeResult.FAILURE, f'Get "{url}": {_dial_error(host, port, exc.os_error)}'
    except asyncio.TimeoutError:
        return (
            ProbeResult.FAILURE,
            f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)',
        )
    except (OSError, aiohttp.ClientError, ValueError) as exc:
        return ProbeResult.FAILURE, f'Get "{url}": {exc}'

"""The rendezvous store's servers: ``kelastic-rendezvous`` as a child process, and torch's stores.

``kelastic-rendezvous --host H --port P`` (:mod:`kelastic.agent.storeserver`, which imports
no torch) serves torch's ``TCPStore`` protocol and nothing else; agents and the operator
keep all protocol state in it (see ``handler`` and ``protocol``). It runs in its own pod,
never in a worker, so a worker failure cannot take it down. It holds what clients write
within bounds (:mod:`kelastic.agent.boundedstore`), refusing with a log line what exceeds
them, so a stranger who reaches it cannot grow it without bound.

The listening socket is bound by us (exactly ``H:P``, ``SO_REUSEADDR``) and handed
to the store with ``master_listen_fd``: several stores can listen on the same port
on different 127.x addresses, and there is no window between choosing a port and
listening on it. ``serve_store`` does the same for the per-round worker store an
agent hosts.

API for the agent's ``--standalone`` mode and for tests:

- ``RendezvousServer(host, port)``: in-process; ``start()`` returns once serving,
  ``endpoint`` is ``host:port`` (the real port when 0 was asked), ``stop()``.
- ``start_server_process(host, port, timeout)``: runs ``kelastic-rendezvous`` as a
  child process and returns a ``ServerProcess`` once it printed its ready line;
  ``stop()`` sends SIGTERM and waits (SIGKILL after a grace period).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from kelastic.agent.storeserver import READY_PREFIX, main

__all__ = [
    "READY_PREFIX",
    "RendezvousServer",
    "ServedStore",
    "ServerProcess",
    "main",
    "serve_store",
    "start_server_process",
]

#: Server-side timeout of the store; it bounds nothing a client waits for.
_STORE_TIMEOUT = datetime.timedelta(hours=1)


@dataclass
class ServedStore:
    """A TCPStore server on a socket we bound ourselves; ``close()`` stops it.

    The store owns the listening socket (it closes it when it stops).
    """

    store: dist.TCPStore | None
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        # Dropping the last reference stops the store's server thread and closes its socket.
        self.store = None


def serve_store(host: str, port: int = 0, backlog: int = 1024) -> ServedStore:
    """Bind ``host:port`` (0 = any free port), listen, and serve a TCPStore on that socket.

    Raises OSError naming the address when it cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        bound_port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            bound_port,
            None,
            True,
            _STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it stops
    return ServedStore(store=store, host=host, port=bound_port)


class RendezvousServer:
    """An in-process rendezvous store (what ``--standalone`` uses)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._served: ServedStore | None = None

    def start(self) -> RendezvousServer:
        if self._served is None:
            self._served = serve_store(self._host, self._port)
        return self

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        if self._served is None:
            raise RuntimeError("RendezvousServer.port read before start()")
        return self._served.port

    @property
    def endpoint(self) -> str:
        if self._served is None:
            raise RuntimeError("RendezvousServer.endpoint read before start()")
        return self._served.endpoint

    def stop(self) -> None:
        if self._served is not None:
            self._served.close()
            self._served = None

    def __enter__(self) -> RendezvousServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ServerProcess:
    """A ``kelastic-rendezvous`` child process."""

    proc: subprocess.Popen[str]
    host: str
    port: int
    output: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM, wait up to ``grace`` s, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_server_process(
    host: str, port: int, timeout: float = 30.0, args: Sequence[str] = ()
) -> ServerProcess:
    """Start ``kelastic-rendezvous --host host --port port [args]``; return once it is serving.

    Raises RuntimeError with the process output if it exits or is not ready in time.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kelastic.agent.storeserver", "--host", host, "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")},
    )
    lines: list[str] = []
    ready = threading.Event()
    bound: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(READY_PREFIX):
                bound.append(int(line.strip().rsplit(":", 1)[1]))
                ready.set()
        ready.set()

    threading.Thread(target=read, name="kelastic-rdzv-server-output", daemon=True).start()
    if not ready.wait(timeout) or not bound:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5.0)
        output = "\n".join(lines[-20:])
        raise RuntimeError(
            f"kelastic-rendezvous on {host}:{port} did not become ready within {timeout:.0f}s "
            f"(exit code {proc.returncode}); output:\n{output}"
        )
    return ServerProcess(proc=proc, host=host, port=bound[0], output=lines)

"""The rendezvous store process: ``kelastic-rendezvous --host H --port P``.

It serves a ``torch.distributed.TCPStore`` and nothing else; agents and the
operator keep all protocol state in it (see ``handler`` and ``protocol``). It runs
in its own pod, never in a worker, so a worker failure cannot take it down.

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

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = [
    "READY_PREFIX",
    "RendezvousServer",
    "ServedStore",
    "ServerProcess",
    "main",
    "serve_store",
    "start_server_process",
]

READY_PREFIX = "kelastic-rendezvous: serving on "

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


def start_server_process(host: str, port: int, timeout: float = 30.0) -> ServerProcess:
    """Start ``kelastic-rendezvous --host host --port port``; return once it is serving.

    Raises RuntimeError with the process output if it exits or is not ready in time.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kelastic.agent.rendezvous", "--host", host, "--port", str(port)],
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kelastic-rendezvous",
        description="Serve the kelastic rendezvous store (a torch TCPStore) in the foreground.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400, help="port to bind (default: 29400; 0 = any free)")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port} is outside 0..65535")
    return args


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; exit 0 on a clean stop, 1 if the address cannot be bound."""
    args = _parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        served = serve_store(args.host, args.port)
    except OSError as exc:
        print(f"kelastic-rendezvous: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    print(f"{READY_PREFIX}{served.endpoint}", flush=True)
    started = time.monotonic()
    while not stop.wait(3600):
        pass
    served.close()
    print(f"kelastic-rendezvous: stopped after {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rendezvous store process: ``kelastic-rendezvous --host H --port P``.

It serves torch's ``TCPStore`` protocol and nothing else; agents and the
operator keep all protocol state in it (see ``handler`` and ``protocol``). It runs
in its own pod, never in a worker, so a worker failure cannot take it down. It holds
what clients write within bounds (``--max-value-bytes``, ``--max-keys``,
``--max-total-bytes``, ``--max-connections``; :mod:`.boundedstore`), refusing with a log
line what exceeds them, so a stranger who reaches it cannot grow it without bound.

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
import asyncio
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from kelastic.agent.checkpoint.settings import parse_quantity

from .boundedstore import KEY_OVERHEAD as KEY_COST
from .boundedstore import BoundedStore, StoreLimits

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


def start_server_process(
    host: str, port: int, timeout: float = 30.0, args: Sequence[str] = ()
) -> ServerProcess:
    """Start ``kelastic-rendezvous --host host --port port [args]``; return once it is serving.

    Raises RuntimeError with the process output if it exits or is not ready in time.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kelastic.agent.rendezvous", "--host", host, "--port", str(port), *args],
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


def _quantity(text: str) -> int:
    try:
        value = parse_quantity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = StoreLimits()
    parser = argparse.ArgumentParser(
        prog="kelastic-rendezvous",
        description="Serve the kelastic rendezvous store (torch's TCPStore protocol, within bounds) "
        "in the foreground.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400, help="port to bind (default: 29400; 0 = any free)")
    parser.add_argument(
        "--max-value-bytes",
        type=_quantity,
        default=defaults.value_bytes,
        help="largest value a client may write (default: 1Mi; a job's largest, the controller's "
        "membership, is about 40 bytes per node)",
    )
    parser.add_argument(
        "--max-keys",
        type=_quantity,
        default=defaults.keys,
        help="keys the store holds at most (default: 1000000)",
    )
    parser.add_argument(
        "--max-total-bytes",
        type=_quantity,
        default=defaults.total_bytes,
        help=f"bytes of all keys and values at most, {KEY_COST} more per key (default: 128Mi)",
    )
    parser.add_argument(
        "--max-connections",
        type=_quantity,
        default=defaults.connections,
        help="client connections at once (default: 4096)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        help="seconds a client has to send the rest of a request it began (default: 30); an idle "
        "client, one that sent no part of a request, is never cut off",
    )
    args = parser.parse_args(argv)
    if not args.request_timeout > 0:
        parser.error(f"--request-timeout {args.request_timeout} must be > 0")
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port} is outside 0..65535")
    return args


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> int:
    limits = StoreLimits(
        value_bytes=args.max_value_bytes,
        keys=args.max_keys,
        total_bytes=args.max_total_bytes,
        connections=args.max_connections,
        request_timeout=args.request_timeout,
    )
    store = BoundedStore(limits)
    try:
        server = await asyncio.start_server(
            store.serve, args.host, args.port, reuse_address=True, backlog=1024
        )
    except OSError as exc:
        print(
            f"kelastic-rendezvous: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    port = server.sockets[0].getsockname()[1]
    endpoint = f"[{args.host}]:{port}" if ":" in args.host else f"{args.host}:{port}"
    print(f"{READY_PREFIX}{endpoint}", flush=True)
    print(
        f"kelastic-rendezvous: bounds: values up to {limits.value_bytes} bytes, {limits.keys} keys, "
        f"{limits.total_bytes} bytes in all, {limits.connections} connections",
        flush=True,
    )
    async with server:
        await stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; exit 0 on a clean stop, 1 if the address cannot be bound."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    started = time.monotonic()

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            # Said, so that a pod's log shows whether a slow stop began with the signal or after it.
            print(f"kelastic-rendezvous: {signal.Signals(signum).name}: stopping", flush=True)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        return await _serve(args, stop)

    code = asyncio.run(run())
    if code == 0:
        print(f"kelastic-rendezvous: stopped after {time.monotonic() - started:.1f}s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

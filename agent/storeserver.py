"""``kelastic-rendezvous``: the job's rendezvous store process, without torch.

It serves torch's ``TCPStore`` protocol within bounds (:mod:`kelastic.agent.boundedstore`)
until SIGTERM or SIGINT. It imports nothing of torch: ``import torch`` alone makes a process
about 500 MiB resident, the whole of the store pod's memory limit, while this process needs
about 20 MiB besides what it holds (docs/security.md: the store's bounds and its memory).
``kelastic.agent.rendezvous.server`` starts it as a child process (``start_server_process``)
and serves the per-round worker stores, which are torch's own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from kelastic.agent.boundedstore import KEY_OVERHEAD as KEY_COST
from kelastic.agent.boundedstore import READ_CHUNK, BoundedStore, StoreLimits
from kelastic.agent.checkpoint.settings import parse_quantity

__all__ = ["READY_PREFIX", "main"]

READY_PREFIX = "kelastic-rendezvous: serving on "


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
        "--max-buffer-bytes",
        type=_quantity,
        default=defaults.buffer_bytes,
        help="bytes held for requests in flight at once: keys and values being read, answers being "
        "sent, the keys of waits (default: 64Mi)",
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
        buffer_bytes=args.max_buffer_bytes,
    )
    store = BoundedStore(limits)
    try:
        server = await asyncio.start_server(
            store.serve, args.host, args.port, reuse_address=True, backlog=1024, limit=READ_CHUNK
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
        f"{limits.total_bytes} bytes in all, {limits.connections} connections, "
        f"{limits.buffer_bytes} bytes of requests in flight",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        # Stop listening, then cut the clients off: busy ones would otherwise keep their
        # connections served past the stop (BoundedStore.close_connections).
        server.close()
        store.close_connections()
        await store.served()
        await server.wait_closed()
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

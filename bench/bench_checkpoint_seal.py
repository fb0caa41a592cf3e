"""What sealing costs a replica: a part of ``--mib`` MiB put and read back over loopback,
sealed (the checkpoint service's TLS connections) and unsealed (the same bytes with
``sendfile`` on a plain TCP connection, as the service sent them before it sealed them).

Starts a real checkpoint service in this process (its own tmpfs folder, loopback, real
sockets) and times, ``--rounds`` times each: ``put`` of a tmpfs file as a replica (the
service writes it into its tmpfs), and ``get`` of the whole file into a buffer; then the
unsealed path (``sendfile`` to a receiver that writes into a tmpfs file, and ``sendfile``
into a buffer). Prints the medians in seconds and GiB/s, and the ratio sealed / unsealed.
Asserts nothing.

    python bench/bench_checkpoint_seal.py [--mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

_CHUNK = 4 * 2**20


def _timed(rounds: int, f: Callable[[int], None]) -> float:
    times = []
    for i in range(rounds):
        began = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], min(len(view) - got, _CHUNK))
        if n == 0:
            raise ConnectionError("closed early")
        got += n


def _unsealed(src: Path, size: int, rounds: int, root: Path) -> tuple[float, float]:
    """(put, get) medians of the unsealed path: sendfile into a tmpfs file, and into a buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    addr = listener.getsockname()
    mode = {"write": True}

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                if mode["write"]:  # a replica arriving: into a tmpfs file, in pieces
                    buf = bytearray(_CHUNK)
                    view = memoryview(buf)
                    with open(root / f"in-{uuid.uuid4().hex[:6]}", "wb") as f:
                        left = size
                        while left:
                            k = min(left, _CHUNK)
                            _recv_exact(conn, view[:k])
                            f.write(view[:k])
                            left -= k
                    conn.sendall(b"k")
                else:  # a get: the file with sendfile
                    with open(src, "rb") as f:
                        conn.sendfile(f, 0, size)

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    def put(_: int) -> None:
        with socket.create_connection(addr) as c, open(src, "rb") as f:
            c.sendfile(f, 0, size)
            c.recv(1)

    into = bytearray(size)

    def get(_: int) -> None:
        with socket.create_connection(addr) as c:
            _recv_exact(c, memoryview(into))

    put_s = _timed(rounds, put)
    for p in root.glob("in-*"):
        p.unlink()
    mode["write"] = False
    get_s = _timed(rounds, get)
    listener.close()
    return put_s, get_s


def _sealed(src: Path, size: int, rounds: int, root: Path) -> tuple[float, float]:
    """(put, get) medians through a real checkpoint service (TLS, its handshake, its framing)."""
    from kelastic.agent.checkpoint.client import ServiceClient
    from kelastic.agent.checkpoint.service import CheckpointService
    from kelastic.agent.checkpoint.settings import CheckpointSettings
    from kelastic.agent.secret import JobSecret, SecretSource

    key = secrets.token_hex(32).encode()
    settings = CheckpointSettings(root=root / "svc", limit=(rounds + 2) * size + 2**20, node="bench")
    service = CheckpointService(settings, JobSecret(key, SecretSource.FILE), host="127.0.0.1").start()
    client = ServiceClient(service.endpoint, key, timeout=300)
    try:
        put_s = _timed(rounds, lambda i: client.put_file(1, f"__{i}.mem", src, size))
        into = memoryview(bytearray(size))

        def get(i: int) -> None:
            header = {"op": "get", "id": 1, "name": f"__{i}.mem", "offset": 0, "length": size}
            client.call(header, into=into)

        get_s = _timed(rounds, get)
    finally:
        client.close()
        service.stop()
    return put_s, get_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="size of the part (default 512)")
    p.add_argument("--rounds", type=int, default=3, help="puts and gets timed each (default 3)")
    a = p.parse_args()
    size = a.mib * 2**20
    root = Path("/dev/shm") / f"kelastic-bench-seal-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        src = root / "part"
        with open(src, "wb") as f:
            for _ in range(a.mib):
                f.write(os.urandom(2**20))
        unsealed = _unsealed(src, size, a.rounds, root)
        sealed = _sealed(src, size, a.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = size / 2**30
    print(f"a replica of {a.mib} MiB over loopback, median of {a.rounds}:")
    print(f"{'':8} {'unsealed (sendfile)':>22} {'sealed (TLS 1.3)':>22} {'ratio':>7}")
    for what, u, s in (("put", unsealed[0], sealed[0]), ("get", unsealed[1], sealed[1])):
        print(f"{what:8} {u:9.3f} s {gib / u:6.2f} GiB/s {s:9.3f} s {gib / s:6.2f} GiB/s {s / u:6.2f}x")


if __name__ == "__main__":
    main()

"""The store's memory against a stranger: ``kelastic-rendezvous`` stays within its pod's limit.

The store pod's memory limit is 512 MiB (``operator/builders.py``). The store process holds no
torch (about 25 MiB at rest), what clients stored (``--max-total-bytes``, 128 MiB, each key
counted with its overhead), what requests in flight hold (``--max-buffer-bytes``, 64 MiB: the
keys and values being read, the answers being sent, the keys of waits) and what each
connection buffers (about 3 x 4 KiB, ``--max-connections`` 4096). A stranger fills every one
of them at once with raw sockets; the store's peak resident memory stays under the sum of
those bounds, and a job's client is still served.
"""

from __future__ import annotations

import datetime
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

MiB = 2**20
MAGIC = struct.pack("<I", 0x3C85F7CE)
#: The store pod's memory limit (operator/builders.py).
POD_LIMIT_MIB = 512

pytestmark = pytest.mark.slow


def memory_mib(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) of ``pid``, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def vec(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def stranger(server: ServerProcess) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(b"\x00" + MAGIC)
    return s


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server_process("127.0.0.1", 0)  # the pod's defaults
    yield srv
    srv.stop()


def test_a_stranger_who_fills_every_bound_at_once_stays_within_the_pods_limit(server: ServerProcess) -> None:
    rest, _ = memory_mib(server.pid)
    assert rest < 64, f"the store process takes {rest:.0f} MiB at rest: does it import torch?"
    job = dist.TCPStore(server.host, server.port, None, False, datetime.timedelta(seconds=10))
    job.set("kelastic/run/progress/a", "{}")
    # 1. the stored bytes: values of 1 MiB until the total refuses them
    s = stranger(server)
    for i in range(160):
        try:
            s.sendall(b"\x01" + vec(f"junk/{i}".encode()) + vec(b"x" * MiB) + b"\x07")
            s.recv(8)
        except OSError:
            s = stranger(server)
    # 2. the buffer: half a 1 MiB value, then silence, on 200 connections
    held = []
    # (A connection the store cuts while it sends, once the bytes in flight reach the bound,
    # is the bound at work: the stranger opens the next one.)
    for i in range(200):
        c = stranger(server)
        try:
            c.sendall(b"\x01" + vec(f"half/{i}".encode()) + struct.pack("<Q", MiB) + b"y" * (MiB // 2))
        except OSError:
            c.close()
            continue
        held.append(c)
    # 3. multi_gets of 64 MiB each whose answers nobody reads
    for _ in range(50):
        c = stranger(server)
        try:
            c.sendall(
                b"\x0a" + struct.pack("<Q", 64) + b"".join(vec(f"junk/{j}".encode()) for j in range(64))
            )
        except OSError:
            c.close()
            continue
        held.append(c)
    # 4. connections up to the limit, each with requests whose answers it never reads
    for _ in range(3800):
        c = stranger(server)
        c.setblocking(False)
        try:
            c.send((b"\x03" + vec(b"kelastic/run/progress/a")) * 4000)
        except OSError:
            pass
        held.append(c)
    time.sleep(2)
    now, peak = memory_mib(server.pid)
    print(f"store memory: {rest:.0f} MiB at rest, {now:.0f} MiB under attack, peak {peak:.0f} MiB")
    # the bounds: 32 at rest, 128 stored (+10% for Python's objects), 64 buffered, 4096 x 24 KiB
    bound = 32 + 128 * 1.1 + 64 + 4096 * 24 / 1024
    assert peak < bound < POD_LIMIT_MIB, (peak, bound)
    text = "\n".join(server.output)
    assert "(--max-total-bytes" in text and "(--max-buffer-bytes" in text, text[-3000:]
    for c in held:
        c.close()
    assert job.get("kelastic/run/progress/a") == b"{}"
    job.set("kelastic/run/progress/a", "{1}")
    assert job.get("kelastic/run/progress/a") == b"{1}"

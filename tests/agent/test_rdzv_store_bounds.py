"""``kelastic-rendezvous`` as a stranger uses it: values, keys and bytes over its bounds are
refused with a line saying what, and its memory stays bounded; torch's clients work as before.

A real ``kelastic-rendezvous`` process, torch's own ``TCPStore`` client and raw sockets.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

MiB = 2**20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def client(server: ServerProcess) -> dist.TCPStore:
    return dist.TCPStore(server.host, server.port, None, False, datetime.timedelta(seconds=10))


def output(server: ServerProcess) -> str:
    return "\n".join(server.output)


def wait_output(server: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in output(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in output(server), output(server)


def refused_write(server: ServerProcess, key: str, value: bytes) -> bool:
    """Write as a stranger on a connection of its own; whether the store cut it off for it."""
    s = client(server)
    try:
        s.set(key, value)  # a set has no reply: the refusal shows on the next request
        s.check([key])
    except dist.DistError:
        return True
    return False


def closed(sock: socket.socket) -> bool:
    """Whether the store closed ``sock`` (read to its end, or reset for bytes it left unread)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server_process("127.0.0.1", 0, args=["--request-timeout", "1"])
    yield srv
    srv.stop()


@pytest.fixture
def small() -> Iterator[ServerProcess]:
    srv = start_server_process(
        "127.0.0.1", 0, args=["--max-value-bytes", "1Mi", "--max-total-bytes", "8Mi", "--max-keys", "500"]
    )
    yield srv
    srv.stop()


def test_values_over_the_cap_are_refused_unread_and_the_store_does_not_grow(server: ServerProcess) -> None:
    """24 values of 4 MiB (and one of 64 MiB) from a stranger: none is kept, the RSS stays."""
    job = client(server)
    job.set("kelastic/run/progress/a", "{}")
    before = rss_mib(server.pid)
    started = time.monotonic()
    for i in range(24):
        assert refused_write(server, f"kelastic/run/junk/{i}", b"x" * (4 * MiB))
    assert refused_write(server, "kelastic/run/junk/big", b"x" * (64 * MiB))
    assert rss_mib(server.pid) - before < 16, (before, rss_mib(server.pid))
    wait_output(server, "refused a value of 4194304 bytes (--max-value-bytes 1048576), unread from 127.0.0.1")
    assert not job.check(["kelastic/run/junk/0"]) and job.get("kelastic/run/progress/a") == b"{}"
    # 25 refusals, one line per 10 s of them (more than one only on a machine slow enough to
    # take longer than that over them)
    lines, allowed = output(server).count("refused a value"), 1 + int((time.monotonic() - started) // 10)
    assert 1 <= lines <= allowed, f"{lines} lines for 25 refusals: each kind is logged at most every 10 s"


def test_the_keys_and_the_total_are_capped_and_freed_by_deletes(small: ServerProcess) -> None:
    job = client(small)
    refused = 0
    for i in range(12):  # 12 MiB against a total of 8 MiB
        refused += refused_write(small, f"fill/{i}", b"y" * (MiB - 4096))
    assert refused >= 4
    wait_output(small, "(--max-total-bytes 8388608)")
    held = sum(job.check([f"fill/{i}"]) for i in range(12))
    assert 5 <= held <= 8, held
    # deleting frees room: the job writes again
    for i in range(12):
        job.delete_key(f"fill/{i}")
    job.set("kelastic/run/progress/a", b"z" * (MiB // 2))
    assert len(job.get("kelastic/run/progress/a")) == MiB // 2
    # at most 500 keys, new ones refused; existing ones still change
    many = client(small)
    with pytest.raises(dist.DistError):
        for i in range(600):
            many.add(f"k/{i}", 1)
    assert job.num_keys() <= 500
    wait_output(small, "(--max-keys 500)")
    assert job.add("k/0", 1) == 2


@pytest.mark.slow  # waits out the store's request timeout (3 s)
def test_a_stranger_that_speaks_no_tcpstore_or_half_a_request_is_cut_off(server: ServerProcess) -> None:
    host, port = server.host, server.port
    http = socket.create_connection((host, port), timeout=10)
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed(http)  # nothing answered
    half = socket.create_connection((host, port), timeout=10)
    half.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 10) + b"kel")
    assert closed(half)  # cut off at --request-timeout (1 s here)
    wait_output(server, "not sent whole within 1s")
    idle = socket.create_connection((host, port), timeout=10)
    idle.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE))  # validated, then idle: kept
    idle.settimeout(2.0)
    with pytest.raises(TimeoutError):
        idle.recv(1)
    idle.sendall(b"\x0d" + struct.pack("<I", 7))  # a ping still answers
    idle.settimeout(10)
    assert idle.recv(4) == struct.pack("<I", 7)


def test_a_counter_a_stranger_overwrote_with_text_counts_again_from_zero(server: ServerProcess) -> None:
    job, stranger = client(server), client(server)
    job.add("kelastic/run/hb/a", 5)
    stranger.set("kelastic/run/hb/a", "not a number")
    assert stranger.get("kelastic/run/hb/a") == b"not a number"  # the set was served
    assert job.add("kelastic/run/hb/a", 1) == 1
    assert job.add("kelastic/run/hb/a", 1) == 2


def test_torchs_client_sees_the_store_it_knows(server: ServerProcess) -> None:
    s = client(server)
    s.set("a", "1")
    assert s.get("a") == b"1" and s.add("c", 5) == 5 and s.add("c", 2) == 7
    assert s.compare_set("a", "1", "2") == b"2" and s.compare_set("a", "x", "3") == b"2"
    assert s.compare_set("n", "", "v") == b"v"
    assert s.compare_set("m", "e", "v") == b"e" and not s.check(["m"])
    s.multi_set(["x", "y"], ["1", "2"])
    assert s.multi_get(["x", "y"]) == [b"1", b"2"]
    assert s.delete_key("x") and not s.delete_key("x")
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], datetime.timedelta(seconds=0.2))
    s.set("after", "ok")  # the connection is in step after a cancelled wait
    assert s.get("after") == b"ok"
    s.append("ap", "x")
    s.append("ap", "y")
    assert s.get("ap") == b"xy" and s.num_keys() == 6  # a, c, n, y, after, ap


def test_sigterm_stops_the_store_at_once_though_its_clients_are_busy(server: ServerProcess) -> None:
    """Clients that send request after request (agents polling a round) do not keep the store
    serving past SIGTERM: it cuts them off and exits by itself, not by the SIGKILL that
    ``stop`` sends after its grace period (as it did when only its tasks were cancelled)."""
    connected, served = threading.Semaphore(0), threading.Semaphore(0)
    cut_off: list[BaseException] = []

    def busy(name: str) -> None:
        s = client(server)
        connected.release()
        try:
            while True:
                s.add(f"kelastic/run/hb/{name}", 1)
                s.check(["kelastic/run/closed"])
                served.release()
        except dist.DistError as exc:
            cut_off.append(exc)

    threads = [threading.Thread(target=busy, args=(f"n{i}",), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert connected.acquire(timeout=30), "a client could not connect"
    for _ in range(30):  # the clients are served again and again: they are busy when the signal comes
        assert served.acquire(timeout=30), "a client was not served"
    # The grace is long: a store that waits for its busy clients is killed only after it, and
    # its exit code then says so (-9), whatever the machine's load.
    assert server.stop(grace=30) == 0, "\n".join(server.output[-10:])
    assert "kelastic-rendezvous: stopped after" in output(server)
    for thread in threads:
        thread.join(30)
    assert len(cut_off) == 8, f"{8 - len(cut_off)} of 8 clients were not cut off: {cut_off}"

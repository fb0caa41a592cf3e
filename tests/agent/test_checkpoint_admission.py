"""The checkpoint service's connection table (``agent/checkpoint/admission.py``): which
connection gives way to a new one, decided without a socket being read or written.

The sockets are unconnected ``socket.socket`` objects: the table only keys on them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kelastic.agent.checkpoint.admission import Admission, State


@pytest.fixture
def made() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def new(made: list[socket.socket]) -> socket.socket:
    s = socket.socket()
    made.append(s)
    time.sleep(0.001)  # distinct monotonic times: "oldest" is well defined
    return s


def admitted(
    table: Admission, made: list[socket.socket], source: str, *, preferred: bool = True
) -> socket.socket:
    """A new connection from ``source`` that proves the key and is served (idle)."""
    s = new(made)
    table.arrive(s, source)
    assert table.authenticated(s, wait=0, preferred=preferred)[0]
    return s


def test_a_flood_of_silent_handshakes_from_many_addresses_is_bounded_and_the_oldest_goes(
    made: list[socket.socket],
) -> None:
    table = Admission(connections=8, handshakes=8)
    silent = [new(made) for _ in range(32)]
    evicted: list[socket.socket] = []
    for i, s in enumerate(silent):  # 16 addresses, 2 each: within one address's quarter
        evicted += table.arrive(s, f"10.0.0.{i % 16}")
        assert table.states()[State.PROVING] <= 8
    # each arrival past the cap cut the oldest of all, in arrival order
    assert evicted == silent[:24]
    client = new(made)
    assert table.arrive(client, "10.1.0.1") == [silent[24]]
    ok, replaced = table.authenticated(client, wait=0, preferred=True)
    assert ok and replaced == []


def test_one_address_holds_a_quarter_of_the_handshakes_and_evicts_only_its_own(
    made: list[socket.socket],
) -> None:
    table = Admission(connections=8, handshakes=8)
    other = new(made)
    assert table.arrive(other, "10.0.0.2") == []
    mine = [new(made) for _ in range(5)]
    evicted = [e for s in mine for e in table.arrive(s, "10.0.0.9")]
    assert evicted == mine[:3]  # past its 2, the oldest of its own address
    assert other in table.sockets()
    assert table.states()[State.PROVING] == 3


def test_a_stranger_address_holds_an_eighth_of_the_connections(made: list[socket.socket]) -> None:
    table = Admission(connections=16, handshakes=16)
    results = []
    for _ in range(4):
        s = new(made)
        table.arrive(s, "10.0.0.7")
        results.append(table.authenticated(s, wait=0, preferred=False)[0])
    assert results == [True, True, False, False]
    admitted(table, made, "10.0.0.1")  # a preferred address is not held to the share


def test_a_full_table_replaces_a_stranger_s_idle_connection_before_a_preferred_one(
    made: list[socket.socket],
) -> None:
    table = Admission(connections=4, handshakes=8)
    ring = [admitted(table, made, f"10.0.1.{i}") for i in range(3)]
    stranger = admitted(table, made, "10.0.9.9", preferred=False)
    table.busy(ring[0])
    table.idle(ring[0])  # ring[1] and ring[2] have been idle longer than the stranger
    late = new(made)
    table.arrive(late, "10.0.1.5")
    ok, replaced = table.authenticated(late, wait=0, preferred=True)
    assert ok and replaced == [stranger]


def test_a_preferred_connection_busy_is_never_replaced_and_a_newcomer_waits_for_a_place(
    made: list[socket.socket],
) -> None:
    table = Admission(connections=2, handshakes=8)
    busy = [admitted(table, made, f"10.0.1.{i}") for i in range(2)]
    assert all(table.busy(s) for s in busy)
    waiting = new(made)
    table.arrive(waiting, "10.0.1.7")
    assert table.authenticated(waiting, wait=0.05, preferred=True) == (False, [])
    assert set(table.sockets()) >= set(busy)

    again = new(made)
    table.arrive(again, "10.0.1.8")
    threading.Timer(0.1, table.idle, args=(busy[0],)).start()
    ok, replaced = table.authenticated(again, wait=10, preferred=True)
    assert ok and replaced == [busy[0]]  # the place freed: the idler gives way at once


def test_a_preferred_newcomer_replaces_a_stranger_s_busy_connection_when_none_is_idle(
    made: list[socket.socket],
) -> None:
    table = Admission(connections=2, handshakes=8)
    ring = admitted(table, made, "10.0.1.1")
    stranger = admitted(table, made, "10.0.9.9", preferred=False)
    table.busy(ring)
    table.busy(stranger)
    rank = new(made)
    table.arrive(rank, "10.0.1.1")
    ok, replaced = table.authenticated(rank, wait=0, preferred=True)
    assert ok and replaced == [stranger]
    assert not table.busy(stranger)  # its next request finds it replaced
    # a stranger never cuts a busy connection: it waits and gives up
    table.busy(rank)
    late = new(made)
    table.arrive(late, "10.0.9.8")
    assert table.authenticated(late, wait=0.05, preferred=False) == (False, [])


def test_a_connection_replaced_while_proving_is_not_admitted(made: list[socket.socket]) -> None:
    table = Admission(connections=8, handshakes=4)
    first = new(made)
    table.arrive(first, "10.0.0.1")
    for i in range(4):
        table.arrive(new(made), f"10.0.0.{i + 2}")
    assert first not in table.sockets()
    assert table.authenticated(first, wait=0, preferred=True) == (False, [])
    assert not table.leave(first)

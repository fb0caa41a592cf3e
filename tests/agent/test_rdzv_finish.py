"""The exit barrier's marks (``agent/rendezvous/finish.py``) over a real TCPStore."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from kelastic.agent.rendezvous.finish import FinishMark
from kelastic.agent.rendezvous.protocol import RunKeys, read_counter
from kelastic.agent.rendezvous.rounds import Member

KEYS = RunKeys("finish")


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield store


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def never_lost(store: dist.TCPStore, r: int) -> bool:
    return False


def test_the_barrier_passes_once_every_rank_is_marked(server: dist.TCPStore) -> None:
    a, b = FinishMark(KEYS, never_lost), FinishMark(KEYS, never_lost)
    ca, cb = client(server), client(server)
    assert a.all_finished(ca, Member(round=3, rank=0, size=2, successor="b")) is None
    assert a.all_finished(ca, Member(round=3, rank=0, size=2, successor="b")) is None, (
        "asked again: still not"
    )
    assert read_counter(server, KEYS.finished_count(3)) == 1, "a mark is written once per connection"
    assert b.all_finished(cb, Member(round=3, rank=1, size=2, successor="a")) is True
    assert a.all_finished(ca, Member(round=3, rank=0, size=2, successor="b")) is True


def test_a_member_that_reconnected_counts_twice_but_the_keys_decide(server: dist.TCPStore) -> None:
    a = FinishMark(KEYS, never_lost)
    member = Member(round=1, rank=0, size=2, successor="b")
    assert a.all_finished(client(server), member) is None
    assert a.all_finished(client(server), member) is None  # a new connection: marked again
    assert read_counter(server, KEYS.finished_count(1)) == 2
    assert not server.check([KEYS.finished(1, 1)])


def test_a_store_that_lost_the_marks_gets_them_again(server: dist.TCPStore) -> None:
    a, b = FinishMark(KEYS, never_lost), FinishMark(KEYS, never_lost)
    assert a.all_finished(client(server), Member(round=1, rank=0, size=2, successor="b")) is None
    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))  # "restarted"
    ca2, cb2 = client(fresh), client(fresh)
    assert b.all_finished(cb2, Member(round=1, rank=1, size=2, successor="a")) is None
    assert a.all_finished(ca2, Member(round=1, rank=0, size=2, successor="b")) is True


def test_a_lost_member_that_had_not_finished_ends_the_barrier(server: dist.TCPStore) -> None:
    lost: list[int] = []
    a = FinishMark(KEYS, lambda store, r: r in lost)
    ca = client(server)
    member = Member(round=2, rank=0, size=3, successor="b")
    assert a.all_finished(ca, member) is None
    lost.append(2)
    assert a.all_finished(ca, member) is False

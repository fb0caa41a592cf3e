"""What the fates of a node's own round decide without a timer (rendezvous/fastpath.py, pure),
and a handler's ``round_over`` against a real store."""

from __future__ import annotations

import time

import pytest

from kelastic.agent.rendezvous import ServerProcess, fastpath
from kelastic.agent.rendezvous.testing import in_thread, kelastic_handler, rendezvous_concurrently


@pytest.mark.parametrize(
    ("accounted", "lost", "verdict"),
    [(0, False, None), (1, False, False), (2, True, True), (0, True, True)],
)
def test_a_failure_is_a_loss_once_a_member_is_lost_and_not_once_a_peer_rejoined(
    accounted: int, lost: bool, verdict: bool | None
) -> None:
    assert fastpath.loss_verdict(accounted, lost) is verdict


@pytest.mark.parametrize(
    ("accounted", "lost", "size", "verdict"),
    [
        (0, False, 3, True),  # not even this node's own re-join: the store lost the round
        (1, False, 3, None),
        (3, False, 3, False),
        (2, True, 3, True),
    ],
)
def test_the_round_left_lost_a_member(accounted: int, lost: bool, size: int, verdict: bool | None) -> None:
    assert fastpath.previous_loss_verdict(accounted, lost, size) is verdict


def test_a_round_is_over_once_any_member_has_a_fate() -> None:
    assert not fastpath.round_over(0)
    assert fastpath.round_over(1)


def test_a_member_that_rejoins_ends_the_round_for_the_others_but_a_newcomer_does_not(
    server: ServerProcess, run_id: str
) -> None:
    conf = {"last_call_timeout": 0.3, "join_timeout": 20}
    a, b = (kelastic_handler(server.endpoint, run_id, n, 2, 3, **conf) for n in ("a", "b"))
    rendezvous_concurrently([a, b])
    assert not a.round_over() and not b.round_over()
    newcomer = kelastic_handler(server.endpoint, run_id, "c", 2, 3, **conf)
    waiting, out_c = in_thread(newcomer.next_rendezvous)
    assert a.wait_membership_change(10), "the newcomer's wait is a membership change"
    assert not a.round_over(), "a node waiting to join does not end the round"
    rejoining, out_b = in_thread(b.next_rendezvous)  # b re-joins (its workers failed)
    deadline = time.monotonic() + 10
    while not a.round_over():
        assert time.monotonic() < deadline, "b's re-join did not end round 1 for a"
        time.sleep(0.02)
    assert not kelastic_handler(server.endpoint, run_id, "d", 2, 3, **conf).round_over()  # no member
    (info_a,) = rendezvous_concurrently([a])
    waiting.join(10)
    rejoining.join(10)
    assert info_a.world_size == 3
    assert [o.world_size for o in (*out_b, *out_c)] == [3, 3], (out_b, out_c)

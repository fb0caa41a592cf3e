"""Whether a failure of a node's workers was caused by a lost peer (``wait_member_lost``),
with real handlers over a real store process, and what the agent makes of the answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo

from kelastic.agent.rendezvous import ServerProcess
from kelastic.agent.rendezvous.handler import KelasticRendezvousHandler
from kelastic.agent.rendezvous.testing import kelastic_handler, rendezvous_concurrently, shutdown_handlers


@pytest.fixture(autouse=True)
def _handlers() -> Iterator[None]:
    yield
    shutdown_handlers()


def _round_of_three(server: ServerProcess, run_id: str) -> list[KelasticRendezvousHandler]:
    """Three members of a round, min 2 (so that two can go on without the third)."""
    nodes = [
        kelastic_handler(server.endpoint, run_id, name, 2, 3, join_timeout=30, last_call_timeout=30)
        for name in ("a", "b", "c")
    ]
    infos = rendezvous_concurrently(nodes, timeout=60)
    assert {i.world_size for i in infos} == {3}
    return nodes


def _rejoin_in_background(
    handler: KelasticRendezvousHandler,
) -> tuple[threading.Thread, list[RendezvousInfo]]:
    got: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: got.append(handler.next_rendezvous()), daemon=True)
    thread.start()
    return thread, got


def test_a_peer_that_rejoined_without_a_loss_is_no_excuse(server: ServerProcess, run_id: str) -> None:
    """Two agents whose workers failed in the same collective: the first to re-join tells the
    second at once that nobody was lost, so both spend a restart (and the second does not wait
    out its grace period)."""
    a, b, c = _round_of_three(server, run_id)
    thread, _ = _rejoin_in_background(a)
    started = time.monotonic()
    assert b.wait_member_lost(20.0) is False
    waited = time.monotonic() - started
    assert waited < 10.0, f"b waited {waited:.1f}s for a verdict a's re-join had already given"
    assert c.membership_changed(), "the round is no longer current for anyone"
    infos = rendezvous_concurrently([b, c], timeout=30)
    thread.join(30)
    assert {i.world_size for i in infos} == {3}


def test_a_peer_that_left_excuses_the_failure(server: ServerProcess, run_id: str) -> None:
    a, b, c = _round_of_three(server, run_id)
    assert a.shutdown()  # a graceful leave: fate "left"
    started = time.monotonic()
    assert b.wait_member_lost(20.0) is True
    assert c.wait_member_lost(0.0) is True
    assert time.monotonic() - started < 10.0
    infos = rendezvous_concurrently([b, c], timeout=30)
    assert {i.world_size for i in infos} == {2}


def test_no_news_is_a_failure_of_its_own_after_the_grace(server: ServerProcess, run_id: str) -> None:
    _, b, _ = _round_of_three(server, run_id)
    started = time.monotonic()
    assert b.wait_member_lost(0.5) is False
    assert time.monotonic() - started >= 0.5


def test_not_a_member_means_no_loss(server: ServerProcess, run_id: str) -> None:
    handler = kelastic_handler(server.endpoint, run_id, "alone", 1, 1)
    assert handler.wait_member_lost(5.0) is False


def test_a_peer_announcing_its_leave_excuses_the_failure_at_once(server: ServerProcess, run_id: str) -> None:
    """A pod being deleted: its agent announces it before stopping its workers (which may take
    long), so what the others' workers see meanwhile is judged a loss, not their own failure."""
    a, b, c = _round_of_three(server, run_id)
    assert not b.membership_changed()
    a.announce_leaving()
    assert b.wait_member_lost(20.0) is True
    assert not c.membership_changed(), "announcing alone does not end the round: the fate 'left' does"


def test_the_loss_notice_is_short_with_the_peer_link(server: ServerProcess, run_id: str) -> None:
    a, _, _ = _round_of_three(server, run_id)
    settings = a.settings
    assert a.loss_notice == 2 * settings.keep_alive_interval < settings.node_timeout

"""The controller protocol (what the operator does) against real agents' handlers and store."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
)

from kelastic.agent.rendezvous import (
    KelasticRendezvousHandler,
    ServerProcess,
    control,
)
from kelastic.agent.rendezvous.testing import kelastic_handler, rendezvous_concurrently


def node(server: ServerProcess, run_id: str, name: str, **conf: Any) -> KelasticRendezvousHandler:
    # A long last call: a round that closes quickly did so because of the controller.
    conf.setdefault("last_call_timeout", 30)
    conf.setdefault("join_timeout", 20)
    return kelastic_handler(server.endpoint, run_id, name, 1, 8, **conf)


def test_listed_nodes_close_the_round_without_last_call(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    control.publish_membership(store, run_id, nodes=["a", "b", "c"], min_nodes=1, max_nodes=8)
    hs = [node(server, run_id, n) for n in "abc"]
    started = time.monotonic()
    infos = rendezvous_concurrently(hs)
    assert time.monotonic() - started < 5, "the round waited for a last call"
    assert {i.world_size for i in infos} == {3}
    status = control.read_status(store, run_id)
    assert status.round == 1 and sorted(status.members) == ["a", "b", "c"]
    assert status.waiting == 0 and not status.closed


def test_unlisted_node_waits_until_listed(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=1, max_nodes=8)
    hs = [node(server, run_id, n) for n in "ab"]
    rendezvous_concurrently(hs)
    newcomer = node(server, run_id, "c")
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(newcomer.next_rendezvous()), daemon=True)
    thread.start()
    # Not listed: it must not disturb the running round.
    assert not hs[0].wait_membership_change(1.0)
    control.publish_membership(store, run_id, nodes=["a", "b", "c"], min_nodes=1, max_nodes=8)
    assert hs[0].wait_membership_change(5)
    infos = rendezvous_concurrently(hs)
    thread.join(10)
    assert {i.world_size for i in [*infos, *out]} == {3}


def test_unlisted_member_is_dropped_at_once(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    control.publish_membership(store, run_id, nodes=["a", "b", "c"], min_nodes=1, max_nodes=8)
    hs = [node(server, run_id, n) for n in "abc"]
    rendezvous_concurrently(hs)
    started = time.monotonic()
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=1, max_nodes=8)
    assert all(h.wait_membership_change(2) for h in hs)
    assert time.monotonic() - started < 1.0, "the drop was not noticed at once"
    infos = rendezvous_concurrently(hs[:2])
    assert {i.world_size for i in infos} == {2}
    assert sorted(control.read_status(store, run_id).members) == ["a", "b"]


def test_status_aggregates_progress(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    assert control.read_status(store, run_id).round == 0
    hs = [node(server, run_id, "a"), node(server, run_id, "b", local_world_size=4)]
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=2, max_nodes=2)
    rendezvous_concurrently(hs)
    status = control.read_status(store, run_id)
    assert status.progress is None
    assert status.world_size == 1 + 4  # a reported nothing yet; b joined with 4 ranks
    control.publish_progress(store, run_id, "a", step=40, total=100, restarts=1, local_world_size=2)
    control.publish_progress(store, run_id, "b", step=30, total=100, restarts=2, local_world_size=3)
    status = control.read_status(store, run_id)
    assert status.world_size == 5
    assert status.restarts == 2
    assert status.progress == control.JobProgress(step=30, total=100, fraction=0.3)
    # A node that just joined has no step yet: it counts for restarts, not for progress.
    control.publish_progress(store, run_id, "b", step=None, total=None, restarts=3)
    status = control.read_status(store, run_id)
    assert status.restarts == 3
    assert status.progress == control.JobProgress(step=40, total=100, fraction=0.4)
    # The reason of a node's latest restart after a failure (an OOM kill), as its agent said it.
    reason = "workers FAILED (rank 1 was OOM-killed (its container reached its memory limit)); 0/1 left"
    control.publish_progress(store, run_id, "a", step=41, total=100, restarts=2, failure=(reason, 1234.5))
    assert control.read_status(store, run_id).failures == (control.Failure("a", reason, 1234.5),)
    hs[1].set_closed()
    assert control.read_status(store, run_id).closed


def _report(node: str, step: int | None, total: int | None = 300) -> control.AgentReport:
    return control.AgentReport(node=node, step=step, total=total, restarts=0, local_world_size=1, time=0.0)


def test_job_progress_is_the_slowest_reported_step() -> None:
    assert control.job_progress([]) is None
    assert control.job_progress([_report("a", None)]) is None
    assert control.job_progress([_report("a", 210), _report("b", None), _report("c", 200)]) == (
        control.JobProgress(step=200, total=300, fraction=200 / 300)
    )


def test_bad_membership_is_rejected(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    with pytest.raises(ValueError, match="twice"):
        control.publish_membership(store, run_id, nodes=["a", "a"], min_nodes=1, max_nodes=2)
    with pytest.raises(ValueError, match="min_nodes"):
        control.publish_membership(store, run_id, nodes=["a"], min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match="node names"):
        control.publish_membership(store, run_id, nodes="ab", min_nodes=1, max_nodes=2)


@pytest.mark.slow
def test_connect_names_unreachable_endpoint() -> None:
    with pytest.raises(RendezvousConnectionError, match=re.escape("127.0.0.1:9")):
        control.connect("127.0.0.1:9", timeout=0.5)

"""The operator's store client against a real kelastic-rendezvous store (and a dead endpoint)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kelastic.operator.reconcile import PublishMembership
from kelastic.operator.store_client import StoreClient

server_mod = pytest.importorskip("kelastic.agent.rendezvous.server")
control = pytest.importorskip("kelastic.agent.rendezvous.control")
protocol = pytest.importorskip("kelastic.agent.rendezvous.protocol")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = server_mod.RendezvousServer("127.0.0.1", 0).start()
    try:
        yield server.endpoint
    finally:
        server.stop()


def membership(endpoint: str, nodes: tuple[str, ...], store_id: str = "s1") -> PublishMembership:
    return PublishMembership(
        reason="Membership",
        message="",
        endpoint=endpoint,
        run_id="job-uid",
        nodes=nodes,
        min_nodes=1,
        max_nodes=3,
        store_id=store_id,
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_publish_reaches_the_store_and_is_deduplicated(endpoint: str) -> None:
    client = StoreClient(refresh=60.0)

    async def scenario() -> list[bool]:
        return [
            await client.publish(membership(endpoint, ("a", "b"))),
            await client.publish(membership(endpoint, ("a", "b"))),  # unchanged: skipped
            await client.publish(membership(endpoint, ("a",))),
            await client.publish(membership(endpoint, ("a",), store_id="s2")),  # the store restarted
        ]

    try:
        assert run(scenario()) == [True, False, True, True]
    finally:
        client.close()
    store = control.connect(endpoint, timeout=5)
    got = protocol.read_membership(store, protocol.RunKeys("job-uid"))
    assert (got.nodes, got.min_nodes, got.max_nodes) == (("a",), 1, 3)


def test_read_status_of_a_fresh_run(endpoint: str) -> None:
    client = StoreClient()
    try:
        view = run(client.read(endpoint, "another-run"))
    finally:
        client.close()
    assert view is not None
    assert (view.world_size, view.members, view.step) == (0, (), None)


def test_unreachable_store_is_tolerated_and_not_hammered() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"127.0.0.1:{port}"
    client = StoreClient(connect_timeout=0.5, retry_after=30.0)

    async def scenario() -> tuple[Any, bool, float, float]:
        t0 = time.monotonic()
        first = await client.read(dead, "r")
        t1 = time.monotonic()
        published = await client.publish(membership(dead, ("a",)))
        return first, published, t1 - t0, time.monotonic() - t1

    try:
        first, published, first_took, second_took = run(scenario())
    finally:
        client.close()
    assert first is None and published is False
    assert first_took < 10.0
    assert second_took < 0.1, "within retry_after a dead store is not dialled again"

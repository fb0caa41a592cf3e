"""The operator's store client against a real kelastic-rendezvous store (and a dead endpoint)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.checkpoint import CheckpointReport, Restore, Source
from kelastic.operator.reconcile import Emit, PublishMembership, reconcile
from kelastic.operator.spec import parse_job
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


def closed_with(store: Any, keys: Any, members: list[str]) -> None:
    """Round 1 closed with ``members``, as the job's agents sign its close and member list."""
    close = protocol.RoundClose(len(members), members[0], "t", "h", 1).to_value()
    store.set(keys.size(1), keys.sign(keys.size(1), close))
    protocol.mark_closed(store, keys, 1)
    store.set(keys.members(1), keys.sign(keys.members(1), json.dumps(members)))


def agents_signer(client: StoreClient, run_id: str) -> tuple[Any, Any]:
    """The signer and keys of ``run_id``'s records as its agents make them: under the secret
    the operator derives for the job (its Secret's value)."""
    from kelastic.agent.rendezvous.records import RecordSigner

    signer = RecordSigner.for_job(client.job_secret(run_id).encode())
    return signer, protocol.RunKeys(run_id, signer)


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


def _dead_endpoint() -> str:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.slow
def test_a_store_not_reachable_yet_is_one_readable_line_then_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = _dead_endpoint()
    client = StoreClient(connect_timeout=0.3, retry_after=0.0, report_every=3600.0)
    caplog.set_level(logging.INFO, logger="kelastic.operator.store_client")
    try:
        assert run(client.read(dead, "r")) is None
        assert run(client.read(dead, "r")) is None  # within report_every: silent
        client._conns[dead].next_report = 0.0  # as if report_every had passed
        assert run(client.read(dead, "r")) is None
    finally:
        client.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"rendezvous store {dead} not reachable yet (")
    assert lines[1].startswith(f"rendezvous store {dead} still not reachable after ")
    assert all("\n" not in line and "frame #" not in line for line in lines)


def test_other_store_errors_stay_visible_each_time(caplog: pytest.LogCaptureFixture, endpoint: str) -> None:
    client = StoreClient(retry_after=0.0)

    def broken(store: Any, arg: Any) -> None:
        raise ValueError(f"bad run id {arg!r}\nsecond line")

    caplog.set_level(logging.INFO, logger="kelastic.operator.store_client")
    try:
        for _ in range(2):
            assert run(client._call(endpoint, broken, "x")) is None
    finally:
        client.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"rendezvous store {endpoint}: ValueError: bad run id 'x'"
    ] * 2


@pytest.mark.slow
def test_the_operator_process_prints_no_cpp_stack_trace_for_an_unreachable_store(tmp_path: Path) -> None:
    script = (
        "import asyncio, logging\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from kelastic.operator.store_client import StoreClient\n"
        "client = StoreClient(connect_timeout=0.5, retry_after=0.0)\n"
        f"for _ in range(3): asyncio.run(client.read({_dead_endpoint()!r}, 'r'))\n"
        "client.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "frame #" not in done.stderr and "socket.cpp" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "not reachable yet" in done.stderr


def test_an_agents_checkpoint_record_reaches_the_job_status(kit: SimpleNamespace, endpoint: str) -> None:
    """Agents publish their records in the store; the operator's store client reads them into the
    view the reconcile turns into status.checkpoint and the CheckpointRestored Event."""
    run_id = "ckpt-run"
    store = control.connect(endpoint, timeout=5)
    client = StoreClient()
    signer, keys = agents_signer(client, run_id)
    closed_with(store, keys, ["a", "b", "c"])
    restored = {"id": 12, "source": "replica", "seconds": 0.4, "time": 1_700_000_000.0}
    record = {"latest": 12, "step": 340, "restored": restored, "bytes": 1 << 20, "limit": 1 << 30}
    publish = functools.partial(
        control.publish_progress, store, run_id, total=None, restarts=1, signer=signer, round_=1
    )
    publish("a", step=341, checkpoint=record)
    publish("b", step=341, checkpoint={"latest": 11})
    publish("c", step=341)  # an older agent: no record
    try:
        view = run(client.read(endpoint, run_id))
    finally:
        client.close()
    assert view is not None
    assert view.checkpoints == (
        CheckpointReport("a", 12, 340, Restore(12, Source.REPLICA, 0.4, 1_700_000_000.0)),
        CheckpointReport("b", 11, None, None),
    )
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    pods = (kit.store(), *(kit.worker(i) for i in range(3)))
    d = reconcile(parse_job(body), kit.observed(*pods, rendezvous=view))
    assert d.status["checkpoint"]["latest"] == 12 and d.status["checkpoint"]["restoredId"] == 12
    assert [a.message for a in d.actions if isinstance(a, Emit) and a.reason == "CheckpointRestored"] == [
        "restored checkpoint 12 (step 340) from a peer's replica in 0.4 s"
    ]


def test_reports_and_a_straggler_verdict_a_stranger_wrote_never_reach_the_job_status(endpoint: str) -> None:
    """The operator shows only what the job's agents signed: a stranger's progress report (a
    step, a checkpoint and goodput record), written unsigned and with another key, in place of
    a member's own, and its straggler verdict naming a member, are left out of the view."""
    from kelastic.agent.rendezvous.records import RecordSigner

    run_id = "forged-run"
    store = control.connect(endpoint, timeout=5)
    client = StoreClient()
    signer, keys = agents_signer(client, run_id)
    closed_with(store, keys, ["a", "b", "c"])
    goodput = {"time": time.time(), "step": 40, "work_seconds": 0.1}
    control.publish_progress(
        store, run_id, "a", step=40, total=100, restarts=0, goodput=goodput, signer=signer, round_=1
    )
    forged = {"time": time.time(), "step": 1, "work_seconds": 9.0}
    control.publish_progress(store, run_id, "b", step=1, total=100, restarts=7, goodput=forged)
    other = RecordSigner.for_job(b"another job's secret " * 2)
    control.publish_progress(store, run_id, "c", step=2, total=100, restarts=7, goodput=forged, signer=other)
    verdict = {"node": "a", "round": 1, "ratio": 9.0, "policy": "Replace", "action": "replace", "time": 1.0}
    control.publish_straggler(store, run_id, verdict)
    try:
        view = run(client.read(endpoint, run_id))
    finally:
        client.close()
    assert view is not None
    assert (view.step, view.restarts, view.straggler) == (40, 0, None), view
    assert [g.node for g in view.goodputs] == ["a"], view.goodputs
    # read without the job's key (as for a job whose agents hold a secret the operator does not
    # derive), the same records are all there: the MAC is what left them out
    status = control.read_status(store, run_id)
    assert status.progress is not None and status.progress.step == 1 and status.straggler == verdict

"""Which node of a refused checkpoint handshake holds another secret: the verdict, and the
handshakes it rests on between real checkpoint services holding two different keys."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.agent.checkpoint.client import open_channel
from kelastic.agent.checkpoint.errors import CheckpointError, SecretMismatch
from kelastic.agent.checkpoint.secretcheck import holds_another_secret, judge_secret
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings, ServiceLimits
from kelastic.agent.secret import JobSecret, SecretSource

JOB = os.urandom(32).hex().encode()
OTHER = os.urandom(32).hex().encode()


@pytest.mark.parametrize(
    ("refused", "answered", "odd"),
    [
        (0, 0, False),
        (0, 3, False),
        (1, 0, True),
        (1, 1, False),
        (2, 0, True),
        (2, 1, True),
        (1, 2, False),
        (2, 2, False),
    ],
)
def test_the_node_most_of_its_peers_refuse_is_the_odd_one(refused: int, answered: int, odd: bool) -> None:
    assert holds_another_secret(refused, answered) is odd


@pytest.fixture
def services() -> Iterator[dict[str, CheckpointService]]:
    root = Path("/dev/shm") / f"kelastic-secretcheck-{uuid.uuid4().hex[:8]}"
    started: dict[str, CheckpointService] = {}
    limits = ServiceLimits(handshake_timeout=5, io_timeout=5)
    for name, key in (("a", JOB), ("b", JOB), ("odd", OTHER)):
        started[name] = CheckpointService(
            CheckpointSettings(root=root / name, node=name, limit=2**20),
            JobSecret(key, SecretSource.FILE),
            host="127.0.0.1",
            limits=limits,
        ).start()
    yield started
    for s in started.values():
        s.stop()
    shutil.rmtree(root, ignore_errors=True)


def _handshake(key: bytes):  # type: ignore[no-untyped-def]
    return lambda endpoint: open_channel(endpoint, key, 5).sock.close()


def test_the_handshakes_tell_the_odd_node_and_spare_the_others(
    services: dict[str, CheckpointService],
) -> None:
    with socket.socket() as closed:  # a ring node that answers nothing gives no answer
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    ring = [services["a"].endpoint, services["b"].endpoint, services["odd"].endpoint, gone]
    with pytest.raises(SecretMismatch):
        open_channel(services["odd"].endpoint, JOB, 5)
    with pytest.raises(SecretMismatch):
        open_channel(services["a"].endpoint, OTHER, 5)
    with pytest.raises(CheckpointError):
        open_channel(gone, JOB, 2)

    odd = judge_secret(ring, services["odd"].endpoint, _handshake(OTHER))
    assert odd.odd and set(odd.refused) == {services["a"].endpoint, services["b"].endpoint}
    assert "--job-secret-file" in odd.message(services["odd"].endpoint)

    good = judge_secret(ring, services["a"].endpoint, _handshake(JOB))
    assert not good.odd
    assert good.refused == (services["odd"].endpoint,) and good.answered == (services["b"].endpoint,)
    assert services["odd"].endpoint in good.message(services["a"].endpoint)


def test_two_nodes_with_different_secrets_both_stop(services: dict[str, CheckpointService]) -> None:
    ring = [services["a"].endpoint, services["odd"].endpoint]
    assert judge_secret(ring, services["a"].endpoint, _handshake(JOB)).odd
    assert judge_secret(ring, services["odd"].endpoint, _handshake(OTHER)).odd

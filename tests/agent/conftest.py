"""Fixtures shared by the agent's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kelastic.agent.rendezvous import ServerProcess, start_server_process
from kelastic.agent.rendezvous.testing import shutdown_handlers


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A real ``kelastic-rendezvous`` store process, one per test module.

    Starting one costs seconds of torch import, so tests share it and keep apart
    by using their own rendezvous id (:func:`run_id`).
    """
    proc = start_server_process("127.0.0.1", 0, timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(autouse=True)
def _shutdown_handlers() -> Iterator[None]:
    """Every rendezvous handler a test made leaves its rendezvous when the test ends."""
    yield
    shutdown_handlers()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A rendezvous id of the test's own."""
    return request.node.name

"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import random
import secrets
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.agent.contract import DEFAULT_RDZV_PORT, ENV_JOB_SECRET_FILE
from kelastic.agent.rendezvous import ServerProcess, start_server_process
from kelastic.agent.rendezvous.testing import shutdown_handlers


@pytest.fixture(scope="session")
def job_secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job secret for the agents of every test: agents of a job must share one."""
    path = tmp_path_factory.mktemp("job-secret") / "job-secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def _job_secret(job_secret_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every agent, rendezvous handler and worker a test starts finds the job's secret in
    ``$KELASTIC_JOB_SECRET_FILE``, as the operator's flag gives it in a pod. Tests of the
    agent without one remove it."""
    monkeypatch.setenv(ENV_JOB_SECRET_FILE, str(job_secret_file))


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


@pytest.fixture
def store() -> Iterator[ServerProcess]:
    """A real ``kelastic-rendezvous`` store of the test's own, at the default port of a random
    127.x address (agents that name no port find it; concurrent runs do not share it)."""
    host = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    proc = start_server_process(host, DEFAULT_RDZV_PORT, timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder on a real tmpfs, as in a pod's /dev/shm; removed after the test."""
    path = Path("/dev/shm") / f"kelastic-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)

"""The operator signs each job's store records with the job's derived secret (StoreClient), and
its master key is read from its Secret, or created there (masterkey).

A real ``kelastic-rendezvous`` for the store; a small stand-in for the API server's Secrets
(the chart's RBAC on a real API server is tests/operator/test_op_rbac.py's).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kelastic.agent.rendezvous import ServerProcess, control, protocol, start_server_process
from kelastic.agent.rendezvous.protocol import ControllerBounds, RunKeys
from kelastic.agent.rendezvous.records import RecordSigner
from kelastic.operator import jobsecret, masterkey
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.reconcile import PublishMembership
from kelastic.operator.store_client import StoreClient

MASTER = secrets.token_hex(32).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = start_server_process("127.0.0.1", 0, timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


def publish(client: StoreClient, endpoint: str, run_id: str, nodes: tuple[str, ...]) -> bool:
    action = PublishMembership(
        "Membership",
        "",
        endpoint=endpoint,
        run_id=run_id,
        nodes=nodes,
        min_nodes=1,
        max_nodes=len(nodes),
        store_id="s",
    )
    return asyncio.run(client.publish(action))


def agent_keys(run_id: str, secret: str) -> RunKeys:
    """What an agent of the job reads with ``controlled=1`` and ``secret`` in its secret file."""
    return RunKeys(run_id, RecordSigner.for_job(secret.encode()), controlled=True)


def test_a_jobs_records_are_signed_with_its_derived_secret(server: ServerProcess) -> None:
    run_id = str(uuid.uuid4())
    client = StoreClient(master_key=MASTER, refresh=0)
    assert client.job_secret(run_id) == jobsecret.derived_value(MASTER, run_id)
    assert publish(client, server.endpoint, run_id, ("w0", "w1"))
    client.close()
    store = control.connect(server.endpoint)
    agent = agent_keys(run_id, client.job_secret(run_id))
    assert protocol.read_bounds(store, agent) == ControllerBounds(1, 2, 2)
    assert protocol.listed(store, agent, "w1")
    # Another job's secret (or another master key's) does not hold it.
    other = agent_keys(run_id, jobsecret.derived_value(secrets.token_bytes(32), run_id))
    assert protocol.read_bounds(store, other) is None


def test_a_job_whose_agents_hold_another_secret_gets_unsigned_records_and_one_warning(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A job whose Secret was made before the operator derived them: its agents closed a round
    under a random secret. The operator cannot sign for it: its records stay unsigned (readable
    by the agents that ran before), and it says so once."""
    run_id = str(uuid.uuid4())
    store = control.connect(server.endpoint)
    old = agent_keys(run_id, secrets.token_hex(32))
    store.add(old.open, 1)
    store.set(old.size(1), old.sign(old.size(1), protocol.RoundClose(1, "w0", "t").to_value()))
    caplog.set_level(logging.WARNING, logger="kelastic.operator.store_client")
    client = StoreClient(master_key=MASTER, refresh=0)
    for nodes in (("w0",), ("w0", "w1")):
        assert publish(client, server.endpoint, run_id, nodes)
    client.close()
    unchecked = RunKeys(run_id)
    assert store.get(unchecked.bounds) == ControllerBounds(1, 2, 2).to_json().encode()
    said = [r.getMessage() for r in caplog.records if "does not derive" in r.getMessage()]
    assert len(said) == 1 and run_id in said[0], said


class SecretKube(Kube):
    """Secrets of one namespace, as the API server keeps them (``refuse``: verb -> status)."""

    def __init__(self, refuse: dict[str, int] | None = None) -> None:
        self.secrets: dict[str, dict[str, Any]] = {}
        self.refuse = refuse or {}

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        name = path.rsplit("/", 1)[1]
        if method == "GET":
            if "get" in self.refuse:
                raise ApiError(self.refuse["get"], "Forbidden", "no")
            if name not in self.secrets:
                raise ApiError(404, "NotFound", f"secrets {name!r} not found")
            return self.secrets[name]
        raise AssertionError(method)

    def create(self, namespace: str, plural: str, manifest: Any) -> dict[str, Any]:
        if "create" in self.refuse:
            raise ApiError(self.refuse["create"], "Forbidden", "no")
        name = manifest["metadata"]["name"]
        if name in self.secrets:
            raise ApiError(409, "AlreadyExists", name)
        self.secrets[name] = dict(manifest)
        return self.secrets[name]


def test_the_master_key_is_created_once_and_read_back_after() -> None:
    kube = SecretKube()
    key = masterkey.load_or_create(kube, "ops")
    assert len(key) == 64 and kube.secrets[masterkey.SECRET_NAME]["immutable"] is True
    assert masterkey.load_or_create(kube, "ops") == key  # the next start reads the same key


def test_a_master_key_that_cannot_be_read_or_made_says_what_the_operator_needs() -> None:
    for refuse in ({"get": 403}, {"create": 403}):
        with pytest.raises(masterkey.MasterKeyError, match="needs get on that Secret and create"):
            masterkey.load_or_create(SecretKube(refuse), "ops")
    short = SecretKube()
    short.secrets[masterkey.SECRET_NAME] = {"data": {masterkey.KEY: base64.b64encode(b"short").decode()}}
    with pytest.raises(masterkey.MasterKeyError, match="no master key of at least 32 bytes"):
        masterkey.load_or_create(short, "ops")

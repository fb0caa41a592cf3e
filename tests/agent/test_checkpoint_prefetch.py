"""The parts a group will restore, pulled into a node's memory at the ring, before its workers ask.

The choice of what to pull in a table (pure), then real checkpoint services on loopback with
a job secret: a save on one node, the ring told to both, and a restore on the other node that
fetches nothing; a part that does not fit, a holder that is gone and a malformed ``wait``.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kelastic.agent.checkpoint.client import ServiceClient
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.plan import Inventory, RestoreChoice, Source, choose_restore
from kelastic.agent.checkpoint.prefetch import PREFETCH_TIMEOUT, Pull, missing_parts
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.secret import JobSecret, secret_from_file
from kelastic.checkpoint import MemoryReader, MemoryWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


@pytest.mark.parametrize(
    ("holders", "me", "pulls"),
    [
        # The node holds every file: nothing to pull.
        ({"__0.mem": (A,), "__1.mem": (B, A)}, A, []),
        # It lacks one: from its holder.
        ({"__0.mem": (A,), "__1.mem": (B,)}, A, [Pull(5, "__1.mem", 11, (B,))]),
        # Two files, each held by two nodes: each pull starts at a different holder.
        (
            {"__0.mem": (A, B), "__1.mem": (B, A)},
            C,
            [Pull(5, "__0.mem", 10, (A, B)), Pull(5, "__1.mem", 11, (A, B))],
        ),
    ],
)
def test_what_a_node_pulls_is_each_file_of_the_choice_it_does_not_hold(
    holders: dict[str, tuple[str, ...]], me: str, pulls: list[Pull]
) -> None:
    choice = RestoreChoice(5, Source.REPLICA, holders, (A,))
    assert missing_parts(choice, me, {"__0.mem": 10, "__1.mem": 11}) == pulls


def test_nothing_is_pulled_without_a_memory_choice() -> None:
    assert missing_parts(None, A, {}) == []
    durable = RestoreChoice(5, Source.DURABLE, durable_path="/ckpt/5")
    assert missing_parts(durable, A, {"__0.mem": 10}) == []
    # A file of unknown size (no manifest read) is left to the workers.
    assert missing_parts(RestoreChoice(5, Source.MEMORY, {"__0.mem": (B,)}), A, {}) == []


# -- real services ---------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path: Path) -> JobSecret:
    path = tmp_path / "job-secret"
    path.write_text(uuid.uuid4().hex * 2)
    return secret_from_file(str(path))


@pytest.fixture
def services(shm: Path, secret: JobSecret) -> Iterator[list[CheckpointService]]:
    started: list[CheckpointService] = []
    yield started
    for s in started:
        s.stop(remove=True)


def start(
    started: list[CheckpointService], shm: Path, secret: JobSecret, name: str, **kw: Any
) -> CheckpointService:
    settings = CheckpointSettings(root=shm / name, node=name, **{"limit": 64 * 2**20, "replicas": 0, **kw})
    s = CheckpointService(settings, secret, host="127.0.0.1", advertise="127.0.0.1").start()
    started.append(s)
    return s


def weights() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g)}


def saved_on(s: CheckpointService, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        for k, v in s.worker_env().items():
            m.setenv(k, v)
        dcp.save(weights(), storage_writer=MemoryWriter(step=9), no_dist=True)


class GroupReader(MemoryReader):
    """A restore on one node of a group (the inventories all_gather_object would bring in a
    real one), each asked as a worker asks: after the pulls under way."""

    def __init__(self, group: list[CheckpointService]) -> None:
        super().__init__()
        self._group = group

    @property
    def choice(self) -> Any:
        if not self._chosen:
            self._began = time.monotonic()
            inventories = []
            for s in self._group:
                client = s.client(s.endpoint)
                header, _ = client.call({"op": "inventory", "wait": True})
                client.close()
                inventories.append(Inventory.from_json(header["inventory"]))
            self._choice, self._chosen = choose_restore(inventories), True
        return self._choice


def restore_on(
    s: CheckpointService, group: list[CheckpointService], monkeypatch: pytest.MonkeyPatch
) -> GroupReader:
    target = {"w": torch.zeros(512, 1024), "b": torch.zeros(1024)}
    with monkeypatch.context() as m:
        for k, v in s.worker_env().items():
            m.setenv(k, v)
        reader = GroupReader(group)
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in weights().items())
    return reader


def test_at_the_ring_a_node_pulls_what_it_lacks_and_its_restore_fetches_nothing(
    services: list[CheckpointService], shm: Path, secret: JobSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = start(services, shm, secret, "a")
    b = start(services, shm, secret, "b")
    saved_on(a, monkeypatch)  # no replicas: only node a holds the part
    assert not b.keeper.inventory().held
    for s in (a, b):
        s.set_ring([a.endpoint, b.endpoint])  # a rendezvous round of the two
    reader = restore_on(b, [a, b], monkeypatch)
    assert reader.fetched_bytes == 0 and reader.local_bytes > 2 * 2**20
    (held,) = b.keeper.inventory().held
    assert held.replicas == frozenset({"__0.mem"}), "kept as a replica, dropped with its checkpoint"


def test_a_part_that_does_not_fit_is_left_to_the_workers_to_fetch(
    services: list[CheckpointService], shm: Path, secret: JobSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = start(services, shm, secret, "a")
    b = start(services, shm, secret, "b", limit=2**20)  # smaller than the part
    saved_on(a, monkeypatch)
    for s in (a, b):
        s.set_ring([a.endpoint, b.endpoint])
    reader = restore_on(b, [a, b], monkeypatch)
    assert reader.fetched_bytes > 2 * 2**20 and reader.local_bytes == 0
    assert not b.keeper.inventory().held


def test_a_holder_gone_before_the_pull_costs_the_restore_no_wait(
    services: list[CheckpointService], shm: Path, secret: JobSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = start(services, shm, secret, "a")
    b = start(services, shm, secret, "b")
    saved_on(a, monkeypatch)
    ring = [a.endpoint, b.endpoint]
    a.stop(remove=True)
    services.remove(a)
    b.set_ring(ring)
    client = b.client(b.endpoint)
    began = time.monotonic()
    header, _ = client.call({"op": "inventory", "wait": True})
    client.close()
    assert time.monotonic() - began < 5, "the inventory waited for a pull that cannot happen"
    assert not header["inventory"]["held"]


@pytest.mark.slow  # PREFETCH_TIMEOUT, 2 s
def test_a_frozen_node_on_the_ring_holds_the_pull_for_its_timeout_only(
    services: list[CheckpointService], shm: Path, secret: JobSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node of the new ring that accepts connections and then says nothing (a frozen
    process: the kernel still completes the handshake) costs the pull PREFETCH_TIMEOUT,
    never the workers' whole wait, and the part still comes from the node that answers."""
    a = start(services, shm, secret, "a")
    b = start(services, shm, secret, "b")
    saved_on(a, monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as frozen:
        b.set_ring([a.endpoint, b.endpoint, f"127.0.0.1:{frozen.getsockname()[1]}"])
        client = b.client(b.endpoint)
        began = time.monotonic()
        header, _ = client.call({"op": "inventory", "wait": True})
        took = time.monotonic() - began
        client.close()
    assert took < 3 * PREFETCH_TIMEOUT, f"the restore waited {took:.1f} s on a frozen node"
    (held,) = Inventory.from_json(header["inventory"]).held
    assert held.replicas == frozenset({"__0.mem"})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wait", "yes"),
        ("wait", 1),
        ("wait", None),
        ("wait", [True]),
        ("pull", "no"),
        ("pull", 0),
        ("pull", [False]),
    ],
)
def test_an_inventory_request_with_a_wait_or_pull_that_is_no_boolean_is_refused(
    services: list[CheckpointService], shm: Path, secret: JobSecret, field: str, value: Any
) -> None:
    a = start(services, shm, secret, "a")
    client = ServiceClient(a.endpoint, secret.key)
    with pytest.raises(CheckpointError, match=f"{field} must be true or false"):
        client.call({"op": "inventory", field: value})
    client.close()
    header, _ = a.client(a.endpoint).call({"op": "inventory"})  # the service goes on serving
    assert header["ok"]


def test_a_node_whose_workers_roll_forward_pulls_nothing_ahead_until_they_ask_again(
    services: list[CheckpointService], shm: Path, secret: JobSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = start(services, shm, secret, "a")
    b = start(services, shm, secret, "b")
    saved_on(a, monkeypatch)  # only node a holds the part
    client = b.client(b.endpoint)
    client.call({"op": "inventory", "pull": False})  # what kelastic.checkpoint.restore says
    for s in (a, b):
        s.set_ring([a.endpoint, b.endpoint])
    client.call({"op": "inventory", "wait": True})
    assert not b.keeper.inventory().held, "pulled ahead of a restore that copies live state"
    # a restore from the checkpoint fetches the part itself
    reader = restore_on(b, [a, b], monkeypatch)
    assert reader.fetched_bytes > 2 * 2**20
    client.call({"op": "inventory", "pull": True})
    for s in (a, b):
        s.set_ring([a.endpoint, b.endpoint])
    client.call({"op": "inventory", "wait": True})
    assert [h.replicas for h in b.keeper.inventory().held] == [frozenset({"__0.mem"})]
    client.close()

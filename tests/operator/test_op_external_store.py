"""The operator connects only to the stores it runs: a kelastic-backend job that names its own store is
refused (the Invalid condition and an Event say why and how to allow it) unless the operator allows
external stores; the store is then never read or written."""

from __future__ import annotations

import asyncio
import copy
import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.cli import build_parser
from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import CreatePod, CreateService, Decision, Emit, ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job
from kelastic.operator.status import CONDITION_INVALID, find_condition
from kelastic.operator.store_client import StoreClient

controller_test = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("test_op_controller.py"))))
ENDPOINT = "10.0.0.9:29400"
ALLOW = ReconcileConfig(allow_external_stores=True)


def created(decision: Decision) -> list[str]:
    return [a.manifest["metadata"]["name"] for a in decision.actions if isinstance(a, CreatePod)]


def invalid(decision: Decision) -> dict[str, Any] | None:
    found = find_condition(decision.status.get("conditions") or [], CONDITION_INVALID)
    return found if found is not None and found["status"] == "True" else None


def test_a_job_naming_its_own_store_is_refused_saying_how_to_allow_it(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body(rdzvEndpoint=ENDPOINT))
    decision = reconcile(job, kit.observed(services=()))
    condition = invalid(decision)
    assert condition is not None and decision.status["phase"] == "Failed"
    message = condition["message"]
    assert "spec.rdzvEndpoint" in message and ENDPOINT in message
    assert "operator.allowExternalStores: true" in message and "--allow-external-stores" in message
    assert "Remove spec.rdzvEndpoint" in message
    (event,) = [a for a in decision.actions if isinstance(a, Emit) and a.reason == "InvalidSpec"]
    assert event.warning and event.message == message
    assert created(decision) == [] and not [a for a in decision.actions if isinstance(a, CreateService)]


def test_an_operator_that_allows_external_stores_runs_the_job_on_it(kit: SimpleNamespace) -> None:
    decision = reconcile(parse_job(kit.job_body(rdzvEndpoint=ENDPOINT)), kit.observed(services=()), ALLOW)
    assert invalid(decision) is None
    assert created(decision) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]  # and no store of ours
    assert decision.status["rdzvEndpoint"] == ENDPOINT


@pytest.mark.parametrize(("backend", "endpoint"), [("c10d", ENDPOINT), ("etcd-v2", "etcd:2379")])
def test_backends_whose_store_the_operator_never_touches_keep_their_endpoint(
    kit: SimpleNamespace, backend: str, endpoint: str
) -> None:
    job = parse_job(kit.job_body(rdzvBackend=backend, rdzvEndpoint=endpoint))
    decision = reconcile(job, kit.observed(services=()))
    assert invalid(decision) is None and len(created(decision)) == 3


def test_a_job_refused_for_its_store_starts_once_the_operator_allows_it(kit: SimpleNamespace) -> None:
    body = kit.job_body(rdzvEndpoint=ENDPOINT)
    refused = reconcile(parse_job(body), kit.observed(services=()))
    body["status"] = refused.status
    allowed = reconcile(parse_job(body), kit.observed(services=()), ALLOW)
    condition = find_condition(allowed.status["conditions"], CONDITION_INVALID)
    assert condition is not None and condition["status"] == "False"
    assert allowed.status["phase"] != "Failed" and len(created(allowed)) == 3


def test_the_flag_sets_the_rule() -> None:
    assert not build_parser().parse_args([]).allow_external_stores
    assert build_parser().parse_args(["--allow-external-stores"]).allow_external_stores


class WatchedStore(StoreClient):
    """A store client that records every endpoint the operator reads, connects to or publishes to."""

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[str] = []

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        self.touched.append(endpoint)
        return None

    async def connect(self, endpoint: str) -> bool:
        self.touched.append(endpoint)
        return True

    async def publish(self, action: Any) -> bool:
        self.touched.append(action.endpoint)
        return True


@pytest.mark.parametrize("allow", [False, True])
def test_a_refused_store_is_never_contacted(kit: SimpleNamespace, allow: bool) -> None:
    # a job that ran before (Running, its endpoint in the status): the operator still must not connect
    body = kit.job_body(rdzvEndpoint=ENDPOINT, status={"phase": "Running", "rdzvEndpoint": ENDPOINT})
    kube = controller_test.RecordingKube(body)
    store = WatchedStore()

    async def scenario(controller: Any) -> None:
        controller.job_seen(controller_test.KEY, "1", copy.deepcopy(kube.job))
        await controller_test.settle(controller)

    loop = asyncio.new_event_loop()
    try:
        controller_test.run(
            loop, kube, scenario, store, reconcile=ReconcileConfig(allow_external_stores=allow)
        )
    finally:
        loop.close()
    if allow:
        assert ENDPOINT in store.touched  # what works today keeps working where it is allowed
    else:
        assert store.touched == []
        assert kube.job["status"]["phase"] == "Failed"
        assert any("allowExternalStores" in m for m in kube.event_messages)

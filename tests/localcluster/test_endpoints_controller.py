"""The endpoints controller's loop: which failed writes are a race it repairs in silence, which a user hears of."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kelastic.localcluster.common.client import ApiRequestError, Informer
from kelastic.localcluster.controllers.endpoints import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SERVICE_NAME_LABEL,
    EndpointsController,
)


class _FailingClient:
    """Answers every slice write with one error; counts the writes."""

    def __init__(self, error: ApiRequestError) -> None:
        self.error = error
        self.writes = 0

    async def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        raise self.error

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        raise self.error

    async def delete(self, path: str) -> dict[str, Any]:
        return {}


def _controller(client: _FailingClient) -> EndpointsController:
    ctl = EndpointsController(client)  # type: ignore[arg-type]
    ctl.retry_delay = 0.02
    ctl.slices = Informer(client, "/apis/discovery.k8s.io/v1/endpointslices")  # type: ignore[arg-type]
    ctl.services.cache["default/store"] = {
        "metadata": {"name": "store", "namespace": "default", "uid": "s1"},
        "spec": {"selector": {"app": "store"}, "ports": [{"port": 29400}]},
    }
    ctl.pods.cache["default/store-0"] = {
        "metadata": {"name": "store-0", "namespace": "default", "uid": "p1", "labels": {"app": "store"}},
        "status": {
            "podIP": "127.1.0.9",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    # A slice that lists nobody yet: the controller must PUT the pod into it.
    ctl.slices.cache["default/store-kl0"] = {
        "metadata": {
            "name": "store-kl0",
            "namespace": "default",
            "resourceVersion": "7",
            "labels": {SERVICE_NAME_LABEL: "store", MANAGED_BY_LABEL: MANAGED_BY},
        },
        "addressType": "IPv4",
        "endpoints": [],
        "ports": [],
    }
    return ctl


async def _two_attempts(ctl: EndpointsController, client: _FailingClient) -> None:
    task = asyncio.get_running_loop().create_task(ctl._loop())
    ctl._mark("default/store")
    try:
        for _ in range(100):
            if client.writes >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert client.writes >= 2, "the failed write was not retried"


@pytest.mark.parametrize(
    "error",
    [
        ApiRequestError(404, "NotFound", 'endpointslices.discovery.k8s.io "store-kl0" not found'),
        ApiRequestError(409, "Conflict", "the object has been modified"),
    ],
)
def test_a_slice_changed_or_deleted_under_the_controller_is_retried_in_silence(
    error: ApiRequestError, caplog: pytest.LogCaptureFixture
) -> None:
    # A slice deleted with its Service while the controller wrote it (what
    # happens when the cluster stops) is the controller's cache being behind,
    # not something for the user to read.
    client = _FailingClient(error)
    with caplog.at_level(logging.DEBUG, logger="kelastic.localcluster.controllers.endpoints"):
        asyncio.run(_two_attempts(_controller(client), client))
    records = [r for r in caplog.records if "could not update endpoints" in r.getMessage()]
    assert records and all(r.levelno == logging.DEBUG for r in records)


def test_a_refused_slice_write_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    client = _FailingClient(ApiRequestError(422, "Invalid", "EndpointSlice is invalid"))
    with caplog.at_level(logging.DEBUG, logger="kelastic.localcluster.controllers.endpoints"):
        asyncio.run(_two_attempts(_controller(client), client))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "EndpointSlice is invalid" in warnings[0].getMessage()

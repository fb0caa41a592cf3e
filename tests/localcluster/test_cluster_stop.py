"""Time-outs of the local cluster say what did not finish and what to do, never a coroutine repr."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from kelastic.localcluster.cli import cluster as cluster_module
from kelastic.localcluster.cli.cluster import LocalCluster


def test_call_timeout_names_the_operation_not_a_repr(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", workdir=tmp_path) as cluster:
        with pytest.raises(TimeoutError) as named:
            cluster.call(asyncio.sleep(30), timeout=0.2, what="waiting for the pods")
        assert str(named.value) == "waiting for the pods did not finish within 0.2 s (local cluster)"

        async def list_pods() -> None:
            await asyncio.sleep(30)

        with pytest.raises(TimeoutError) as unnamed:
            cluster.call(list_pods(), timeout=0.2)
        assert "<coroutine" not in str(unnamed.value)
        assert str(unnamed.value).startswith("test_call_timeout_names_the_operation_not_a_repr.list_pods()")


def test_stop_that_hangs_still_stops_the_api_server_and_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_module, "STOP_TIMEOUT", 1.0)
    cluster = LocalCluster(tmp_path / "cluster", workdir=tmp_path).start()
    assert cluster.kubelet is not None and cluster.apiserver is not None
    port = cluster.apiserver.port

    async def stuck() -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(cluster.kubelet, "stop", stuck)  # a kubelet that never finishes stopping
    with pytest.raises(TimeoutError) as stopped:
        cluster.stop()
    message = str(stopped.value)
    assert "<coroutine" not in message
    assert "kubelet" in message and "within 1 s" in message and "pgrep" in message
    assert cluster.apiserver is None  # stopped anyway
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    cluster.stop()  # idempotent after a stuck stop


def test_a_stuck_stop_leaves_no_task_for_the_garbage_collector_to_destroy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The informers' watches and the API clients end with the loop, not later in the garbage
    collector, where closing their connections needs the closed loop ("Event loop is closed",
    the unraisable tracebacks a passing test run used to print)."""
    import gc
    import sys

    monkeypatch.setattr(cluster_module, "STOP_TIMEOUT", 1.0)
    cluster = LocalCluster(tmp_path / "cluster", workdir=tmp_path).start()
    assert cluster.kubelet is not None

    async def stuck() -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(cluster.kubelet, "stop", stuck)
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.object!r}: {u.exc_value!r}"))
    with pytest.raises(TimeoutError):
        cluster.stop()
    del cluster
    gc.collect()
    assert unraisable == []

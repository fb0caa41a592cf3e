"""Fixtures for the operator tests: ElasticJob bodies and a tiny in-memory world for the pure core."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator.kube import Kube, load_configuration
from kelastic.operator.observed import Observed, PodPhase, PodView, ServiceView
from kelastic.operator.spec import API_VERSION, KIND

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def job_body(
    name: str = "demo",
    *,
    min_r: int = 2,
    max_r: int = 4,
    replicas: int | None = 3,
    command: list[str] | None = None,
    status: dict[str, Any] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    worker: dict[str, Any] = {
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "kelastic:dev",
                        "command": command if command is not None else ["python", "train.py", "--lr", "0.1"],
                    }
                ]
            }
        }
    }
    if replicas is not None:
        worker["replicas"] = replicas
    restart = spec_extra.pop("restartPolicy", None)
    if restart:
        worker["restartPolicy"] = restart
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1},
        "spec": {
            "minReplicas": min_r,
            "maxReplicas": max_r,
            "replicaSpecs": {"Worker": worker},
            **spec_extra,
        },
        "status": status or {},
    }


def worker(
    index: int,
    phase: PodPhase = PodPhase.RUNNING,
    *,
    job: str = "demo",
    uid: str | None = None,
    **kw: Any,
) -> PodView:
    return PodView(
        name=f"{job}-worker-{index}",
        uid=uid or f"pod-{job}-{index}",
        role=contract.ROLE_WORKER,
        index=index,
        phase=phase,
        owner_uid=f"uid-{job}",
        **kw,
    )


def store(
    phase: PodPhase = PodPhase.RUNNING, *, job: str = "demo", uid: str = "store-1", **kw: Any
) -> PodView:
    return PodView(
        name=f"{job}-rendezvous",
        uid=uid,
        role=contract.ROLE_RENDEZVOUS,
        index=None,
        phase=phase,
        owner_uid=f"uid-{job}",
        **kw,
    )


def service(job: str = "demo", ip: str | None = "127.2.0.5") -> ServiceView:
    return ServiceView(name=f"{job}-rendezvous", uid=f"svc-{job}", cluster_ip=ip, owner_uid=f"uid-{job}")


def observed(
    *pods: PodView, services: tuple[ServiceView, ...] | None = None, at: float = 0.0, **kw: Any
) -> Observed:
    return Observed(
        now=T0 + timedelta(seconds=at),
        pods=pods,
        services=(service(),) if services is None else services,
        **kw,
    )


@pytest.fixture
def kit() -> SimpleNamespace:
    """The builders above, for tests (conftest modules cannot be imported by name)."""
    return SimpleNamespace(
        T0=T0,
        job_body=lambda *a, **kw: copy.deepcopy(job_body(*a, **kw)),
        worker=worker,
        store=store,
        service=service,
        observed=observed,
    )


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[Kube]:
    """The operator's API client, on a fresh API server emulator (no kubelet)."""
    apiserver = pytest.importorskip("kelastic.localcluster.apiserver.apiserver")
    server = apiserver.ApiServer(data_dir=tmp_path / "data")
    server.start()
    try:
        k = Kube(load_configuration(str(server.write_kubeconfig(tmp_path / "kubeconfig"))))
        yield k
        k.close()
    finally:
        server.stop()

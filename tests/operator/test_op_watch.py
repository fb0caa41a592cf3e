"""What the operator asks the API server for: its watches and the requests it makes at start.

The operator (kopf with kelastic's registry) runs in-process against the API server
emulator; every HTTP request kopf sends is recorded at the aiohttp client, so the
tests see the wire, not kopf's client-side filters.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import kopf
import pytest

from kelastic.agent import contract
from kelastic.operator.cli import _connection_info
from kelastic.operator.controller import Controller
from kelastic.operator.handlers import OWNED_SELECTOR, NoDiffBase, build_registry, configure_settings
from kelastic.operator.kube import Kube, load_configuration
from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.store_client import StoreClient

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "elasticjob.yaml"


@dataclass
class Wire:
    """Requests kopf sent: (method, path, query) in order."""

    requests: list[tuple[str, str, dict[str, list[str]]]] = field(default_factory=list)

    def paths(self, method: str = "GET") -> list[str]:
        return [p for m, p, _ in self.requests if m == method]


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    record = Wire()
    original = aiohttp.ClientSession._request

    async def recording(self: aiohttp.ClientSession, method: str, url: Any, **kw: Any) -> Any:
        parts = urlsplit(str(url))
        query = parse_qs(parts.query)
        for key, value in (kw.get("params") or {}).items():
            query.setdefault(key, []).append(str(value))
        record.requests.append((method.upper(), parts.path, query))
        return await original(self, method, url, **kw)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", recording)
    return record


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Kube, Any]]:
    apiserver = pytest.importorskip("kelastic.localcluster.apiserver.apiserver")
    server = apiserver.ApiServer(data_dir=tmp_path / "data")
    server.start()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        cfg = load_configuration(str(kubeconfig))
        kube = Kube(cfg)
        import yaml

        kube.request(
            "POST",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            yaml.safe_load(CRD.read_text()),
        )
        yield kube, cfg
        kube.close()
    finally:
        server.stop()


def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "x", "command": ["sleep", "60"]}]},
    }


class Operator:
    """kopf running kelastic's registry on its own loop in a thread."""

    def __init__(self, kube: Kube, cfg: Any, *, cluster_wide: bool = False) -> None:
        self.controller = Controller(kube, StoreClient())
        self.registry = build_registry(self.controller, cluster_wide=cluster_wide)
        self.delivered: list[str] = []  # every pod name any watch stream delivered
        self.cluster_wide = cluster_wide

        @kopf.on.login(registry=self.registry)
        def login(**_: Any) -> Any:
            return _connection_info(cfg)

        # No client-side filter: this handler sees whatever the pod watch receives.
        @kopf.on.event("v1", "pods", id="spy", registry=self.registry)
        def spy(name: str, **_: Any) -> None:
            self.delivered.append(name)

        self._stop: asyncio.Future[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._stop = self._loop.create_future()
        self._loop.run_until_complete(
            kopf.operator(
                registry=self.registry,
                clusterwide=self.cluster_wide,
                namespaces=[] if self.cluster_wide else ["default"],
                standalone=True,
                stop_flag=self._stop,
            )
        )

    def __enter__(self) -> Operator:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop within 30s"


def seed(kube: Kube, suffix: str = "") -> None:
    """One pod of ours (the job label) and one foreign pod (no such label)."""
    kube.create("default", "pods", pod(f"foreign{suffix}", {"app": "other"}))
    kube.create("default", "pods", pod(f"ours{suffix}", {contract.LABEL_JOB_NAME: "demo"}))


def wait(what: str, cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_settings_filter_owned_kinds_on_the_server_and_scan_only_cluster_wide() -> None:
    settings = kopf.OperatorSettings()
    configure_settings(settings, cluster_wide=False)
    assert settings.scanning.disabled is True
    assert settings.peering.standalone is True
    assert list(settings.watching.label_selectors.values()) == [OWNED_SELECTOR, OWNED_SELECTOR]
    settings = kopf.OperatorSettings()
    configure_settings(settings, cluster_wide=True)
    assert settings.scanning.disabled is False


def test_kopf_keeps_no_diff_base_of_the_watched_objects() -> None:
    # Only on.event handlers and indexes: kopf's per-event deep copy of each body is waste.
    settings = kopf.OperatorSettings()
    configure_settings(settings, cluster_wide=False)
    storage = settings.persistence.diffbase_storage
    assert isinstance(storage, NoDiffBase)
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"x": [1]}})
    assert storage.build(body=pod) == {} and storage.fetch(body=pod) is None


def test_namespaced_operator_never_lists_namespaces_or_crds_and_pods_are_filtered_by_the_server(
    wire: Wire, api: tuple[Kube, Any]
) -> None:
    kube, cfg = api
    seed(kube)
    with Operator(kube, cfg) as op:
        wait("the labelled pod delivered", lambda: "ours" in op.delivered)
        seed(kube, "-2")
        wait("the second labelled pod delivered", lambda: "ours-2" in op.delivered)
    assert "foreign" not in op.delivered and "foreign-2" not in op.delivered, op.delivered
    gets = wire.paths("GET")
    assert not [p for p in gets if p.endswith("/namespaces") or "customresourcedefinitions" in p], gets
    pod_requests = [q for m, p, q in wire.requests if p.endswith("/pods")]
    service_requests = [q for m, p, q in wire.requests if p.endswith("/services")]
    assert pod_requests and service_requests
    for query in pod_requests + service_requests:
        assert query.get("labelSelector") == [OWNED_SELECTOR], query


def test_cluster_wide_operator_watches_all_namespaces_with_the_selector(
    wire: Wire, api: tuple[Kube, Any]
) -> None:
    kube, cfg = api
    seed(kube)
    with Operator(kube, cfg, cluster_wide=True) as op:
        wait("the labelled pod delivered", lambda: "ours" in op.delivered)
    assert "foreign" not in op.delivered
    assert "/api/v1/pods" in wire.paths("GET")
    assert not [p for p in wire.paths("GET") if p.endswith("/api/v1/namespaces")]


def test_the_watch_ends_the_expectation_of_a_pod_the_operator_created(
    wire: Wire, api: tuple[Kube, Any]
) -> None:
    kube, cfg = api
    key = ("default", "demo")
    op = Operator(kube, cfg)
    op.controller.is_leader = lambda: False  # passes change nothing: only the watch may end it
    with op:
        # As after the operator's own create: the pod counts as existing until the watch shows it.
        expected = PodView(name="ours-3", uid="u", role=contract.ROLE_WORKER, index=0, phase=PodPhase.PENDING)
        op.controller.cache.expect(key, expected)
        assert op.controller.cache.with_expected(key, [])[1]
        seed(kube, "-3")
        wait("the labelled pod delivered", lambda: "ours-3" in op.delivered)
        wait("the expectation ended", lambda: not op.controller.cache.with_expected(key, [])[1])

"""IPv6 clusters: endpoints carry brackets, servers bind in the address family of their address."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

import pytest

from kelastic.agent import contract
from kelastic.agent.health import HealthServer
from kelastic.agent.rendezvous.protocol import parse_endpoint
from kelastic.operator.cli import bracketed_url
from kelastic.operator.reconcile import CreatePod, ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job


def test_format_endpoint_round_trips_through_the_agents_parser() -> None:
    assert contract.format_endpoint("10.0.0.1", 29400) == "10.0.0.1:29400"
    assert contract.format_endpoint("fd00::10", 29400) == "[fd00::10]:29400"
    assert parse_endpoint(contract.format_endpoint("fd00::10", 29400), 1) == ("fd00::10", 29400)


def test_workers_get_a_bracketed_endpoint_for_an_ipv6_service(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    observed = kit.observed(kit.store(), services=(kit.service(ip="fd00::10"),))
    decision = reconcile(
        parse_job(body), observed, ReconcileConfig(min_replicas_timeout=60.0, success_grace=10.0)
    )
    pods = [a.manifest for a in decision.actions if isinstance(a, CreatePod)]
    assert pods
    for pod in pods:
        command = pod["spec"]["containers"][0]["command"]
        assert command[command.index("--rdzv-endpoint") + 1] == "[fd00::10]:29400"
    assert decision.status["rdzvEndpoint"] == "[fd00::10]:29400"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here; enable IPv6 on lo to run it")
def test_health_server_binds_an_ipv6_pod_address() -> None:
    server = HealthServer(0, lambda: True, host="::1").start()
    try:
        with urllib.request.urlopen(f"http://[::1]:{server.port}/readyz", timeout=10) as reply:
            assert json.loads(reply.read()) == {"status": "ready"}
    finally:
        server.stop()


def test_liveness_url_from_an_ipv6_pod_ip_is_bracketed() -> None:
    """The chart passes --liveness=http://$(POD_IP):8080/healthz; an IPv6 POD_IP needs brackets."""
    assert bracketed_url("http://fd00::7:8080/healthz") == "http://[fd00::7]:8080/healthz"
    assert bracketed_url("http://10.1.2.3:8080/healthz") == "http://10.1.2.3:8080/healthz"
    assert bracketed_url("http://[::1]:8080/healthz") == "http://[::1]:8080/healthz"
    assert bracketed_url(None) is None

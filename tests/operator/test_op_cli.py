"""kelastic-operator's command line: flags, and clear errors for bad input."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kelastic.operator.cli import _network_policy, build_parser, main
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.netpol import NetworkPolicyConfig, parse_labels


def test_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.namespace, args.all_namespaces, args.standalone) == ([], False, False)
    assert (args.health_port, args.resync_interval, args.min_replicas_timeout, args.log_format) == (
        8081,
        60.0,
        300.0,
        "text",
    )


def test_namespaces_and_cluster_wide_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["-n", "a", "-n", "b"]).namespace == ["a", "b"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["-n", "a", "-A"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resync-interval", "0"], "--resync-interval must be > 0"),
        (["--health-port", "70000"], "--health-port must be in 0..65535"),
        (["--min-replicas-timeout", "-1"], "--min-replicas-timeout must be >= 0"),
        (["--log-format", "xml"], "invalid choice"),
    ],
)
def test_bad_flags_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "kelastic.operator", "--kubeconfig", str(missing), "--standalone"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot load Kubernetes credentials" in proc.stderr and str(missing) in proc.stderr


def test_network_policies_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    args = build_parser().parse_args([])
    assert args.network_policy and args.operator_namespace is None and args.operator_pod_labels == ""
    assert not build_parser().parse_args(["--no-network-policy"]).network_policy
    assert build_parser().parse_args(["--store-network-policy"]).network_policy  # the earlier flag
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    assert build_parser().parse_args([]).operator_namespace == "ops"  # where the chart's pod runs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--operator-pod-labels", "app=kelastic"], "--operator-pod-labels needs the operator's namespace"),
        (["--operator-pod-labels", "app"], "--operator-pod-labels: expected KEY=VALUE"),
        (["--network-policy-metrics-from", "[{"], "--network-policy-metrics-from: not JSON"),
        (
            ["--network-policy-metrics-from", '[{"port": 1}]'],
            "holds only podSelector, namespaceSelector or ipBlock",
        ),
    ],
)
def test_bad_network_policy_flags_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


class NamespaceKube:
    """Answers the read of the operator's Namespace with ``labels``, or fails with ``status``."""

    def __init__(self, labels: dict[str, str] | None = None, status: int = 0) -> None:
        self.labels, self.status, self.reads = labels, status, 0

    def get_namespace(self, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.labels is None:
            raise ApiError(self.status, "Forbidden", f'namespaces "{name}" is forbidden')
        return {"metadata": {"name": name, "labels": self.labels}}


def policy_config(kube: Any, argv: list[str], caplog: pytest.LogCaptureFixture) -> NetworkPolicyConfig:
    args = build_parser().parse_args(argv)
    labels = parse_labels(args.operator_pod_labels)
    with caplog.at_level(logging.INFO, logger="test"):
        return _network_policy(kube, args, labels, (), logging.getLogger("test"))


def test_the_operator_reads_its_namespace_once_to_choose_the_namespace_selector(
    kube: Kube, caplog: pytest.LogCaptureFixture
) -> None:
    own = ["--operator-namespace", "kelastic-system", "--operator-pod-labels", "app=kelastic"]
    kube.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kelastic-system"}},
    )
    # an API server that labels every namespace with its name (the emulator does, as Kubernetes 1.21+)
    config = policy_config(kube, own, caplog)
    assert (config.enabled, config.operator_namespace, config.namespace_labelled) == (
        True,
        "kelastic-system",
        True,
    )
    assert dict(config.operator_labels) == {"app": "kelastic"}
    # a namespace without the label (Kubernetes 1.20): any namespace, said as a warning
    caplog.clear()
    old = NamespaceKube({"team": "ml"})
    config = policy_config(old, own, caplog)
    assert not config.namespace_labelled and old.reads == 1
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "ANY namespace" in caplog.text
    # not readable: the label is assumed, and the warning says how to add it on an older cluster
    caplog.clear()
    config = policy_config(NamespaceKube(None, 403), own, caplog)
    assert config.namespace_labelled and "kubectl label namespace kelastic-system" in caplog.text
    # an operator outside the cluster is admitted nowhere, and nothing is read
    outside = NamespaceKube({})
    config = policy_config(outside, [], caplog)
    assert config.enabled and config.operator_namespace is None and outside.reads == 0
    assert not policy_config(outside, ["--no-network-policy", *own], caplog).enabled and outside.reads == 0

"""kelastic-operator's command line: flags, and clear errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.operator.cli import build_parser, main


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

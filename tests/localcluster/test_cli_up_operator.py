"""``kelastic local up`` with its operator, as a user starts it: which namespaces it serves and
where its metrics are (real processes, the real kubectl, the real operator)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kelastic.localcluster.cli.cli import served_namespaces
from kelastic.localcluster.testing import Kubectl, wait_for

KELASTIC = [sys.executable, "-m", "kelastic.localcluster"]


def job(namespace: str) -> dict[str, object]:
    """A one-worker job: the operator that serves its namespace gives it a status."""
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "ns-probe", "namespace": namespace},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 1,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "containers": [{"name": "trainer", "image": "x", "command": ["python", "w.py"]}]
                        }
                    },
                }
            },
        },
    }


def test_served_namespaces_default_to_every_namespace_and_narrow_to_the_named_ones() -> None:
    assert served_namespaces(None, False) == ((), True)
    assert served_namespaces(None, True) == ((), True)
    assert served_namespaces(["a", "b", "a"], False) == (("a", "b"), False)
    with pytest.raises(SystemExit, match="exclude each other"):
        served_namespaces(["a"], True)


def _up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], list[str], Kubectl]:
    """``kelastic local up`` started and ready: (process, lines printed, kubectl)."""
    kubeconfig = tmp_path / "kubeconfig"
    up = subprocess.Popen(
        [
            *KELASTIC,
            "local",
            "up",
            "--kubeconfig",
            str(kubeconfig),
            "--data-dir",
            str(tmp_path / "d"),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout or []], daemon=True).start()
    printed: list[str] = []
    deadline = time.monotonic() + 240
    while not any(line.startswith("Stop with Ctrl-C") for line in printed):
        if time.monotonic() > deadline or up.poll() is not None:
            _stop(up)
            raise AssertionError(f"kelastic local up did not come up: {printed}")
        try:
            printed.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    return up, printed, Kubectl(kubeconfig)


def _stop(up: subprocess.Popen[str]) -> None:
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def _served_in_team_a(kubectl: Kubectl) -> None:
    kubectl("create", "namespace", "team-a")
    kubectl("apply", "-f", "-", input=json.dumps(job("team-a")))
    wait_for(
        lambda: kubectl("get", "ej", "ns-probe", "-n", "team-a", "-o", "jsonpath={.status.phase}"),
        90,
        "the operator to serve the job in team-a",
        interval=0.5,
    )


@pytest.mark.slow
def test_local_up_serves_every_namespace_and_prints_where_its_metrics_are(tmp_path: Path) -> None:
    up, printed, kubectl = _up(tmp_path)
    try:
        (metrics,) = [
            line.split(": ", 1)[1].strip() for line in printed if line.startswith("operator metrics:")
        ]
        _served_in_team_a(kubectl)
        text = wait_for(
            lambda: urllib.request.urlopen(metrics, timeout=5).read().decode(), 30, "the operator's metrics"
        )
        assert "kelastic_reconcile_total" in text
    finally:
        _stop(up)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_up_on_a_control_plane_serves_every_namespace(control_plane_bin: Path, tmp_path: Path) -> None:
    """The chart's operator is installed cluster-wide: a job in a namespace of the user's is served."""
    up, _, kubectl = _up(tmp_path, "--control-plane", str(control_plane_bin))
    try:
        _served_in_team_a(kubectl)
    finally:
        _stop(up)

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
from kelastic.localcluster.testing import Kubectl, process_alive, wait_for

KELASTIC = [sys.executable, "-m", "kelastic.localcluster"]
REPO = Path(__file__).resolve().parents[2]


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


def _up(
    tmp_path: Path, *flags: str, cwd: Path | None = None
) -> tuple[subprocess.Popen[str], list[str], Kubectl]:
    """``kelastic local up`` started in ``cwd`` (default ``tmp_path``) and ready: (process, lines printed, kubectl)."""
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
        cwd=cwd or tmp_path,
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


def _children(parent: int, program: str) -> list[int]:
    """The pids of ``parent``'s children that run ``program`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv0 = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and argv0 == program:
            found.append(int(stat.parent.name))
    return found


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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_up_with_kueue_queues_the_example_as_docs_kueue_says(
    control_plane_bin: Path, tmp_path: Path
) -> None:
    """A newcomer's steps of docs/kueue.md: ``kelastic local up --control-plane DIR --kueue``, then
    ``kubectl apply -f examples/kueue.yaml`` (the real kubectl of the build): the first job is
    admitted, the second waits for quota and runs once the first ends; Kueue stops with the rest."""
    from kelastic.localcluster.kueue import find_kueue_dir

    kueue = find_kueue_dir()
    if kueue is None or not (kueue / "bin" / "kueue").is_file():
        pytest.skip("no Kueue build: run `make kueue` (or set KELASTIC_KUEUE to such a directory)")
    started = time.monotonic()
    up, printed, kubectl = _up(tmp_path, "--control-plane", str(control_plane_bin), "--kueue", cwd=REPO)
    timings = {"up (s)": time.monotonic() - started}
    try:
        assert any("Kueue v" in line and "ready after" in line for line in printed), printed
        # The operator is the chart's Deployment, installed with kueue.enabled.
        deployments = json.loads(kubectl("get", "deployments", "-n", "kelastic-system", "-o", "json"))[
            "items"
        ]
        assert [
            d["spec"]["template"]["spec"]["containers"][0]["args"].count("--kueue") for d in deployments
        ] == [1]
        applied = time.monotonic()
        kubectl("apply", "-f", str(REPO / "examples" / "kueue.yaml"))

        def queue_of(job: str) -> dict[str, object]:
            return dict(
                json.loads(kubectl("get", "ej", job, "-o", "json")).get("status", {}).get("queue") or {}
            )

        full = {"queued-first": 3, "queued-second": 2}

        def one_admitted_one_waiting() -> tuple[str, str, dict[str, object]] | None:
            # Kueue takes the Workload made first; one apply makes both, so either may lead.
            for lead, other in (("queued-first", "queued-second"), ("queued-second", "queued-first")):
                waiting = queue_of(other)
                # Kueue's own reason, not the operator's "waiting for Kueue" before Kueue looked.
                if queue_of(lead).get("admitted") == full[lead] and "insufficient" in str(
                    waiting.get("message")
                ):
                    return lead, other, waiting
            return None

        lead, other, waiting = wait_for(one_admitted_one_waiting, 180, "one job admitted, the other waiting")
        assert waiting.get("admitted") == 0 and "insufficient unused quota" in str(waiting["message"]), (
            waiting
        )
        table = kubectl("get", "ej")
        assert f"team-a: {full[lead]} admitted" in table, table
        assert f"team-a: 0 admitted, {full[other]} pending" in table, table
        for name in (lead, other):  # in that order: the other waited for the first
            wait_for(
                lambda n=name: (
                    kubectl("get", "ej", n, "-o", "jsonpath={.status.phase}") == "Succeeded" or None
                ),
                300,
                f"{name} to succeed",
                interval=1,
            )
        timings["apply -> both jobs succeeded (s)"] = time.monotonic() - applied
        workloads = json.loads(kubectl("get", "kueueworkloads", "-o", "json"))["items"]
        finished = {
            w["metadata"]["labels"]["kelastic.dev/job-name"]
            for w in workloads
            if any(c["type"] == "Finished" and c["status"] == "True" for c in w["status"]["conditions"])
        }
        assert finished == {"queued-first", "queued-second"}, workloads
        (kueue_pid,) = _children(up.pid, str(kueue.resolve() / "bin" / "kueue"))
    finally:
        _stop(up)
    assert up.returncode == 0, up.returncode
    assert not process_alive(kueue_pid), "Kueue's manager outlived kelastic local up"
    print(json.dumps(timings))

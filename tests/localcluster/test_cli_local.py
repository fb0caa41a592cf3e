"""``kelastic local run`` and ``kelastic local up`` as a user runs them (real processes, real kubectl)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.localcluster.testing import Kubectl, process_alive, wait_for

KELASTIC = [sys.executable, "-m", "kelastic.localcluster"]

GOOD = """
apiVersion: v1
kind: Pod
metadata: {name: hello}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: python:3.11
    command: [python, -c]
    args:
    - |
      import time
      print("starting")
      for i in range(5):
          print(f"\\rstep {i + 1}/5", end="", flush=True)
          time.sleep(0.05)
      print()
      print("done")
---
apiVersion: v1
kind: Pod
metadata: {name: second}
spec:
  restartPolicy: Never
  containers:
  - {name: main, image: x, command: [python, -c, "print('second pod')"]}
---
apiVersion: v1
kind: Service
metadata: {name: svc}
spec:
  selector: {app: x}
  ports: [{port: 80}]
"""

BAD = """
apiVersion: v1
kind: Pod
metadata: {name: failing}
spec:
  restartPolicy: Never
  containers:
  - {name: main, image: x, command: [python, -c, "import sys; print('about to fail'); sys.exit(3)"]}
---
apiVersion: v1
kind: Pod
metadata: {name: slow}
spec:
  restartPolicy: Never
  containers:
  - {name: main, image: x, command: [python, -c, "import time; time.sleep(600)"]}
"""


def _run(
    tmp_path: Path, manifest: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest)
    return subprocess.run(
        [*KELASTIC, "local", "run", str(path), "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_local_run_succeeds_and_streams_logs(tmp_path: Path) -> None:
    proc = _run(tmp_path, GOOD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[hello] starting" in out and "[hello] done" in out and "[second] second pod" in out
    assert "[hello] step 5/5" in out and "step 1/5step" not in out  # carriage returns collapsed
    assert "pod/hello   Succeeded " in out and "pod/second  Succeeded " in out
    assert "kelastic: succeeded" in out


@pytest.mark.slow
def test_local_run_fails_with_the_failing_pod(tmp_path: Path) -> None:
    proc = _run(tmp_path, BAD)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[failing] about to fail" in proc.stdout
    assert "pod/failing  Failed      main: exit 3" in proc.stdout
    # One failure ends the run: the other pod is stopped, not waited for.
    assert "pod/slow     Unfinished  Running" in proc.stdout
    assert "kelastic: FAILED" in proc.stdout


WIDGET = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.dev}
spec:
  group: example.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
---
apiVersion: example.dev/v1
kind: Widget
metadata: {name: w}
spec: {size: 1}
"""


def test_local_run_fails_fast_when_the_operator_dies(tmp_path: Path) -> None:
    broken = f"{sys.executable} -c \"import sys; print('operator cannot start: bad flag'); sys.exit(3)\""
    proc = _run(tmp_path, WIDGET, env={"KELASTIC_LOCAL_OPERATOR": broken})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "widget/w  Unfinished" in proc.stdout
    assert "the operator exited with code 3" in proc.stdout
    assert "operator cannot start: bad flag" in proc.stdout


def test_local_run_rejects_a_bad_manifest(tmp_path: Path) -> None:
    proc = _run(tmp_path, "kind: Pod\nmetadata: {name: x}\n")
    assert proc.returncode == 2
    assert "document 1 has no apiVersion" in proc.stderr


TREE = (
    "import os, subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {c.pid}')\n"
    "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(600)\n"
)


@contextlib.contextmanager
def _local_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str], list[int]]]:
    """``kelastic local up`` with one pod running a process tree: (process, output so far, tree pids)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    kubeconfig = tmp_path / "kubeconfig"
    up = subprocess.Popen(
        [
            *KELASTIC,
            "local",
            "up",
            "--kubeconfig",
            str(kubeconfig),
            "--no-operator",
            "--data-dir",
            str(tmp_path / "d"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout or []], daemon=True).start()
    printed: list[str] = []
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not any("export KUBECONFIG=" in line for line in printed):
            assert time.monotonic() < deadline, f"kelastic local up printed no kubeconfig: {printed}"
            try:
                printed.append(lines.get(timeout=1))
            except queue.Empty:
                assert up.poll() is None, f"kelastic local up exited early: {printed}"
        assert f"  export KUBECONFIG={kubeconfig}\n" in printed
        pidfile = tmp_path / "pids"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper"},
            "spec": {
                "containers": [
                    {"name": "main", "image": "x", "command": ["python", "-c", TREE, str(pidfile)]}
                ]
            },
        }
        Kubectl(kubeconfig)("apply", "-f", "-", input=json.dumps(pod))
        text = wait_for(lambda: pidfile.exists() and pidfile.read_text(), 20, "the pod's processes to start")
        pids += [int(p) for p in text.split()]
        assert all(process_alive(p) for p in pids)
        yield up, printed, pids
        up.wait(30)
        while not lines.empty():
            printed.append(lines.get())
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        for pid in pids:  # never leave a process behind, even when the test failed
            with contextlib.suppress(OSError):
                if b"time.sleep(600)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_local_up_prints_the_kubeconfig_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    with _local_up(tmp_path) as (up, printed, pids):
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        assert not [p for p in pids if process_alive(p)], "pod processes outlived kelastic local up"
    assert "kelastic: stopped\n" in printed


def test_pod_processes_die_even_when_local_up_is_killed(tmp_path: Path) -> None:
    with _local_up(tmp_path) as (up, _, pids):
        up.send_signal(signal.SIGKILL)  # no chance to clean up: the shims must
        up.wait(10)
        wait_for(
            lambda: not [p for p in pids if process_alive(p)],
            10,
            "the pod's process tree to die with kelastic",
        )


@pytest.mark.slow
def test_local_run_interrupted_stops_everything(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "long"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "x", "command": ["python", "-c", TREE, str(pidfile)]}],
        },
    }
    manifest = tmp_path / "long.json"
    manifest.write_text(json.dumps(pod))
    run = subprocess.Popen(
        [*KELASTIC, "local", "run", str(manifest)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        text = wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the pod's processes to start")
        pids = [int(p) for p in text.split()]
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=30)
        assert run.returncode == 130, out
        assert "kelastic: interrupted; everything was stopped" in out
        assert not [p for p in pids if process_alive(p)], "pod processes outlived an interrupted run"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()

"""The example manifest and the rendered chart against the operator's validation and an API server.

Fast checks that need no running job: the example ElasticJob parses into the
spec the operator would run, and an API server (``kelastic local``'s, driven by
the real kubectl) accepts the CRD, the chart's objects and the example.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.spec import parse_job

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is a dev dependency: pip install -e '.[dev]'"
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "elasticjob.yaml"
POD_EXAMPLE = REPO / "examples" / "pod.yaml"
CHART = REPO / "helm" / "kelastic"


def example() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d["kind"] == "ElasticJob"]
    return doc


def test_example_job_is_what_the_operator_runs() -> None:
    body = example()
    body["metadata"].update(uid="0f4c1d8e-0000-4000-8000-000000000001", namespace="default")
    job = parse_job(body)
    assert job.error is None, job.error
    spec = job.spec
    assert spec is not None
    assert (spec.min_replicas, spec.max_replicas, spec.replicas) == (2, 4, 3)
    assert spec.command.interpreter == "python" and spec.command.program == "examples/train.py"
    checkpoint_args = [a for a in spec.command.args if a.startswith("--checkpoint-dir=")]
    assert checkpoint_args == ["--checkpoint-dir=/checkpoints/{run_id}"]
    pod = worker_pod(job, 0, endpoint="127.2.0.10:29400", config=BuildConfig())
    (main,) = pod["spec"]["containers"]
    assert main["command"][-len(spec.command.args) - 1 :] == ["examples/train.py", *spec.command.args]
    (inject,) = pod["spec"]["initContainers"]  # the agent, injected: no root init container
    assert inject["command"][:3] == ["python", "-m", "kelastic.agent.inject"]
    mount = main["volumeMounts"][0]
    volume = pod["spec"]["volumes"][0]
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints"}
    assert volume["persistentVolumeClaim"]["claimName"] == "train-example-checkpoints"
    # The whole pod passes the restricted Pod Security Standard.
    from kelastic.localcluster.apiserver.podsecurity import Level, violations

    assert violations(pod["spec"], Level.RESTRICTED) == []


@pytest.fixture
def kubectl(tmp_path: Path) -> Iterator[list[str]]:
    with LocalCluster(tmp_path / "cluster", workdir=REPO) as cluster:
        yield ["kubectl", "--kubeconfig", str(cluster.kubeconfig)]


def run(cmd: list[str], stdin: str | None = None) -> str:
    result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(cmd)} failed: {result.stderr}"
    return result.stdout


def test_api_server_accepts_crd_chart_and_example(kubectl: list[str]) -> None:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        crd = chart.crds[0]["data"]
        manifests = chart.render({}, name="kelastic", namespace="default", is_install=True)
    rendered = "\n---\n".join(text for path, text in sorted(manifests.items()) if path.endswith(".yaml"))
    assert "created" in run([*kubectl, "apply", "-f", "-"], stdin=crd)
    out = run([*kubectl, "apply", "-f", "-"], stdin=rendered)
    for kind in ("serviceaccount", "role.rbac", "rolebinding.rbac", "deployment.apps"):
        assert f"{kind}" in out, out
    run([*kubectl, "apply", "-f", str(EXAMPLE)])
    stored = json.loads(run([*kubectl, "get", "ej", "train-example", "-o", "json"]))
    # Schema defaults were applied by the server, as they would be in a cluster.
    assert stored["spec"]["backoffLimit"] == 6 and stored["spec"]["rdzvBackend"] == "kelastic"
    assert stored["spec"]["replicaSpecs"]["Worker"]["replicas"] == 3


@pytest.mark.slow
def test_plain_pod_example_runs_train_py_to_completion(kubectl: list[str]) -> None:
    """examples/pod.yaml: one process of examples/train.py in a pod of kelastic local."""
    run([*kubectl, "apply", "-f", str(POD_EXAMPLE)])
    deadline = time.monotonic() + 90
    phase = ""
    while time.monotonic() < deadline:
        phase = run([*kubectl, "get", "pod", "train-single", "-o", "jsonpath={.status.phase}"])
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    logs = run([*kubectl, "logs", "train-single"])
    assert phase == "Succeeded", f"pod train-single is {phase or 'not started'} after 90 s:\n{logs}"
    assert "[train] done: 100 steps" in logs


PLAY_MIN_SECONDS = 180.0  # a scale, a pod deletion and their recoveries, typed by hand


def _readme_play_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    play = text[text.index("To play with a job while it runs") :]
    block = play[play.index("export KUBECONFIG") : play.index("```", play.index("export KUBECONFIG"))]
    return [line.split("#", 1)[0].split() for line in block.splitlines() if line.startswith("kubectl")]


def test_readme_play_section_applies_a_job_that_runs_long_enough_to_play_with() -> None:
    commands = _readme_play_commands()
    (applied,) = [c[c.index("-f") + 1] for c in commands if c[1] == "apply"]
    (doc,) = [d for d in yaml.safe_load_all((REPO / applied).read_text()) if d and d["kind"] == "ElasticJob"]
    body = {**doc, "metadata": {**doc["metadata"], "uid": "0f4c1d8e-0000-4000-8000-000000000002"}}
    job = parse_job(body)
    assert job.error is None and job.spec is not None, job.error
    flags = dict(a.removeprefix("--").split("=", 1) for a in job.spec.command.args if "=" in a)
    # The least it can take: every step sleeps --step-delay, whatever the machine.
    assert int(flags["steps"]) * float(flags["step-delay"]) >= PLAY_MIN_SECONDS
    name = doc["metadata"]["name"]
    (scaled,) = [c[3] for c in commands if c[1] == "scale"]
    deleted = [c[3] for c in commands if c[1:3] == ["delete", "pod"]]
    logged = [c[-1] for c in commands if c[1] == "logs"]
    assert scaled == name and all(p.startswith(f"{name}-worker-") for p in deleted + logged)

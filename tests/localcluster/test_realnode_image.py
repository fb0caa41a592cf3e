"""The image built by BuildKit from the repository's Dockerfile, in real containers on real nodes.

- the kelastic image runs ``kelastic-agent``, ``kelastic-rendezvous`` and ``kelastic-operator``
  as uid 10001 under the chart's pod and container security contexts (read-only root
  filesystem, no capabilities, RuntimeDefault seccomp), and cannot write its own files;
- the plain PyTorch image (the same Dockerfile's torch step, nothing more) has torch and no
  kelastic;
- the README's main example (``examples/elasticjob.yaml``: three workers of the kelastic image,
  the agent injected from the same image, the rendezvous store in its own pod, checkpoints on
  a claim) runs to Succeeded on the two nodes, with the operator running on the host against
  the lane's control plane (``--no-network-policy``: the host is not one of the operator's
  pods, which the job's policies admit by their labels).

The images are built (or brought up to date from BuildKit's cache) by the module's fixture,
which prints the build's cold or warm time and each node's import time. Needs root, ``make
node``, ``make control-plane`` and ``make image`` (BuildKit); skipped otherwise, with a reason
that says what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.localcluster.node.imagebuild import (
    KELASTIC_IMAGE,
    PYTORCH_IMAGE,
    BuildKit,
    BuiltImages,
    build_images,
)

from .realnode_harness import Lane, node_dir_or_skip, report, running_lane

# Importing the two images (about 5 GB each, unpacked) into two nodes takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((REPO / "helm" / "kelastic" / "values.yaml").read_text())

#: Runs as the chart's operator container would; prints what it is and what each entrypoint said.
ENTRYPOINTS = """
id -u; id -g; pwd
for command in kelastic-agent kelastic-rendezvous kelastic-operator; do
    if help=$("$command" --help 2>&1); then echo "$command ok: $(echo "$help" | head -1)"
    else echo "$command failed: $help"; fi
done
touch /opt/kelastic/written 2>/dev/null && echo "root filesystem writable" || echo "root filesystem read-only"
"""


@pytest.fixture(scope="module")
def built() -> BuiltImages:
    node_dir = node_dir_or_skip()
    try:
        buildkit = BuildKit.find()
    except FileNotFoundError as exc:
        pytest.skip(f"the image tests need BuildKit: {exc}")
    started = time.monotonic()
    images = build_images(node_dir / "runc", buildkit)
    sizes = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in images.sizes().items())
    steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in images.timings.items())
    line = f"image build ({'cold' if images.cold else 'warm'}) {time.monotonic() - started:.1f} s ({steps}); {sizes}"
    print(line)
    report(line)
    return images


@pytest.fixture(scope="module")
def lane(
    built: BuiltImages, control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lane]:
    state = tmp_path_factory.mktemp("realnode-image")
    with running_lane(control_plane_bin, state, images=list(built.layouts.values())) as running:
        imports = {k: v for k, v in running.nodes.timings.items() if k.startswith("import ")}
        print("imports: " + ", ".join(f"{k} {v:.1f} s" for k, v in imports.items()))
        yield running


def run_pod(
    lane: Lane, name: str, node: str, image: str, container: dict[str, Any], pod: dict[str, Any]
) -> str:
    """Run a pod to completion on ``node``; its log. Fails with its status when it did not succeed."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            **pod,
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", **container}],
        },
    }
    lane.apply(manifest)
    deadline = time.monotonic() + 180
    phase = ""
    while time.monotonic() < deadline:
        phase = lane.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}").strip()
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    log = lane.kubectl("logs", name, check=False)
    status = json.loads(lane.kubectl("get", "pod", name, "-o", "json"))["status"]
    assert phase == "Succeeded", f"pod {name} ({image}) ended {phase or 'never'}: {status}\nlog:\n{log}"
    return log


def test_the_kelastic_image_runs_its_entrypoints_as_10001_on_a_read_only_root(lane: Lane) -> None:
    node = lane.node_names()[0]
    log = run_pod(
        lane, "entrypoints", node, KELASTIC_IMAGE,
        {"command": ["sh", "-c", ENTRYPOINTS], "securityContext": VALUES["securityContext"]},
        {"securityContext": VALUES["podSecurityContext"]},
    )  # fmt: skip
    lines = log.splitlines()
    assert lines[:3] == ["10001", "10001", "/opt/kelastic"], log
    for command in ("kelastic-agent", "kelastic-rendezvous", "kelastic-operator"):
        assert any(line.startswith(f"{command} ok: usage: {command}") for line in lines), log
    assert lines[-1] == "root filesystem read-only", log


def test_the_plain_pytorch_image_has_torch_and_no_kelastic(lane: Lane) -> None:
    node = lane.node_names()[-1]
    program = (
        "import importlib.util, torch; print(torch.__version__, importlib.util.find_spec('kelastic') is None)"
    )
    log = run_pod(lane, "plain-torch", node, PYTORCH_IMAGE, {"command": ["python", "-c", program]}, {})
    version, no_kelastic = log.split()[-2:]
    assert version.startswith("2.13.0"), log
    assert no_kelastic == "True", log


#: Each container that ended: pod, container, reason, exit code, message (its log's tail).
ENDED = (
    "{range .items[*]}{range .status.initContainerStatuses[*]}{.name} {.state.terminated.reason} "
    '{.state.terminated.exitCode} {.state.terminated.message}{"\\n"}{end}'
    "{range .status.containerStatuses[*]}{.name} {.state.terminated.reason} {.state.terminated.exitCode} "
    '{.state.terminated.message}{"\\n"}{end}{end}'
)


def checkpoint_volume(lane: Lane) -> dict[str, Any]:
    """A ReadWriteMany hostPath volume for the example's claim: the lane's nodes share the
    host's filesystem, so every pod of the job sees the same directory (removed with the lane)."""
    assert lane.nodes.plan is not None
    path = lane.nodes.plan.root / "volumes" / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 10001, 10001)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "example-checkpoints"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "Directory"},
        },
    }


def test_the_readme_example_succeeds_on_two_real_nodes(lane: Lane, tmp_path: Path) -> None:
    lane.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "elasticjob.yaml"))
    lane.kubectl("wait", "--for=condition=Established", "crd/elasticjobs.kelastic.dev", "--timeout=60s")
    lane.apply(checkpoint_volume(lane))
    operator_log = tmp_path / "operator.log"
    argv = [
        str(Path(sys.executable).parent / "kelastic-operator"), f"--kubeconfig={lane.control_plane.admin_kubeconfig}",
        "-n", "default", "--standalone", f"--agent-image={KELASTIC_IMAGE}", "--no-network-policy",
    ]  # fmt: skip
    with open(operator_log, "wb") as log:
        operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        lane.kubectl("apply", "-f", str(REPO / "examples" / "elasticjob.yaml"))
        deadline = time.monotonic() + 600
        phase, seen, worker_logs, nodes = "", "", "", set[str]()
        while time.monotonic() < deadline and operator.poll() is None:
            phase = lane.kubectl("get", "ej", "train-example", "-o", "jsonpath={.status.phase}").strip()
            if phase in ("Succeeded", "Failed"):
                break
            nodes.update(lane.kubectl("get", "pods", "-o", "jsonpath={.items[*].spec.nodeName}").split())
            now = lane.kubectl("get", "pods", "-o", "wide", "--no-headers", check=False) + lane.kubectl(
                "get", "pods", "-o", "jsonpath=" + ENDED, check=False
            )
            worker_logs = (
                lane.kubectl("logs", "-l", "kelastic.dev/role=worker", "-c", "trainer", "--prefix", "--tail=40",
                             check=False) or worker_logs
            )  # fmt: skip
            if now != seen:
                print(f"job {phase or 'pending'}; pods:\n{now}")
                seen = now
            time.sleep(2)
        status = lane.kubectl("get", "ej", "train-example", "-o", "jsonpath={.status}")
        events = lane.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False).splitlines()[-25:]
        logs = "\n".join(operator_log.read_text(errors="replace").splitlines()[-30:])
        assert phase == "Succeeded", (
            f"the example ended {phase or 'never'}: {status}\noperator log:\n{logs}\nevents:\n"
            + "\n".join(events)
            + f"\nthe workers' last lines:\n{worker_logs}"
        )
        assert nodes == set(lane.node_names()), f"the job's pods ran on {nodes} only"
    finally:
        operator.terminate()
        operator.wait(30)

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
- the chart, installed with Helm's install action, runs the operator in-cluster (its service
  account and RBAC, the jobs' NetworkPolicies on); a job of the plain PyTorch image, the
  agent injected, in a ``restricted`` namespace, trains on both nodes through its policies
  (enforced by kube-router: the operator pod reaches the workers' health port and the store, a
  stranger wearing the job's labels does not), a worker force-deleted and a rank OOM-killed
  (said so in a ``WorkersRestarted`` Event), to Succeeded;
- a node killed under such a job (last: the node stays dead): the other worker trains on at
  world size 1 without waiting for the dead pod; the control plane evicts the dead pod after
  its short toleration, the operator force-deletes it (its kubelet cannot end it), and its
  replacement joins on the node left: the job trains at world size 2 again. Another job's
  store pod on that node is replaced the same way while its worker trains on.
- under the same chart: a hot standby (``standbyReplicas: 1``) takes a force-deleted member's
  place in one re-form, at the same world size; a job scaled 2 -> 3 -> 2 resumes each time
  from the memory checkpoint at the step it reached (scaled down, from a peer's replica);
  Kueue's manager against the lane's control plane queues a job until its LocalQueue
  exists, then admits it onto both nodes, to Succeeded (the chart upgraded with
  ``kueue.enabled`` meanwhile).

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

from kelastic.agent import contract
from kelastic.localcluster.node.imagebuild import (
    KELASTIC_IMAGE,
    PYTORCH_IMAGE,
    BuildKit,
    BuiltImages,
    build_images,
)

from .realnode_harness import (
    LISTENER,
    Lane,
    debian_pod,
    node_dir_or_skip,
    report,
    running_lane,
    wait_pods_ready,
)
from .realnode_jobs import (
    CONNECT,
    OPERATOR_NS,
    JobWatch,
    Resumed,
    app_config_map,
    diagnostics,
    elastic_job,
    event_messages,
    events,
    install_operator,
    kueue_queues,
    plain_pytorch_job,
    reinstall_operator,
    resumes,
    step_of,
    trainer_logs,
    worker_pods,
)

#: The control plane's grace for a silent node in this lane (``--node-monitor-grace-period``):
#: the node-kill test waits this long for the dead node's pods to be evicted (the lane's
#: default waits 60 s). The kubelets post their status every 5 s: a live node misses four.
GRACE_S = 20.0

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
    with running_lane(
        control_plane_bin, state, images=list(built.layouts.values()), node_monitor_grace=GRACE_S
    ) as running:
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


def probe_connect(
    lane: Lane, namespace: str, target: str, targets: list[tuple[str, int]], container: str
) -> list[bool]:
    """Which of ``targets`` accept a TCP connection from ``target`` (a pod, or ``deploy/NAME``)."""
    out = lane.kubectl(
        "exec", "-n", namespace, target, "-c", container, "--", "python3", "-c", CONNECT, json.dumps(targets)
    )
    return list(json.loads(out.strip().splitlines()[-1]))


def check_network_policies(lane: Lane, namespace: str, job: str, operator_deployment: str) -> None:
    """The operator's two policies exist, and kube-router enforces them: the operator pod
    reaches the workers' health port and the store; a pod of another namespace wearing the
    job's worker labels reaches neither."""
    policies = json.loads(lane.kubectl("get", "networkpolicy", "-n", namespace, "-o", "json"))["items"]
    owned = sorted(
        p["metadata"]["name"] for p in policies
        if any(o.get("kind") == "ElasticJob" and o.get("name") == job for o in p["metadata"].get("ownerReferences", []))
    )  # fmt: skip
    assert len(owned) == 2, f"the operator made these NetworkPolicies for {job}: {owned} (all: {policies})"
    targets = [
        (p["status"]["podIP"], contract.DEFAULT_HEALTH_PORT) for p in worker_pods(lane, namespace, job)
    ]
    store = lane.kubectl("get", "pods", "-n", namespace, "-l", f"{contract.LABEL_JOB_NAME}={job},"
                         f"{contract.LABEL_ROLE}={contract.ROLE_RENDEZVOUS}", "-o", "jsonpath={.items[0].status.podIP}")  # fmt: skip
    targets.append((store.strip(), contract.DEFAULT_RDZV_PORT))
    operator = probe_connect(lane, OPERATOR_NS, f"deploy/{operator_deployment}", targets, "operator")
    assert operator == [True] * len(targets), (
        f"the operator pod reached {list(zip(targets, operator, strict=True))}"
    )
    lane.kubectl("create", "namespace", "outsider")
    labels = {contract.LABEL_JOB_NAME: job, contract.LABEL_ROLE: contract.ROLE_WORKER}
    lane.apply(debian_pod("stranger", "outsider", lane.node_names()[0], labels, LISTENER))
    wait_pods_ready(lane, ["outsider"], timeout=120)
    stranger = probe_connect(lane, "outsider", "stranger", targets, "main")
    assert stranger == [False] * len(targets), (
        f"a stranger reached {list(zip(targets, stranger, strict=True))}"
    )
    print(f"NetworkPolicies {owned}: the operator reached {targets}, a stranger none")


#: The namespace of the chart's jobs, which enforces the ``restricted`` Pod Security Standard.
JOBS = "train"


@pytest.fixture(scope="module")
def operator(lane: Lane) -> str:
    """The chart installed in-cluster, serving :data:`JOBS`; its Deployment's name."""
    started = time.monotonic()
    deployment = install_operator(lane, JOBS, lane.node_names()[0])
    lane.kubectl("label", "namespace", JOBS, "pod-security.kubernetes.io/enforce=restricted")
    report(f"chart installed, its operator available after {time.monotonic() - started:.1f} s")
    return deployment


def test_the_chart_runs_a_plain_pytorch_job_in_a_restricted_namespace(lane: Lane, operator: str) -> None:
    """The operator in-cluster (the chart, its RBAC, the jobs' NetworkPolicies on), a job of
    the plain PyTorch image with the agent injected, in a ``restricted`` namespace, on both
    nodes: through a worker force-deleted and a rank OOM-killed, to Succeeded."""
    namespace, job = JOBS, "plain"
    started = time.monotonic()
    lane.apply(app_config_map(job, namespace), plain_pytorch_job(job, namespace, PYTORCH_IMAGE, 2, steps=600))
    watch = JobWatch(lane, namespace, job)
    status = watch.until("both workers training", lambda s: s.get("worldSize") == 2 and step_of(s) >= 10, 420)
    report(f"a plain PyTorch job training on two nodes after {time.monotonic() - started:.1f} s")
    check_network_policies(lane, namespace, job, operator)

    # A worker force-deleted: the group re-forms (with its replacement) and goes on.
    victim = worker_pods(lane, namespace, job)[-1]["metadata"]["name"]
    forms, step = status.get("restarts") or 0, step_of(watch.status())
    deleted = time.monotonic()
    lane.kubectl("delete", "pod", "-n", namespace, victim, "--grace-period=0", "--force")
    status = watch.until(
        f"the group re-formed at 2 past step {step} after {victim} was force-deleted",
        lambda s: (s.get("restarts") or 0) > forms and s.get("worldSize") == 2 and step_of(s) > step + 5,
    )  # fmt: skip
    report(f"force-deleted worker: training again at world size 2 after {time.monotonic() - deleted:.1f} s")

    # A rank past its memory limit: the kernel kills it (the container goes on: its agent is
    # not the largest process), its agent restarts it as after a crash and says why, and the
    # operator says so in the job's status and Events.
    victim = worker_pods(lane, namespace, job)[0]["metadata"]["name"]
    forms, step = status.get("restarts") or 0, step_of(status)
    oom = time.monotonic()
    lane.kubectl("exec", "-n", namespace, victim, "-c", "trainer", "--", "touch", "/tmp/kelastic-oom")
    said: list[str] = []

    def oom_said(s: dict[str, Any]) -> bool:
        said[:] = [
            e for e in events(lane, namespace, last=80) if "WorkersRestarted" in e and "OOM-killed" in e
        ]
        return (
            bool(said)
            and (s.get("restarts") or 0) > forms
            and s.get("worldSize") == 2
            and step_of(s) > step + 5
        )

    status = watch.until(
        f"an Event to say a rank of {victim} was OOM-killed, and training at 2 past step {step}", oom_said
    )
    print(f"the Event: {said[-1]}\nstatus.lastFailure: {status.get('lastFailure')}")
    report(
        f"OOM-killed rank: training again at world size 2 after {time.monotonic() - oom:.1f} s; said: {said[-1]}"
    )

    watch.until("Succeeded", lambda s: s.get("phase") == "Succeeded", 600)
    assert watch.nodes == set(lane.node_names()), f"the job's workers ran on {watch.nodes} only"
    report(f"the chart's job: {time.monotonic() - started:.1f} s in all")


def store_pod(lane: Lane, namespace: str, job: str) -> dict[str, Any] | None:
    """The job's rendezvous store pod (the newest, when a replacement is starting), or None."""
    selector = f"{contract.LABEL_JOB_NAME}={job},{contract.LABEL_ROLE}={contract.ROLE_RENDEZVOUS}"
    items = json.loads(lane.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]
    items.sort(key=lambda p: p["metadata"]["creationTimestamp"])
    return items[-1] if items else None


def start_with_the_store_apart(lane: Lane, namespace: str, job: str, store_node: str, node: str) -> JobWatch:
    """A job of one worker training on ``node`` whose store pod runs on ``store_node`` (both
    created while ``node`` is cordoned; then the other is, and the worker is deleted: its
    replacement goes to ``node``). Leaves ``store_node`` cordoned."""
    lane.kubectl("cordon", node)
    lane.apply(
        app_config_map(job, namespace), plain_pytorch_job(job, namespace, PYTORCH_IMAGE, 1, steps=4000)
    )
    waited = time.monotonic()
    while (
        len(worker_pods(lane, namespace, job)) != 1
        or (store_pod(lane, namespace, job) or {}).get("spec", {}).get("nodeName") != store_node
    ):
        assert time.monotonic() - waited < 120, f"{job}'s pods were not created.\n" + diagnostics(
            lane, namespace, job
        )
        time.sleep(1)
    lane.kubectl("uncordon", node)
    lane.kubectl("cordon", store_node)
    lane.kubectl("delete", "pod", "-n", namespace, f"{job}-worker-0", "--wait=false")
    watch = JobWatch(lane, namespace, job)
    watch.until(
        f"{job}'s worker training on {node}, its store on {store_node}",
        lambda s: (
            s.get("worldSize") == 1
            and step_of(s) >= 5
            and [p["spec"].get("nodeName") for p in worker_pods(lane, namespace, job)] == [node]
        ),
        300,
    )
    return watch


def check_the_store_replaced(
    lane: Lane, watch: JobWatch, dead: dict[str, Any], worker_uid: str, node: str, killed_at: float
) -> None:
    """The store pod ``dead`` of ``watch``'s job, on the node killed at ``killed_at``, is
    force-deleted and replaced on ``node``; the job's one worker (``worker_uid``) trained on
    meanwhile, and reports its progress through the new store."""
    namespace, job = watch.namespace, watch.name
    step = step_of(watch.status())

    def replaced(s: dict[str, Any]) -> bool:
        store = store_pod(lane, namespace, job) or {}
        return (
            store.get("metadata", {}).get("uid") not in (None, dead["metadata"]["uid"])
            and store["spec"].get("nodeName") == node
            and store["status"].get("phase") == "Running"
            and step_of(s) > step + 5
        )

    watch.until(f"{job}'s store replaced on {node} and its progress read from there", replaced, GRACE_S + 240)
    replaced_after = time.monotonic() - killed_at
    workers = worker_pods(lane, namespace, job)
    assert [p["metadata"]["uid"] for p in workers] == [worker_uid], (
        f"{job}'s worker was replaced while its store was: {[p['metadata']['name'] for p in workers]}"
    )
    name = dead["metadata"]["name"]
    said = [e for e in events(lane, namespace, last=120) if "ForceDeleted" in e and name in e]
    assert said, f"no ForceDeleted Event names the store pod {name}\n" + diagnostics(lane, namespace, job)
    line = (
        f"store pod on the node killed: replaced on {node}, the job's progress read from the new store, "
        f"after {replaced_after:.1f} s; its worker trained on"
    )
    print(f"{line}\nthe Event: {said[-1]}")
    report(line)


def figure(line: str) -> None:
    """Print a scenario's figure and add it to the lane's report."""
    print(line)
    report(line)


def test_a_hot_standby_takes_a_lost_members_place_at_the_same_world_size(lane: Lane, operator: str) -> None:
    """``spec.standbyReplicas: 1``: two members train on the two nodes, a third pod waits in
    the rendezvous without a rank. A member force-deleted: the standby takes its place in the
    one re-form the loss causes (no shrink to 1 and growth back), the job trains on at world
    size 2, and the deleted pod's replacement waits as the next standby."""
    namespace, job = JOBS, "standby"
    started = time.monotonic()
    lane.apply(
        app_config_map(job, namespace), elastic_job(job, namespace, PYTORCH_IMAGE, 2, steps=5000, standby=1)
    )
    watch = JobWatch(lane, namespace, job)
    status = watch.until(
        "two members training and a standby waiting",
        lambda s: s.get("worldSize") == 2 and (s.get("standbys") or 0) == 1 and step_of(s) >= 20,
        420,
    )
    figure(f"a job of 2 members and 1 standby training after {time.monotonic() - started:.1f} s")
    logs = trainer_logs(lane, namespace, job)
    # A pod that waited as a standby while the group first formed may have become a member
    # since; a pod that never said so has been a member throughout.
    standbys = [pod for pod, log in logs.items() if "is a standby, waiting" in log]
    assert standbys and len(standbys) < len(logs), (
        f"pods that said they wait as a standby: {standbys} of {list(logs)}\n"
        + diagnostics(lane, namespace, job)
    )
    victim = next(pod for pod in logs if pod not in standbys)
    forms, step = status.get("restarts") or 0, step_of(status)
    deleted = time.monotonic()
    lane.kubectl("delete", "pod", "-n", namespace, victim, "--grace-period=0", "--force")
    status = watch.until(
        f"training at world size 2 past step {step} after member {victim} was force-deleted",
        lambda s: (s.get("restarts") or 0) > forms and s.get("worldSize") == 2 and step_of(s) > step,
    )
    took = time.monotonic() - deleted
    assert status.get("restarts") == forms + 1, (
        f"the group re-formed {status.get('restarts', 0) - forms} times to train at 2 again, not once "
        f"(the standby should take the lost member's place in the loss's re-form): {status}"
    )
    figure(
        f"hot standby: a standby took {victim}'s place, training again at world size 2 "
        f"(one re-form) after {took:.1f} s"
    )
    watch.until(
        "the deleted member's replacement waiting as the next standby",
        lambda s: (s.get("standbys") or 0) == 1 and s.get("worldSize") == 2,
        300,
    )
    lane.kubectl("delete", "ej", "-n", namespace, job, "--wait=false")


def rescale(lane: Lane, watch: JobWatch, replicas: int, source: str) -> tuple[Resumed, dict[str, Any], float]:
    """Scale the running job of ``watch`` to ``replicas`` (``kubectl scale``) and wait until it
    trains at that world size and the operator has the restore the re-form made, which read
    from ``source`` (``status.checkpoint.restoredFrom``); rank 0's resume at that size,
    ``status.checkpoint``, and the seconds from the scale to training."""
    status = watch.status()
    forms, step = status.get("restarts") or 0, step_of(status)
    before = (status.get("checkpoint") or {}).get("restoredTime")
    scaled = time.monotonic()
    lane.kubectl("scale", "ej", "-n", watch.namespace, watch.name, f"--replicas={replicas}")
    watch.until(
        f"training at world size {replicas} past step {step}",
        lambda s: (s.get("restarts") or 0) > forms and s.get("worldSize") == replicas and step_of(s) > step,
    )
    took = time.monotonic() - scaled
    status = watch.until(
        "the operator to have the re-form's restore",
        lambda s: (s.get("checkpoint") or {}).get("restoredTime") not in (None, before),
        120,
    )
    logs = trainer_logs(lane, watch.namespace, watch.name)
    resumed = [r for r in resumes(logs) if r.world_size == replicas]
    assert resumed, (
        f"rank 0 at world size {replicas} said no resume (it started from scratch?)\n"
        + diagnostics(lane, watch.namespace, watch.name)
    )
    # A checkpoint every 10 steps: the one restored is at most a checkpoint (and the one then
    # being saved) behind the step last reported before the scale.
    assert resumed[-1].source == "memory checkpoint" and resumed[-1].step >= step - 20, (
        f"rank 0 resumed at world size {replicas} from the {resumed[-1].source} at step {resumed[-1].step}; "
        f"the job had reached step {step} before the scale"
    )
    checkpoint = dict(status.get("checkpoint") or {})
    agents = [line for log in logs.values() for line in log.splitlines() if "restored checkpoint" in line]
    print(f"status.checkpoint: {checkpoint}\nthe agents: {agents[-replicas:]}")
    assert checkpoint.get("restoredFrom") == source, (
        f"the restore at world size {replicas} read from {checkpoint.get('restoredFrom')}, not {source}: "
        f"status.checkpoint {checkpoint}; the agents said {agents[-replicas:]}"
    )
    return resumed[-1], checkpoint, took


def test_a_job_rescaled_resumes_from_the_memory_checkpoint_at_the_step_it_reached(
    lane: Lane, operator: str
) -> None:
    """A job of two workers scaled to three, then back to two (``kubectl scale``): each time
    the group re-forms at the new world size and rank 0 resumes from the memory checkpoint at
    the step the job had reached (to a checkpoint), not from scratch. Scaled up, every part
    is read from the memory of the pod that wrote it (the new pod fetches the parts it lacks
    from them); scaled down, the parts of the pod that left are read from a peer's replica.
    ``status.checkpoint.restoredFrom`` (and a ``CheckpointRestored`` Event) says which."""
    namespace, job = JOBS, "rescale"
    lane.apply(
        app_config_map(job, namespace),
        elastic_job(job, namespace, PYTORCH_IMAGE, 2, steps=5000, max_replicas=3),
    )
    watch = JobWatch(lane, namespace, job)
    watch.until(
        "two workers training past two checkpoints",
        lambda s: (
            s.get("worldSize") == 2 and step_of(s) >= 25 and bool((s.get("checkpoint") or {}).get("latest"))
        ),
        420,
    )
    for replicas, source in ((3, "memory"), (2, "replica")):
        resumed, checkpoint, took = rescale(lane, watch, replicas, source)
        figure(
            f"scaled to {replicas}: training again at world size {replicas} after {took:.1f} s, resumed at "
            f"step {resumed.step}; restored checkpoint {checkpoint.get('restoredId')} from "
            f"{checkpoint.get('restoredFrom')} in {checkpoint.get('restoredSeconds')} s"
        )
    print("the Events: " + "; ".join(event_messages(lane, namespace, job, "CheckpointRestored")))
    lane.kubectl("delete", "ej", "-n", namespace, job, "--wait=false")


def test_kueue_queues_a_job_then_admits_it_onto_the_real_nodes(
    lane: Lane, operator: str, tmp_path: Path
) -> None:
    """Kueue's manager against the lane's control plane and the chart upgraded with
    ``kueue.enabled``: a job labelled for a LocalQueue that does not exist yet stays Queued,
    without pods; once the queues exist (as examples/kueue.yaml makes them), Kueue admits
    its two workers, they are placed on the two real nodes and the job runs to Succeeded.
    The chart is put back as it was afterwards."""
    from kelastic.localcluster.kueue import KueueBinaries, KueueManager, find_kueue_dir

    directory = find_kueue_dir()
    if directory is None:
        pytest.skip(
            "no Kueue build: run `make kueue` (sigs.k8s.io/kueue into ~/.cache/kelastic/kueue/<version>)"
        )
    namespace, job, queue = JOBS, "queued", "team-a"
    node = lane.node_names()[0]
    started = time.monotonic()
    with KueueManager(
        KueueBinaries.find(directory), lane.control_plane, tmp_path / "kueue", progress=print
    ) as kueue:
        report(f"Kueue {kueue.binaries.version} ready after {time.monotonic() - started:.1f} s")
        try:
            reinstall_operator(lane, namespace, node, kueue=True)
            lane.apply(
                app_config_map(job, namespace),
                elastic_job(job, namespace, PYTORCH_IMAGE, 2, steps=100, queue=queue),
            )
            watch = JobWatch(lane, namespace, job)
            watch.until(
                "the job Queued (its LocalQueue does not exist yet)",
                lambda s: s.get("phase") == "Queued",
                120,
            )
            assert worker_pods(lane, namespace, job) == [], (
                "a queued job has worker pods before Kueue admits it"
            )
            queued = time.monotonic()
            lane.apply(*kueue_queues(namespace, queue, cpu="1", memory="2Gi"))
            status = watch.until(
                "Kueue admitting both workers and the job training",
                lambda s: (
                    (s.get("queue") or {}).get("admitted") == 2 and s.get("worldSize") == 2 and step_of(s) > 0
                ),
                420,
            )
            admitted = time.monotonic() - queued
            print(f"status.queue: {status.get('queue')}")
            workloads = lane.kubectl(
                "get", "workloads.kueue.x-k8s.io", "-n", namespace, "-o", "wide", check=False
            )
            print(f"Kueue's Workloads:\n{workloads}")
            watch.until("Succeeded", lambda s: s.get("phase") == "Succeeded", 420)
            assert watch.nodes == set(lane.node_names()), (
                f"the admitted job's workers ran on {watch.nodes} only"
            )
            figure(
                f"Kueue: admitted and training {admitted:.1f} s after its queue was made, "
                f"Succeeded {time.monotonic() - queued:.1f} s after"
            )
        finally:
            lane.kubectl("delete", "ej", "-n", namespace, job, "--wait=false", check=False)
            reinstall_operator(lane, namespace, node, kueue=False)


# A node killed stays dead: its test is the module's last (pytest runs a module's tests in
# the order of their definitions).
def test_a_node_killed_under_a_job_leaves_it_training_at_the_smaller_size_then_grows_back(
    lane: Lane, operator: str
) -> None:
    """A node's kubelet, containerd and containers killed with SIGKILL under a running job:
    the other worker trains on alone within seconds, without waiting for the dead pod, which
    the API still shows Running. Once the node reads NotReady and the worker's toleration
    (the operator's 5 s) ran out, the control plane evicts the pod, which stays Terminating
    (its kubelet is dead) until the operator force-deletes it, saying so in a ``ForceDeleted``
    Event; its replacement starts on the node left and the job trains at world size 2 again.
    The job's store and the operator stay on the first node (the lane has two); another job,
    of one worker on the first node, has its store pod on the node killed: that store is
    force-deleted and replaced on the first node, and its worker trains on throughout. Last in
    the module: the node stays dead."""
    namespace, job = JOBS, "survivor"
    first, victim = lane.node_names()
    # Another job's store pod on the node to be killed, its worker on the first node.
    apart = start_with_the_store_apart(lane, namespace, "apart", victim, first)
    (apart_worker,) = worker_pods(lane, namespace, "apart")
    apart_store = store_pod(lane, namespace, "apart")
    assert apart_store is not None
    # The store pod and the first worker go to the first node (the other one cordoned); the
    # second worker, once the job is scaled to 2, to the other (the workers' spread).
    manifest = plain_pytorch_job(job, namespace, PYTORCH_IMAGE, 2, steps=900)
    manifest["spec"]["replicaSpecs"]["Worker"]["replicas"] = 1
    lane.apply(app_config_map(job, namespace), manifest)
    store = f"{contract.LABEL_JOB_NAME}={job},{contract.LABEL_ROLE}={contract.ROLE_RENDEZVOUS}"
    waited = time.monotonic()
    while (
        lane.kubectl("get", "pods", "-n", namespace, "-l", store, "-o", "jsonpath={.items[*].spec.nodeName}")
        != first
    ):
        assert time.monotonic() - waited < 120, f"the store was not placed on {first}.\n" + diagnostics(
            lane, namespace, job
        )
        time.sleep(1)
    watch = JobWatch(lane, namespace, job)
    watch.until("the first worker training", lambda s: s.get("worldSize") == 1 and step_of(s) >= 1, 420)
    lane.kubectl("uncordon", victim)
    scale = {"spec": {"replicaSpecs": {"Worker": {"replicas": 2}}}}
    lane.kubectl("patch", "ej", "-n", namespace, job, "--type=merge", "-p", json.dumps(scale))
    watch.until("both workers training", lambda s: s.get("worldSize") == 2 and step_of(s) >= 10, 420)
    (dead,) = [p for p in worker_pods(lane, namespace, job) if p["spec"].get("nodeName") == victim]
    step = step_of(watch.status())
    killed = lane.nodes.kill_node(victim)
    started = time.monotonic()
    status = watch.until(
        f"the job training at world size 1 past step {step} after node {victim} was killed ({len(killed)} processes)",
        lambda s: s.get("worldSize") == 1 and step_of(s) > step + 5,
        timeout=180,
    )
    shrunk = time.monotonic() - started

    def replaced(s: dict[str, Any]) -> bool:
        pods = worker_pods(lane, namespace, job)
        return (
            s.get("worldSize") == 2
            and step_of(s) > step_of(status) + 5
            and len(pods) == 2
            and all(p["spec"].get("nodeName") == first for p in pods)
            and dead["metadata"]["uid"] not in {p["metadata"]["uid"] for p in pods}
        )

    watch.until(
        f"the job training at world size 2 again, both workers on {first}, after the dead pod "
        f"{dead['metadata']['name']} was evicted and force-deleted",
        replaced,
        timeout=GRACE_S + 240,
    )
    grown = time.monotonic() - started
    said = [
        e for e in events(lane, namespace, last=80) if "ForceDeleted" in e and dead["metadata"]["name"] in e
    ]
    assert said and victim in said[-1], (
        f"no ForceDeleted Event names {dead['metadata']['name']} and node {victim}: {said}\n"
        + diagnostics(lane, namespace, job)
    )
    print(f"the Event: {said[-1]}")
    line = (
        f"node killed under a job: world size 1 after {shrunk:.1f} s, world size 2 again (the dead pod "
        f"force-deleted, its replacement on {first}) after {grown:.1f} s (node grace {GRACE_S:g} s)"
    )
    print(line)
    report(line)
    check_the_store_replaced(lane, apart, apart_store, apart_worker["metadata"]["uid"], first, started)

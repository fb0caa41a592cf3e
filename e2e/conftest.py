"""End-to-end fixtures: a cluster with kelastic installed through its Helm chart.

Two modes, same scenarios:

* **local** (default): a ``kelastic local`` cluster (:class:`LocalCluster`) in a
  temporary directory. The chart is rendered with the real Helm library and its
  objects are applied with the real kubectl: the CRD, the ServiceAccount, the
  RBAC and the Deployment are stored as in any cluster. The local kubelet runs
  pods, not Deployments, so the operator is started as a subprocess with exactly
  the command and arguments of the rendered Deployment (plus ``--kubeconfig``;
  its liveness endpoint moves to a free loopback port). RBAC is recorded but not
  enforced locally.
* **control-plane**: the same ``kelastic local`` cluster, but on the real
  kube-apiserver, etcd, kube-controller-manager and kube-scheduler
  (``LocalCluster(control_plane=DIR)``, binaries from the ``control_plane_bin``
  fixture of the repository's root conftest, else skipped saying how to enable
  it). The chart is installed with Helm (:func:`install_chart`): the operator
  runs as the chart's Deployment under its ServiceAccount and namespaced RBAC,
  so RBAC, admission and the real controllers are in the loop. Each lane's
  cluster is made once per session. A scenario runs on the lane where it proves
  something (``@pytest.mark.lanes(...)``, :func:`pytest_collection_modifyitems`): the
  emulator for what kelastic itself does (recovery, checkpoints, the agent's and the
  operator's decisions), as it is the faster lane; the real control plane for what
  depends on the API server's semantics (RBAC, admission, the CRD's schema, the
  scale subresource, garbage collection, a Deployment's restart). A scenario
  without the marker runs on both.
* **real**: ``KELASTIC_E2E_REAL=1`` and ``KUBECONFIG`` naming a cluster whose
  nodes have the image (``KELASTIC_E2E_IMAGE``, default ``kelastic:0.1.0``). The
  whole rendered chart is applied and the operator Deployment must roll out.
  Checkpoints go to the hostPath ``/tmp/kelastic-e2e``, read back through a pod
  that mounts it: a single-node cluster (kind, minikube) is assumed.

Every wait has a deadline and names what it waited for; a failed test prints
the jobs, pods, services, events, pod logs, the operator's log and the training
history of its jobs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "kelastic"
EXAMPLE = REPO / "examples" / "elasticjob.yaml"
NAMESPACE = "kelastic-e2e"
RELEASE = "kelastic"
GROUP_LABEL = "kelastic.dev/job-name"
#: Real mode: a pod that mounts the checkpoint hostPath, so histories stay readable after a job's pods are gone.
HISTORY_READER = "e2e-history-reader"
REAL = os.environ.get("KELASTIC_E2E_REAL") == "1" and bool(os.environ.get("KUBECONFIG"))
IMAGE = os.environ.get("KELASTIC_E2E_IMAGE", "kelastic:0.1.0")

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A bounded wait ran out; the message names what was awaited and what was last seen."""


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns a truthy value (returned) or ``timeout`` seconds pass.

    ``probe`` may raise :class:`LastSeen` to record what it saw for the timeout message.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = probe()
        except LastSeen as seen:
            value, last = None, seen.value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


class LastSeen(Exception):
    """Raised by a wait probe to report the state it saw (shown if the wait times out)."""

    def __init__(self, value: object) -> None:
        super().__init__(value)
        self.value = value


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, even without cleanup."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Kubectl:
    """The real kubectl against the cluster under test."""

    kubeconfig: Path | None
    namespace: str

    def base(self) -> list[str]:
        cmd = ["kubectl"]
        if self.kubeconfig is not None:
            cmd += ["--kubeconfig", str(self.kubeconfig)]
        return cmd

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 60,
        namespaced: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [*self.base(), *(["-n", self.namespace] if namespaced else []), *args]
        result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[1:])} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, obj: dict[str, Any] | str) -> str:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        return self.run("apply", "-f", "-", stdin=text).stdout


def render_chart(values: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The chart's CRD text and its rendered objects, from the real Helm library."""
    import helm_python as helm

    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        crd = chart.crds[0]["data"]
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return crd, objects


class OperatorProcess:
    """The operator of the rendered Deployment, run as a local process (local mode)."""

    def __init__(self, container: dict[str, Any], kubeconfig: Path, log_dir: Path) -> None:
        program = shutil.which(container["command"][0])
        command = [program] if program else [sys.executable, "-m", "kelastic.operator"]
        self.health_port = free_port()
        metrics_port = free_port()
        # $(POD_IP) is the kubelet's to expand; the local process listens on loopback,
        # on free ports (the chart's fixed ones may be taken on a shared machine).
        args = [
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz"
            if a.startswith("--liveness=")
            else f"--metrics-port={metrics_port}"
            if a.startswith("--metrics-port=")
            else a.replace("$(POD_IP)", "127.0.0.1")
            for a in container["args"]
        ]
        self.argv = [*command, *args, f"--kubeconfig={kubeconfig}"]
        self.env = {**os.environ, "POD_NAMESPACE": NAMESPACE, "POD_NAME": "kelastic-operator-local"}
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self, timeout: float = 60) -> None:
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        url = f"http://127.0.0.1:{self.health_port}/healthz"

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    return resp.status == 200
            except OSError as exc:
                raise LastSeen(str(exc)) from None

        wait_for(f"the operator's liveness endpoint {url}", healthy, timeout)

    def stop(self, grace: float = 15) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; always reaps the process."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def log_tail(self, lines: int = 60) -> str:
        out: list[str] = []
        for n in range(1, self.starts + 1):
            path = self.log_dir / f"operator-{n}.log"
            if path.exists():
                out += [f"--- {path.name}", *path.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)


@dataclass
class Cluster:
    """The cluster under test with kelastic installed, and what scenarios need of it."""

    kubectl: Kubectl
    local: bool
    checkpoint_root: Path
    operator: OperatorProcess | None = None
    deployment: str = ""
    #: "emulator", "control-plane" (both kelastic local) or "real".
    lane: str = "emulator"
    jobs_seen: set[str] = field(default_factory=set)

    # Scenario modules cannot import this conftest; they reach its helpers here.
    wait_for = staticmethod(wait_for)
    LastSeen = LastSeen

    # -- jobs -------------------------------------------------------------
    def job_manifest(
        self,
        name: str,
        *,
        replicas: int = 3,
        min_replicas: int = 2,
        max_replicas: int = 4,
        steps: int = 60,
        step_delay: float = 0.05,
        checkpoint_every: int = 10,
        command: list[str] | None = None,
        args: list[str] | None = None,
        spec: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The example ElasticJob, renamed and tuned; checkpoints under :attr:`checkpoint_root`."""
        (doc,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d["kind"] == "ElasticJob"]
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": name, "namespace": self.kubectl.namespace}
        job_spec = doc["spec"]
        job_spec.update(minReplicas=min_replicas, maxReplicas=max_replicas)
        job_spec["replicaSpecs"]["Worker"]["replicas"] = replicas
        pod = job_spec["replicaSpecs"]["Worker"]["template"]["spec"]
        root = str(self.checkpoint_root)
        # Scenarios read the training histories from a host directory: a hostPath replaces
        # the example's claim (the scenario namespace does not enforce a Pod Security level).
        pod["volumes"][0] = {"name": "checkpoints", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}
        for container in pod["containers"]:
            container["volumeMounts"][0]["mountPath"] = root
            container["image"] = IMAGE
        if not self.local:
            # A node creates the hostPath owned by root: open it up for the non-root workers.
            pod["initContainers"] = [
                {
                    "name": "checkpoint-dir",
                    "image": IMAGE,
                    "command": ["chmod", "1777", root],
                    "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
                    "volumeMounts": [{"name": "checkpoints", "mountPath": root}],
                }
            ]
        main = pod["containers"][0]
        if command is not None:
            main["command"] = command
        main["args"] = (
            args
            if args is not None
            else [
                f"--steps={steps}",
                f"--step-delay={step_delay}",
                f"--checkpoint-every={checkpoint_every}",
                f"--checkpoint-dir={root}/{{run_id}}",
                "--log-every=10",
            ]
        )
        job_spec.update(spec or {})
        return doc

    def apply_job(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.jobs_seen.add(manifest["metadata"]["name"])
        self.kubectl.apply(manifest)
        return self.job(manifest["metadata"]["name"]) or {}

    def job(self, name: str) -> dict[str, Any] | None:
        result = self.kubectl.run("get", "elasticjob", name, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(f"kubectl get elasticjob {name}: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def pods(self, job: str, role: str | None = None) -> list[dict[str, Any]]:
        selector = f"{GROUP_LABEL}={job}" + (f",kelastic.dev/role={role}" if role else "")
        return self.kubectl.json("get", "pods", "-l", selector)["items"]

    def job_events(self, job: str) -> list[dict[str, Any]]:
        """Events about the ElasticJob named ``job``."""
        return [
            e
            for e in self.kubectl.json("get", "events")["items"]
            if (e.get("involvedObject") or {}).get("name") == job
            and (e.get("involvedObject") or {}).get("kind") == "ElasticJob"
        ]

    def services(self, job: str) -> list[dict[str, Any]]:
        return self.kubectl.json("get", "services", "-l", f"{GROUP_LABEL}={job}")["items"]

    def wait_phase(self, name: str, phases: set[str] | str, timeout: float = 180) -> dict[str, Any]:
        wanted = {phases} if isinstance(phases, str) else phases

        def probe() -> dict[str, Any] | None:
            status = self.status(name)
            if status.get("phase") in wanted:
                return status
            raise LastSeen({k: status.get(k) for k in ("phase", "worldSize", "progress", "conditions")})

        return wait_for(f"elasticjob/{name} to reach phase {sorted(wanted)}", probe, timeout)

    def wait_gone(self, job: str, timeout: float = 90) -> None:
        def probe() -> bool:
            left = [p["metadata"]["name"] for p in self.pods(job)] + [
                s["metadata"]["name"] for s in self.services(job)
            ]
            if left:
                raise LastSeen(left)
            return True

        wait_for(f"every pod and service of elasticjob/{job} to be deleted", probe, timeout)

    def delete_job(self, name: str, timeout: float = 90) -> None:
        self.kubectl.run("delete", "elasticjob", name, "--ignore-not-found", "--wait=false")
        wait_for(f"elasticjob/{name} to be deleted", lambda: self.job(name) is None, timeout)
        self.wait_gone(name, timeout)

    # -- training history (examples/train.py's history.jsonl) -------------
    def history(self, job_uid: str) -> list[dict[str, Any]]:
        """Rank 0's history for the job with this UID (its rendezvous id)."""
        path = self.checkpoint_root / job_uid / "history.jsonl"
        if self.local:
            text = path.read_text() if path.exists() else ""
        else:
            text = self._remote_history(path)
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                break
        return events

    def _remote_history(self, path: Path) -> str:
        """Read a history file through the reader pod that mounts the checkpoint hostPath."""
        result = self.kubectl.run("exec", HISTORY_READER, "--", "cat", str(path), check=False)
        return result.stdout if result.returncode == 0 else ""

    def wait_history(
        self, uid: str, what: str, probe: Callable[[list[dict[str, Any]]], T | None], timeout: float = 180
    ) -> T:
        def check() -> T | None:
            events = self.history(uid)
            value = probe(events)
            if not value:
                raise LastSeen(events[-3:])
            return value

        return wait_for(what, check, timeout)

    # -- the operator -------------------------------------------------------
    def kill_operator(self) -> None:
        """SIGKILL the operator (local) or force-delete its pod (real): no clean shutdown."""
        if self.operator is not None:
            self.operator.kill()
        else:
            self.kubectl.run(
                "delete", "pod", "-l", "app.kubernetes.io/component=operator", "--grace-period=0", "--force"
            )

    def start_operator(self) -> None:
        if self.operator is not None:
            self.operator.start()
        else:
            self.kubectl.run(
                "rollout", "status", f"deployment/{self.deployment}", "--timeout=180s", timeout=200
            )

    # -- diagnostics --------------------------------------------------------
    def dump(self) -> str:
        """Everything that explains a failure: objects, events, logs, histories."""
        out: list[str] = []

        def section(title: str, *args: str) -> None:
            result = self.kubectl.run(*args, check=False, timeout=30)
            out.extend([f"===== {title}", result.stdout.rstrip(), result.stderr.rstrip()])

        section("jobs, pods, services", "get", "elasticjobs,pods,services", "-o", "wide")
        section("events", "get", "events", "--sort-by=.lastTimestamp")
        for name in sorted(self.jobs_seen):
            section(f"elasticjob/{name} status", "get", "elasticjob", name, "-o", "jsonpath={.status}")
        pods = self.kubectl.run("get", "pods", "-o", "name", check=False).stdout.split()
        for pod in pods:
            section(f"logs {pod}", "logs", pod, "--all-containers", "--tail=40")
        if self.operator is not None:
            out += ["===== operator log", self.operator.log_tail()]
        else:
            section("operator log", "logs", f"deployment/{self.deployment}", "--tail=80")
        if self.local and self.checkpoint_root.exists():
            for history in sorted(self.checkpoint_root.glob("*/history.jsonl")):
                out += [f"===== {history}", *history.read_text().splitlines()[-15:]]
        return "\n".join(out)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _install_local(tmp: Path) -> Iterator[Cluster]:
    from kelastic.localcluster.cli.cluster import LocalCluster

    crd, objects = render_chart({})
    with LocalCluster(tmp / "cluster", workdir=REPO) as local:
        kubectl = Kubectl(Path(local.kubeconfig), NAMESPACE)
        kubectl.run("create", "namespace", NAMESPACE, namespaced=False)
        kubectl.apply(crd)
        wait_for(
            "the ElasticJob CRD to be served",
            lambda: kubectl.run("get", "elasticjobs", check=False).returncode == 0,
            30,
        )
        kubectl.apply("\n---\n".join(yaml.safe_dump(o) for o in objects))
        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        operator = OperatorProcess(container, Path(local.kubeconfig), tmp)
        cluster = Cluster(kubectl, local=True, checkpoint_root=tmp / "checkpoints", operator=operator)
        cluster.checkpoint_root.mkdir()
        operator.start()
        try:
            yield cluster
        finally:
            operator.stop()


def _install_control_plane(tmp: Path, bin_dir: Path) -> Iterator[Cluster]:
    from kelastic.localcluster.cli.chart import install_chart
    from kelastic.localcluster.cli.cluster import LocalCluster

    with LocalCluster(tmp / "cluster", workdir=REPO, control_plane=bin_dir, progress=print) as local:
        release = install_chart(local.kubeconfig, CHART, namespace=NAMESPACE, release=RELEASE, wait=180)
        cluster = Cluster(
            Kubectl(Path(local.kubeconfig), NAMESPACE),
            local=True,
            checkpoint_root=tmp / "checkpoints",
            deployment=release.deployment,
            lane="control-plane",
        )
        cluster.checkpoint_root.mkdir()
        yield cluster


def _install_real() -> Iterator[Cluster]:
    repository, _, tag = IMAGE.rpartition(":")
    crd, objects = render_chart({"image": {"repository": repository, "tag": tag}})
    kubectl = Kubectl(None, NAMESPACE)
    kubectl.run("create", "namespace", NAMESPACE, namespaced=False, check=False)
    kubectl.apply(crd)
    kubectl.run(
        "wait",
        "--for=condition=Established",
        "crd/elasticjobs.kelastic.dev",
        "--timeout=60s",
        namespaced=False,
        timeout=90,
    )
    rendered = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    kubectl.apply(rendered)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    cluster = Cluster(
        kubectl,
        local=False,
        checkpoint_root=Path("/tmp/kelastic-e2e"),
        deployment=deployment["metadata"]["name"],
        lane="real",
    )
    root = str(cluster.checkpoint_root)
    reader = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": HISTORY_READER, "namespace": NAMESPACE},
        "spec": {
            "containers": [
                {
                    "name": "reader",
                    "image": IMAGE,
                    "command": ["sleep", "infinity"],
                    "volumeMounts": [{"name": "checkpoints", "mountPath": root}],
                }
            ],
            "volumes": [{"name": "checkpoints", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
        },
    }
    kubectl.apply(reader)
    kubectl.run("wait", "--for=condition=Ready", f"pod/{HISTORY_READER}", "--timeout=120s", timeout=150)
    cluster.start_operator()
    try:
        yield cluster
    finally:
        kubectl.run("delete", "pod", HISTORY_READER, "--ignore-not-found", "--wait=false", check=False)
        kubectl.run("delete", "-f", "-", stdin=rendered, check=False, timeout=120)


#: The lanes of kelastic local; a real cluster (``KELASTIC_E2E_REAL``) is a lane of its own.
LOCAL_LANES = ("emulator", "control-plane")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "lanes(*names): the kelastic local lanes a scenario runs on (emulator, control-plane); "
        "without it, both. A real cluster runs every scenario.",
    )


def _lane_of(item: pytest.Item) -> str | None:
    """The lane a collected scenario runs on (its ``cluster`` or ``lane`` parameter), if any."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    lane = params.get("cluster", params.get("lane"))
    return lane if isinstance(lane, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out a scenario's runs on the lanes its ``lanes`` marker does not name: it runs
    on the others, so nothing goes untested (deselected, not skipped: the run is not owed)."""
    keep: list[pytest.Item] = []
    moved: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("lanes")
        lane = _lane_of(item)
        if marker is not None:
            unknown = set(marker.args) - set(LOCAL_LANES)
            assert marker.args and not unknown, (
                f"{item.nodeid}: lanes({marker.args}) names no lane of {LOCAL_LANES}"
            )
        if marker is None or lane not in LOCAL_LANES or lane in marker.args:
            keep.append(item)
        else:
            moved.append(item)
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = keep


@pytest.fixture(scope="session", params=["real"] if REAL else ["emulator", "control-plane"])
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """kelastic installed through its chart: on ``kelastic local`` with the emulator and with the
    real control plane (both, one cluster each per session), or on a real cluster."""
    if request.param == "real":
        yield from _install_real()
    elif request.param == "control-plane":
        bin_dir = request.getfixturevalue("control_plane_bin")  # skips the lane when there is none
        yield from _install_control_plane(tmp_path_factory.mktemp("e2e-cp"), bin_dir)
    else:
        yield from _install_local(tmp_path_factory.mktemp("e2e"))


@pytest.fixture
def kel(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The cluster for one scenario: dumps diagnostics if it failed, then deletes its jobs."""
    cluster.jobs_seen.clear()
    yield cluster
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.dump())
    if cluster.operator is not None and (
        cluster.operator.proc is None or cluster.operator.proc.poll() is not None
    ):
        cluster.start_operator()  # a scenario that stopped it must not break the next one
    for name in sorted(cluster.jobs_seen):
        cluster.delete_job(name)


@pytest.fixture
def local_run(request: pytest.FixtureRequest) -> Callable[[list[str], str, float], tuple[int, str]]:
    """``kelastic local run ARGS`` on a lane, as a user runs it: (exit code, output).

    The control-plane lane adds ``--control-plane`` (skipping, with how to enable it,
    where there are no binaries). A run that outlives ``timeout`` seconds is stopped as
    Ctrl-C stops it, which stops its cluster and pods, and the test fails with its output.
    """

    def run(args: list[str], lane: str, timeout: float) -> tuple[int, str]:
        kelastic = shutil.which("kelastic")
        command = [kelastic] if kelastic else [sys.executable, "-m", "kelastic.localcluster"]
        if lane == "control-plane":
            args = [*args, "--control-plane", str(request.getfixturevalue("control_plane_bin"))]
        proc = subprocess.Popen(
            [*command, "local", "run", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            output, _ = proc.communicate(timeout=60)
            pytest.fail(f"kelastic local run did not finish within {timeout:g} s:\n{output[-4000:]}")
        return proc.returncode, output

    return run

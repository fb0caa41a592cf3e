"""The operator as a subprocess against a LocalCluster, driven with the real kubectl."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.agent import contract
from kelastic.localcluster.testing import stop_process

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "elasticjob.yaml"

WORKER_SCRIPT = "import time\nprint('worker up', flush=True)\ntime.sleep(120)\n"
# Reports 40 steps of progress, then stays alive until told to finish (a file appears).
TRAIN_SCRIPT = """
import os, sys, time
import torch.distributed as dist
from kelastic.agent.progress import update
dist.init_process_group("gloo")
for step in range(1, 41):
    update(step, 40)
    time.sleep(0.05)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
"""


class Env:
    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.operator: subprocess.Popen[bytes] | None = None
        self.applied: set[str] = set()
        self.log = workdir / "operator.log"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
        self.applied.add(manifest["metadata"]["name"])

    def pods(self, job: str) -> dict[str, dict[str, Any]]:
        items = self.get("pods", "-l", f"{contract.LABEL_JOB_NAME}={job}")["items"]
        return {p["metadata"]["name"]: p for p in items}

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 25.0) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = cond()
            if last:
                return last
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def store_diagnosis(env: Env, job: str) -> str:
    """Why a store pod is still there: its metadata and status, its log, the operator's lines."""
    pod = env.pods(job).get(f"{job}-rendezvous") or {}
    meta = {
        k: pod.get("metadata", {}).get(k) for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "uid")
    }
    logs = sorted(env.workdir.parent.glob(f"data/pods/*_{job}-rendezvous_*/*/*.log"))
    tail = logs[-1].read_text(errors="replace").splitlines()[-10:] if logs else ["(no store log)"]
    ops = [ln for ln in env.log.read_text(errors="replace").splitlines() if f"/{job}" in ln][-15:]
    return "\n".join(
        [
            f"store pod: {json.dumps(meta)} status {json.dumps(pod.get('status', {}))[:1500]}",
            "store log:",
            *tail,
            "operator log:",
            *ops,
        ]
    )


def start_operator(env: Env, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kelastic.operator",
        "--kubeconfig", str(env.kubeconfig),
        "--health-port", "0",
        "--log-format", "json",
        *(extra or ("--standalone",)),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Stop an operator started by ``start_operator`` (its whole process group)."""
    stop_process(proc, 10, group=True, sig=sig)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cluster_mod = pytest.importorskip("kelastic.localcluster.cli.cluster")
    pytest.importorskip("kelastic.localcluster.apiserver.apiserver")
    root = tmp_path_factory.mktemp("opcluster")
    (root / "work").mkdir()
    (root / "work" / "worker.py").write_text(WORKER_SCRIPT)
    (root / "work" / "train.py").write_text(TRAIN_SCRIPT)
    (root / "work" / "crash.py").write_text("import sys\nsys.exit(3)\n")
    cluster = cluster_mod.LocalCluster(root / "data", workdir=root / "work")
    cluster.start()
    try:
        e = Env(Path(cluster.kubeconfig), root / "work")
        e.kubectl("apply", "-f", str(CRD))
        e.wait(
            "the ElasticJob kind in discovery",
            lambda: "elasticjobs" in e.kubectl("api-resources", check=False),
        )
        e.operator = start_operator(e, e.log)
        try:
            yield e
        finally:
            stop(e.operator)
            print(e.log.read_text()[-3000:])
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def delete_jobs_after(env: Env) -> Iterator[None]:
    """Each test's jobs go when it ends, so their pods do not slow the next tests down."""
    yield
    if env.applied:
        env.kubectl("delete", "ej", *sorted(env.applied), "--wait=false", "--ignore-not-found", check=False)
        env.applied.clear()


def job(name: str, *, min_r: int = 1, max_r: int = 4, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "minReplicas": min_r,
            "maxReplicas": max_r,
            # agent failures must not end these jobs: they test what the operator creates
            "backoffLimit": 50,
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "kelastic:dev",
                                    "command": ["python", "worker.py"],
                                }
                            ]
                        }
                    },
                }
            },
            **spec,
        },
    }


def worker_names(env: Env, name: str) -> list[str]:
    return sorted(
        n
        for n, p in env.pods(name).items()
        if p["metadata"]["labels"].get(contract.LABEL_ROLE) == contract.ROLE_WORKER
        and not p["metadata"].get("deletionTimestamp")
    )


def test_job_creates_store_service_and_workers(env: Env) -> None:
    env.apply(job("alpha", replicas=2))
    env.wait("the store Service", lambda: env.kubectl("get", "svc", "alpha-rendezvous", check=False))
    svc = env.get("svc", "alpha-rendezvous")
    ip = svc["spec"]["clusterIP"]
    assert ip.startswith("127.2.")
    env.wait("2 workers and the store pod", lambda: len(env.pods("alpha")) == 3)
    pods = env.pods("alpha")
    uid = env.get("ej", "alpha")["metadata"]["uid"]
    store = pods["alpha-rendezvous"]
    assert store["spec"]["containers"][0]["command"][:2] == ["kelastic-rendezvous", "--host"]
    for i in range(2):
        pod = pods[f"alpha-worker-{i}"]
        labels = pod["metadata"]["labels"]
        assert labels[contract.LABEL_REPLICA_INDEX] == str(i) and labels[contract.LABEL_JOB_NAME] == "alpha"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
        cmd = pod["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == f"{ip}:29400"
        assert cmd[cmd.index("--rdzv-id") + 1] == uid
    ej = env.wait(
        # The pods may be there before the operator's first status write: no status yet is no phase.
        "a Running phase",
        lambda: ((j := env.get("ej", "alpha")).get("status") or {}).get("phase") == "Running" and j,
    )
    assert ej["status"]["selector"] == "kelastic.dev/job-name=alpha,kelastic.dev/role=worker"
    table = env.kubectl("get", "ej", "alpha")
    assert "PHASE" in table and "Running" in table
    # structured logs: one JSON object per line, naming the job it is about
    records = [json.loads(line) for line in env.log.read_text().splitlines() if "alpha" in line]
    assert any(
        r.get("object", {}).get("name") == "alpha" and "creating worker pod" in r["message"] for r in records
    )


def test_kubectl_scale_up_and_down(env: Env) -> None:
    env.apply(job("beta", replicas=2))
    env.wait("2 workers", lambda: worker_names(env, "beta") == ["beta-worker-0", "beta-worker-1"])
    env.kubectl("scale", "ej", "beta", "--replicas", "3")
    env.wait(
        "3 workers", lambda: worker_names(env, "beta") == ["beta-worker-0", "beta-worker-1", "beta-worker-2"]
    )
    env.kubectl("scale", "ej", "beta", "--replicas", "1")
    env.wait("scale down to the lowest index", lambda: worker_names(env, "beta") == ["beta-worker-0"])
    # the Events are posted off the pass, after the pods they tell of: wait for them, not for the pods
    env.wait(
        "a CreateWorker and a ScaleDown Event",
        lambda: {"CreateWorker", "ScaleDown"} <= event_reasons(env, "beta"),
    )


def event_reasons(env: Env, name: str) -> set[str]:
    """The reasons of the Events about the object called `name`."""
    return {e["reason"] for e in env.get("events")["items"] if e["involvedObject"].get("name") == name}


def test_invalid_job_gets_condition_and_event(env: Env) -> None:
    # What the CRD's rules cannot read (the pod template) the operator judges.
    bad = job("gamma", min_r=1, max_r=2, replicas=2)
    bad["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python",
        "-c",
        "1",
    ]
    env.apply(bad)
    ej = env.wait(
        "the Failed phase",
        lambda: (j := env.get("ej", "gamma")).get("status", {}).get("phase") == "Failed" and j,
    )
    field = "spec.replicaSpecs.Worker.template.spec.containers[0].command"
    invalid = next(c for c in ej["status"]["conditions"] if c["type"] == "Invalid")
    assert invalid["status"] == "True" and field in invalid["message"]
    events = env.wait(
        "an InvalidSpec Event",
        lambda: [
            e
            for e in env.get("events")["items"]
            if e["involvedObject"].get("name") == "gamma" and e["reason"] == "InvalidSpec"
        ],
    )
    assert events[0]["type"] == "Warning" and field in events[0]["message"]
    assert not env.pods("gamma")
    # fixing the spec starts the job
    fixed = job("gamma", min_r=1, max_r=2, replicas=1)
    env.apply(fixed)
    env.wait("a worker after the fix", lambda: worker_names(env, "gamma") == ["gamma-worker-0"])


@pytest.mark.slow
def test_operator_restart_adopts_pods_without_duplicates(env: Env, tmp_path: Path) -> None:
    env.apply(job("delta", replicas=2))
    env.wait("2 workers", lambda: worker_names(env, "delta") == ["delta-worker-0", "delta-worker-1"])
    before = {n: p["metadata"]["uid"] for n, p in env.pods("delta").items()}
    # a second standalone operator next to the first one takes the same decisions: no duplicates
    second = start_operator(env, tmp_path / "second.log")
    try:
        time.sleep(3)
        assert {n: p["metadata"]["uid"] for n, p in env.pods("delta").items()} == before
    finally:
        stop(second, signal.SIGKILL)
    # the operator killed outright and started again adopts what exists
    assert env.operator is not None
    stop(env.operator, signal.SIGKILL)
    env.operator = start_operator(env, env.log)
    time.sleep(3)
    assert {n: p["metadata"]["uid"] for n, p in env.pods("delta").items()} == before
    env.kubectl("scale", "ej", "delta", "--replicas", "3")
    env.wait("the restarted operator to act", lambda: "delta-worker-2" in worker_names(env, "delta"))
    assert {n: p["metadata"]["uid"] for n, p in env.pods("delta").items() if n in before} == before


def lease_holder(env: Env) -> str:
    out = env.kubectl(
        "get", "lease", "kelastic-operator", "-o", "jsonpath={.spec.holderIdentity}", check=False
    )
    return out.strip()


@contextlib.contextmanager
def leader_and_standby(env: Env, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Two electing replicas instead of the standalone operator: op-a leads (yielded), op-b waits."""
    assert env.operator is not None
    stop(env.operator)  # the standalone one steps aside meanwhile
    a = start_operator(env, tmp_path / "a.log", "--identity", "op-a")
    b: subprocess.Popen[bytes] | None = None
    try:
        env.wait("op-a to lead", lambda: lease_holder(env) == "op-a")
        b = start_operator(env, tmp_path / "b.log", "--identity", "op-b")
        time.sleep(2)  # op-b is up and a candidate
        yield a
    finally:
        stop(a)
        if b is not None:
            stop(b)
        env.operator = start_operator(env, env.log)


@pytest.mark.slow
def test_leader_election_hands_over_on_shutdown(env: Env, tmp_path: Path) -> None:
    """Two electing replicas: one holds the Lease and acts; SIGTERM releases it to the other."""
    env.apply(job("epsilon", replicas=1))
    env.wait("a worker", lambda: worker_names(env, "epsilon") == ["epsilon-worker-0"])
    with leader_and_standby(env, tmp_path) as a:
        env.kubectl("scale", "ej", "epsilon", "--replicas", "2")
        env.wait("the leader to scale up", lambda: len(worker_names(env, "epsilon")) == 2)
        assert lease_holder(env) == "op-a"
        stop(a)
        env.wait("op-b to take over", lambda: lease_holder(env) == "op-b", timeout=20)
        env.kubectl("scale", "ej", "epsilon", "--replicas", "3")
        env.wait("the new leader to scale up", lambda: len(worker_names(env, "epsilon")) == 3)


@pytest.mark.slow
def test_killed_leader_is_replaced_within_seconds_and_pods_keep_running(env: Env, tmp_path: Path) -> None:
    """SIGKILL (no release): the standby takes over once the Lease expires; meanwhile, and
    after, the job's pods are neither touched nor stopped: nothing in them needs the operator."""
    env.apply(job("eta", replicas=2))

    def running() -> dict[str, str]:
        pods = env.pods("eta").items()
        return {n: p["metadata"]["uid"] for n, p in pods if p["status"].get("phase") == "Running"}

    env.wait("the store and 2 workers running", lambda: len(running()) == 3)
    with leader_and_standby(env, tmp_path) as a:
        before = running()
        stop(a, signal.SIGKILL)
        killed = time.monotonic()
        assert running() == before, "pods changed while no operator ran"
        env.wait("op-b to take over", lambda: lease_holder(env) == "op-b", timeout=20)
        print(f"standby took over {time.monotonic() - killed:.1f}s after the leader was SIGKILLed")
        assert running() == before
        env.kubectl("scale", "ej", "eta", "--replicas", "3")
        env.wait("the new leader to scale up", lambda: len(worker_names(env, "eta")) == 3)
        assert {n: u for n, u in running().items() if n in before} == before


@pytest.mark.slow
def test_world_size_and_progress_reach_status_then_success(env: Env) -> None:
    """Real agents rendezvous through the operator's store; their progress shows in the job."""
    done = env.workdir / "zeta.done"
    manifest = job("zeta", min_r=2, max_r=2, replicas=2)
    container = manifest["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", "train.py", str(done)]
    manifest["spec"]["replicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    env.apply(manifest)

    def status() -> dict[str, Any]:
        return env.get("ej", "zeta").get("status") or {}

    env.wait("Running", lambda: status().get("phase") == "Running", 60)
    env.wait("world", lambda: status().get("worldSize") == 2, 60)
    st = env.wait(
        "world size 2 and full progress", lambda: (s := status()).get("progress") == "40/40 (100%)" and s, 60
    )
    assert st["worldSize"] == 2 and st["phase"] == "Running"
    assert "40/40 (100%)" in env.kubectl("get", "ej", "zeta")
    # The agents' goodput records reach the status too (status.goodput; its figures in test_op_goodput.py).
    assert st["goodput"]["highStep"] == 40 and st["goodput"]["firstStep"] <= 40, st.get("goodput")
    done.write_text("")
    st = env.wait("Succeeded", lambda: (s := status()).get("phase") == "Succeeded" and s, 60)
    assert st["replicaStatuses"]["Worker"]["succeeded"] == 2 and st["completionTime"]
    try:
        # Seconds as a rule; the bound covers a store that only goes at the end of its grace period.
        env.wait("the store pod to go", lambda: "zeta-rendezvous" not in env.pods("zeta"), 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{store_diagnosis(env, 'zeta')}") from None
    env.wait(
        "the store Service to go",
        lambda: not env.get("services", "-l", f"{contract.LABEL_JOB_NAME}=zeta")["items"],
    )


@pytest.mark.slow
def test_crashing_worker_fails_the_job_naming_rank_and_exit_code(env: Env) -> None:
    manifest = job("eta", min_r=1, max_r=1, replicas=1, maxRestarts=0)
    worker = manifest["spec"]["replicaSpecs"]["Worker"]
    worker["restartPolicy"] = "ExitCode"
    worker["template"]["spec"]["containers"][0]["command"] = ["python", "crash.py"]
    env.apply(manifest)
    st = env.wait(
        "Failed", lambda: (s := env.get("ej", "eta").get("status") or {}).get("phase") == "Failed" and s, 60
    )
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "WorkerFailed"
    assert "eta-worker-0 (index 0)" in failed["message"]
    # the agent's termination message: its root cause on one line
    message = failed["message"]
    assert "rank 0 (local rank 0, node eta-worker-0) exited with code 3" in message, message


@pytest.mark.slow
def test_suspend_removes_pods_and_resume_recreates_them(env: Env) -> None:
    env.apply(job("theta", replicas=2))
    env.wait("2 workers", lambda: worker_names(env, "theta") == ["theta-worker-0", "theta-worker-1"])
    env.kubectl("patch", "ej", "theta", "--type", "merge", "-p", '{"spec": {"suspend": true}}')
    env.wait("every pod gone", lambda: not env.pods("theta"))
    env.wait("the Suspended phase", lambda: env.get("ej", "theta")["status"]["phase"] == "Suspended")
    env.kubectl("patch", "ej", "theta", "--type", "merge", "-p", '{"spec": {"suspend": false}}')
    env.wait("the workers back", lambda: worker_names(env, "theta") == ["theta-worker-0", "theta-worker-1"])
    env.wait("the store back", lambda: "theta-rendezvous" in env.pods("theta"))

"""Pod and Service manifests: command wrapping, downward-API env, labels, owner references."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kelastic.agent import cli as agent_cli
from kelastic.agent import contract, warm
from kelastic.agent.cli import LaunchConfig
from kelastic.agent.rendezvous.settings import settings_from_params
from kelastic.operator.builders import (
    IMAGE_AGENT_BOOTSTRAP,
    INJECT_MOUNT_PATH,
    READINESS_DELAY,
    BuildConfig,
    agent_command,
    scrape_annotations,
    store_pod,
    store_service,
    worker_pod,
)
from kelastic.operator.spec import Job, parse_job

CFG = BuildConfig()
LAUNCHER = f"{INJECT_MOUNT_PATH}/{contract.INJECT_LAUNCHER}"


def job_of(kit: SimpleNamespace, **kw: object) -> Job:
    job = parse_job(kit.job_body(**kw))
    assert job.spec is not None, job.error
    return job


def test_python_command_runs_under_its_interpreter(kit: SimpleNamespace) -> None:
    job = job_of(
        kit, command=["python3", "-u", "train.py", "--lr", "0.1"], rdzvConf={"b": 2, "a": "x"}, nprocPerNode=2
    )
    assert job.spec is not None
    cmd = agent_command(job.spec, run_id="uid-demo", endpoint="127.2.0.5:29400", config=CFG)
    assert cmd == [
        "python3", "-u", LAUNCHER,
        "--nnodes", "2:4",
        "--nproc-per-node", "2",
        "--rdzv-backend", "kelastic",
        "--rdzv-endpoint", "127.2.0.5:29400",
        "--rdzv-id", "uid-demo",
        "--max-restarts", "3",
        "--local-addr", "$(POD_IP)",
        "--job-secret-file", "/var/run/secrets/kelastic.dev/job/job-secret",
        "--health-port", "8081",
        "--checkpoint-dir", "/dev/shm/kelastic-checkpoints",
        "--rdzv-conf", "a=x,b=2,controlled=1",
        "--warm-start",
        "train.py", "--lr", "0.1",
    ]  # fmt: skip


def test_the_agent_reads_the_command_the_operator_writes(kit: SimpleNamespace) -> None:
    """Both sides of the contract: kelastic-agent's own parser reads what agent_command builds."""
    from kelastic.agent.cli import build_parser, config_from_args

    job = job_of(
        kit, command=["python3", "-u", "train.py", "--lr", "0.1"], rdzvConf={"a": "x"}, nprocPerNode=2
    )
    assert job.spec is not None
    cmd = agent_command(job.spec, run_id="uid-demo", endpoint="127.2.0.5:29400", config=CFG)
    c = config_from_args(build_parser().parse_args(cmd[cmd.index(LAUNCHER) + 1 :]))
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.max_restarts) == (2, 4, 2, 3)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id, c.health_port) == (
        "kelastic",
        "127.2.0.5:29400",
        "uid-demo",
        8081,
    )
    assert c.local_addr == "$(POD_IP)"  # the kubelet expands it from the downward API
    assert c.job_secret_file == contract.JOB_SECRET_FILE  # where the worker pod mounts the job's secret
    assert c.start_method == "forkserver"  # --warm-start
    assert c.args == ("train.py", "--lr", "0.1")
    # The rendezvous waits for the bounds the operator publishes (replicas), never acting on
    # --nnodes' maxReplicas, whatever the user's own rdzvConf says.
    params = RendezvousParameters(
        c.rdzv_backend, "127.2.0.5:29400", c.run_id, c.min_nodes, c.max_nodes, **c.rdzv_configs
    )
    settings = settings_from_params(params)
    assert settings.controlled and settings.bounds(None) is None
    assert c.rdzv_configs["a"] == "x"


def test_only_a_kelastic_backend_job_waits_for_the_operators_membership(kit: SimpleNamespace) -> None:
    """c10d has no controller (the operator publishes nothing to it): its agents get no ``controlled``."""
    c10d = job_of(kit, command=["python3", "train.py"], rdzvBackend="c10d").spec
    assert c10d is not None
    assert not any("controlled" in arg for arg in agent_command(c10d, run_id="u", endpoint="h:1", config=CFG))


def test_module_and_non_python_commands(kit: SimpleNamespace) -> None:
    mod = job_of(kit, command=["python", "-m", "pkg.train", "--x"]).spec
    assert mod is not None
    cmd = agent_command(mod, run_id="u", endpoint="h:1", config=CFG)
    assert cmd[:2] == ["python", LAUNCHER] and cmd[-3:] == ["-m", "pkg.train", "--x"]
    binary = job_of(kit, command=["bash", "-c", "echo $RANK"]).spec
    assert binary is not None
    cmd = agent_command(binary, run_id="u", endpoint="h:1", config=BuildConfig(agent_python="/opt/py"))
    assert cmd[:2] == ["/opt/py", LAUNCHER] and cmd[-4:] == [
        "--no-python",
        "bash",
        "-c",
        "echo $RANK",
    ]


def agent_config(cmd: list[str]) -> LaunchConfig:
    """What the real ``kelastic-agent`` makes of a built command (the pod IP filled in)."""
    agent = LAUNCHER if LAUNCHER in cmd else IMAGE_AGENT_BOOTSTRAP
    flags = cmd[cmd.index(agent) + 1 :]
    flags = [a.replace("$(POD_IP)", "127.0.0.1") for a in flags]
    return agent_cli.config_from_args(agent_cli.build_parser().parse_args(flags))


@pytest.mark.parametrize(
    ("command", "warm", "entrypoint"),
    [
        (["python", "train.py", "--lr", "0.1"], True, warm.run_script),
        (["python", "train.py", "--lr", "0.1"], False, None),
        (["python3", "-m", "pkg.train", "--x"], True, warm.run_module),
        (["python3", "-m", "pkg.train", "--x"], False, None),
    ],
)
def test_warm_start_follows_the_spec_for_python_commands(
    kit: SimpleNamespace, command: list[str], warm: bool, entrypoint: object
) -> None:
    spec = job_of(kit, command=command, warmStart=warm).spec
    assert spec is not None
    cmd = agent_command(spec, run_id="u", endpoint="127.0.0.1:29400", config=CFG)
    assert ("--warm-start" in cmd) is warm
    config = agent_config(cmd)
    launched = [spec.command.program, *spec.command.args]
    if warm:
        assert config.start_method == "forkserver" and config.entrypoint is entrypoint
        assert list(config.args) == launched
    else:
        assert config.entrypoint == sys.executable and config.start_method == "spawn"
        assert list(config.args)[-len(launched) :] == launched


def test_non_python_commands_never_get_warm_start(kit: SimpleNamespace) -> None:
    spec = job_of(kit, command=["bash", "-c", "echo $RANK"], warmStart=True).spec
    assert spec is not None and spec.warm_start
    cmd = agent_command(spec, run_id="u", endpoint="127.0.0.1:29400", config=CFG)
    assert "--warm-start" not in cmd and "--no-python" in cmd
    config = agent_config(cmd)  # the agent would refuse --warm-start with --no-python
    assert config.entrypoint == "bash" and list(config.args) == ["-c", "echo $RANK"]


def test_worker_pod(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]
    tmpl["metadata"] = {"labels": {"team": "ml"}, "annotations": {"a": "b"}, "name": "ignored"}
    container = tmpl["spec"]["containers"][0]
    container["env"] = [{"name": "LR", "value": "0.1"}, {"name": "POD_IP", "value": "spoofed"}]
    container["args"] = ["--epochs", "3"]
    tmpl["spec"]["containers"].append({"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]})
    job = parse_job(body)
    pod = worker_pod(job, 2, endpoint="127.2.0.5:29400", config=CFG)
    meta = pod["metadata"]
    assert meta["name"] == "demo-worker-2" and meta["namespace"] == "ns"
    assert meta["labels"] == {
        "team": "ml",
        contract.LABEL_JOB_NAME: "demo",
        contract.LABEL_ROLE: contract.ROLE_WORKER,
        contract.LABEL_REPLICA_INDEX: "2",
    }
    # the agent's /metrics on its health port, for annotation-based Prometheus scraping
    assert meta["annotations"] == {"a": "b", **scrape_annotations(contract.DEFAULT_HEALTH_PORT)}
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "name": "demo",
        "uid": "uid-demo",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    main, sidecar = spec["containers"]
    assert sidecar["command"] == ["sleep", "inf"]
    assert "args" not in main
    assert main["command"][-5:] == ["train.py", "--lr", "0.1", "--epochs", "3"]
    env = main["env"]
    assert [e["name"] for e in env] == ["POD_IP", "POD_NAME", contract.ENV_NODE_NAME, "LR"]
    assert env[0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[1]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[2]["value"] == "$(POD_NAME)"
    # Ready while the container runs: no probe, so no Unhealthy event for an agent still starting.
    assert "readinessProbe" not in main
    # the job's template is not modified
    assert "env" in container and container["env"][1]["value"] == "spoofed"
    assert container["command"] == ["python", "train.py", "--lr", "0.1"]


def test_store_pod_and_service(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["nodeSelector"] = {"pool": "cpu"}
    job = parse_job(body)
    pod = store_pod(job, config=CFG)
    assert pod["metadata"]["name"] == "demo-rendezvous"
    assert pod["metadata"]["labels"] == {
        contract.LABEL_JOB_NAME: "demo",
        contract.LABEL_ROLE: contract.ROLE_RENDEZVOUS,
    }
    (c,) = pod["spec"]["containers"]
    assert c["image"] == CFG.agent_image  # the operator's image, never the workers'
    assert (
        store_pod(job, config=BuildConfig(store_image="store:1"))["spec"]["containers"][0]["image"]
        == "store:1"
    )
    assert c["command"] == ["kelastic-rendezvous", "--host", "$(POD_IP)", "--port", "29400"]
    assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    svc = store_service(job, config=CFG)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["port"] == 29400
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


@pytest.mark.parametrize("probe", [True, False])
def test_readiness_probe_is_optional(kit: SimpleNamespace, probe: bool) -> None:
    pod = worker_pod(job_of(kit), 0, endpoint="h:1", config=BuildConfig(readiness_probe=probe))
    assert ("readinessProbe" in pod["spec"]["containers"][0]) is probe
    if probe:
        asked = pod["spec"]["containers"][0]["readinessProbe"]
        assert asked["httpGet"] == {"path": "/readyz", "port": 8081}
        assert asked["initialDelaySeconds"] == READINESS_DELAY == 10


def test_health_port_can_be_disabled(kit: SimpleNamespace) -> None:
    pod = worker_pod(job_of(kit), 0, endpoint="h:1", config=BuildConfig(health_port=None))
    main = pod["spec"]["containers"][0]
    assert "--health-port" not in main["command"]
    assert "readinessProbe" not in main and "ports" not in main


def test_inject_mode_copies_the_agent_through_an_init_container(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["initContainers"] = [{"name": "setup", "image": "busybox", "command": ["true"]}]
    tmpl["volumes"] = [{"name": "data", "emptyDir": {}}]
    pod = worker_pod(parse_job(body), 0, endpoint="h:1", config=BuildConfig(agent_image="op:7"))
    spec = pod["spec"]
    inject, setup = spec["initContainers"]  # first, so the user's init containers could use it too
    assert setup["name"] == "setup"
    assert inject["image"] == "op:7"
    assert inject["command"] == ["python", "-m", "kelastic.agent.inject", INJECT_MOUNT_PATH]
    assert inject["volumeMounts"] == [{"name": "kelastic-agent", "mountPath": INJECT_MOUNT_PATH}]
    assert inject["securityContext"]["runAsNonRoot"] and inject["resources"]["limits"]["memory"]
    assert {"name": "kelastic-agent", "emptyDir": {}} in spec["volumes"] and spec["volumes"][0][
        "name"
    ] == "data"
    main = spec["containers"][0]
    assert main["command"][:2] == ["python", LAUNCHER]
    assert {"name": "kelastic-agent", "mountPath": INJECT_MOUNT_PATH, "readOnly": True} in main[
        "volumeMounts"
    ]
    # Building twice from a template that already had our volume does not duplicate it.
    again = worker_pod(parse_job(body), 0, endpoint="h:1", config=CFG)
    assert [v["name"] for v in again["spec"]["volumes"]].count("kelastic-agent") == 1


def test_image_mode_runs_the_images_agent_and_says_what_to_do_without_it(
    kit: SimpleNamespace, tmp_path: Path
) -> None:
    spec = job_of(kit, agent="image").spec
    assert spec is not None
    pod = worker_pod(job_of(kit, agent="image"), 0, endpoint="h:1", config=CFG)
    assert "initContainers" not in pod["spec"]
    # /dev/shm and the job's secret only: no agent volume
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["kelastic-shm", "kelastic-job-secret"]
    cmd = agent_command(spec, run_id="u", endpoint="127.0.0.1:29400", config=CFG)
    assert cmd[:3] == ["python", "-c", IMAGE_AGENT_BOOTSTRAP]
    assert agent_config(cmd).nproc_per_node == 1  # the real agent reads the flags that follow
    flags = cmd[3:]
    # A Python that has kelastic: the bootstrap is kelastic-agent.
    ok = subprocess.run(
        [sys.executable, "-c", IMAGE_AGENT_BOOTSTRAP, "--help"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and "usage: kelastic-agent" in ok.stdout, ok.stderr
    # A Python without kelastic (-S: no site-packages): one line that says what to do, exit 1.
    bare = subprocess.run(
        [sys.executable, "-S", "-c", IMAGE_AGENT_BOOTSTRAP, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bare.returncode == 1
    assert "this image has no kelastic installed" in bare.stderr and "spec.agent" in bare.stderr, bare.stderr
    assert "Traceback" not in bare.stderr


def test_args_only_launcher_options_reach_the_agent(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    main = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    main.pop("command")
    main["args"] = ["--nproc_per_node=2", "train.py", "--lr=0.1"]
    spec = parse_job(body).spec
    assert spec is not None
    config = agent_config(agent_command(spec, run_id="u", endpoint="127.0.0.1:29400", config=CFG))
    assert config.nproc_per_node == 2
    assert list(config.args)[-2:] == ["train.py", "--lr=0.1"]


def test_store_pod_is_restricted_and_schedules_like_the_workers(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl.update(
        priorityClassName="training",
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        imagePullSecrets=[{"name": "regcred"}],
        nodeSelector={"pool": "gpu"},
    )
    pod = store_pod(parse_job(body), config=CFG)
    spec = pod["spec"]
    assert spec["priorityClassName"] == "training" and spec["nodeSelector"] == {"pool": "gpu"}
    # the template's tolerations, and those of a lost node's taints (kelastic.operator.nodeloss)
    assert spec["tolerations"][:1] == tmpl["tolerations"] and spec["imagePullSecrets"] == [
        {"name": "regcred"}
    ]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (c,) = spec["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    custom = {"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}
    overridden = store_pod(parse_job(body), config=BuildConfig(store_resources=custom))
    assert overridden["spec"]["containers"][0]["resources"] == custom

"""Parsing and validating ElasticJob specs: defaults, bounds, and messages naming the field."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.operator.spec import (
    AgentMode,
    CleanPodPolicy,
    RdzvBackend,
    RestartPolicy,
    SpecError,
    parse_job,
    split_worker_command,
)


def test_defaults_are_applied(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    job = parse_job(body)
    assert job.error is None and job.spec is not None
    spec = job.spec
    assert spec.replicas == 3
    assert spec.agent is AgentMode.INJECT
    assert spec.restart_policy is RestartPolicy.EXIT_CODE
    assert spec.clean_pod_policy is CleanPodPolicy.RUNNING
    assert spec.rdzv_backend is RdzvBackend.KELASTIC
    assert (spec.backoff_limit, spec.max_restarts, spec.nproc_per_node, spec.suspend) == (6, 3, 1, False)
    assert spec.warm_start is True
    assert spec.image == "kelastic:dev"
    assert job.meta.uid == "uid-demo" and job.meta.namespace == "ns"


def test_full_spec(kit: SimpleNamespace) -> None:
    body = kit.job_body(
        nprocPerNode="auto",
        maxRestarts=0,
        rdzvBackend="c10d",
        rdzvConf={"join_timeout": 60, "fast": True},
        rdzvEndpoint="10.1.2.3:29400",
        cleanPodPolicy="All",
        ttlSecondsAfterFinished=0,
        activeDeadlineSeconds=3600,
        backoffLimit=0,
        suspend=True,
        warmStart=False,
        restartPolicy="OnFailure",
    )
    spec = parse_job(body).spec
    assert spec is not None
    assert spec.nproc_per_node == "auto"
    assert spec.rdzv_conf == {"join_timeout": "60", "fast": "true"}
    assert spec.rdzv_endpoint == "10.1.2.3:29400"
    assert spec.ttl_seconds_after_finished == 0 and spec.active_deadline_seconds == 3600
    assert spec.restart_policy is RestartPolicy.ON_FAILURE and spec.suspend
    assert spec.warm_start is False


def _main(b: dict[str, Any]) -> dict[str, Any]:
    return b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


INVALID: list[tuple[str, Any, str, str]] = [
    # replicas is required: the scale subresource and an HPA would read 0 for a missing one.
    (
        "no-replicas",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].pop("replicas"),
        "spec.replicaSpecs.Worker.replicas",
        "is required",
    ),
    ("agent-mode", lambda b: b["spec"].update(agent="sidecar"), "spec.agent", "inject, image"),
    (
        "etcd-without-endpoint",
        lambda b: b["spec"].update(rdzvBackend="etcd-v2"),
        "spec.rdzvEndpoint",
        "your etcd",
    ),
    (
        "v6-unbracketed",
        lambda b: b["spec"].update(rdzvEndpoint="fd00::1:29400"),
        "spec.rdzvEndpoint",
        "[ADDR]",
    ),
    (
        "args-operator-flag",
        lambda b: _main(b).update(command=None, args=["--nnodes=2", "train.py"]),
        "args",
        "set by the operator",
    ),
    (
        "args-no-script",
        lambda b: _main(b).update(command=None, args=["--nproc_per_node=2"]),
        "args",
        "no training",
    ),
    (
        "args-spaced-value",
        lambda b: _main(b).update(command=None, args=["--nproc_per_node", "2", "train.py"]),
        "args",
        "--flag=value",
    ),
    (
        "max<min",
        lambda b: b["spec"].update(minReplicas=3, maxReplicas=2),
        "spec.maxReplicas",
        "at least spec.minReplicas",
    ),
    ("min0", lambda b: b["spec"].update(minReplicas=0), "spec.minReplicas", "at least 1"),
    ("no-min", lambda b: b["spec"].pop("minReplicas"), "spec.minReplicas", "required"),
    (
        "neg-replicas",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].update(replicas=-1),
        "spec.replicaSpecs.Worker.replicas",
        "at least 0",
    ),
    (
        "replicas>max",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].update(replicas=5),
        "spec.replicaSpecs.Worker.replicas",
        "[2, 4]",
    ),
    (
        "replicas<min",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].update(replicas=1),
        "spec.replicaSpecs.Worker.replicas",
        "within",
    ),
    ("no-worker", lambda b: b["spec"].update(replicaSpecs={}), "spec.replicaSpecs.Worker", "required"),
    (
        "no-template",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].pop("template"),
        "spec.replicaSpecs.Worker.template",
        "required",
    ),
    (
        "no-containers",
        lambda b: b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"].update(containers=[]),
        "template.spec.containers",
        "at least one",
    ),
    (
        "no-image",
        lambda b: b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("image"),
        "containers[0].image",
        "required",
    ),
    (
        "no-command",
        lambda b: b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("command"),
        "containers[0].command",
        "required",
    ),
    (
        "bad-policy",
        lambda b: b["spec"]["replicaSpecs"]["Worker"].update(restartPolicy="Always"),
        "spec.replicaSpecs.Worker.restartPolicy",
        "ExitCode, OnFailure, Never",
    ),
    ("bad-nproc", lambda b: b["spec"].update(nprocPerNode="many"), "spec.nprocPerNode", "'auto'"),
    ("zero-nproc", lambda b: b["spec"].update(nprocPerNode=0), "spec.nprocPerNode", "at least 1"),
    ("bad-endpoint", lambda b: b["spec"].update(rdzvEndpoint="nohost"), "spec.rdzvEndpoint", "HOST:PORT"),
    (
        "bad-backend",
        lambda b: b["spec"].update(rdzvBackend="zookeeper"),
        "spec.rdzvBackend",
        "kelastic, c10d, etcd, etcd-v2",
    ),
    (
        "bad-clean",
        lambda b: b["spec"].update(cleanPodPolicy="Some"),
        "spec.cleanPodPolicy",
        "All, Running, None",
    ),
    ("str-min", lambda b: b["spec"].update(minReplicas="2"), "spec.minReplicas", "integer"),
    ("bad-suspend", lambda b: b["spec"].update(suspend="yes"), "spec.suspend", "true or false"),
    ("bad-warm", lambda b: b["spec"].update(warmStart="on"), "spec.warmStart", "true or false"),
    ("bad-conf", lambda b: b["spec"].update(rdzvConf={"a": "x,y"}), "spec.rdzvConf.a", "','"),
    (
        "conf-controlled",
        lambda b: b["spec"].update(rdzvConf={"controlled": "0"}),
        "spec.rdzvConf.controlled",
        "set by the operator",
    ),
    ("long-name", lambda b: b["metadata"].update(name="x" * 60), "metadata.name", "at most 52"),
    (
        "negative-standby",
        lambda b: b["spec"].update(standbyReplicas=-1),
        "spec.standbyReplicas",
        "at least 0",
    ),
    ("many-standby", lambda b: b["spec"].update(standbyReplicas=101), "spec.standbyReplicas", "at most 100"),
    (
        "standby-c10d",
        lambda b: b["spec"].update(standbyReplicas=1, rdzvBackend="c10d"),
        "spec.standbyReplicas",
        "needs spec.rdzvBackend kelastic",
    ),
    (
        "bad-annotation",
        lambda b: b["metadata"].update(annotations={"kelastic.dev/min-replicas-timeout-seconds": "soon"}),
        "min-replicas-timeout",
        ">= 0",
    ),
    (
        "python-c",
        lambda b: b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(
            command=["python", "-c", "1"]
        ),
        "command",
        "script",
    ),
    (
        "python-only",
        lambda b: b["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(
            command=["python3", "-u"]
        ),
        "command",
        "without a script",
    ),
]


@pytest.mark.parametrize(("mutate", "field", "hint"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_specs_name_the_field(kit: SimpleNamespace, mutate: Any, field: str, hint: str) -> None:
    body = kit.job_body()
    mutate(body)
    job = parse_job(body)
    assert job.spec is None and isinstance(job.error, SpecError)
    assert field in job.error.field, job.error
    assert hint in str(job.error), job.error


def test_agent_mode_and_external_etcd_rendezvous(kit: SimpleNamespace) -> None:
    spec = parse_job(kit.job_body(agent="image")).spec
    assert spec is not None and spec.agent is AgentMode.IMAGE
    etcd = parse_job(kit.job_body(rdzvBackend="etcd", rdzvEndpoint="etcd-service:2379")).spec
    assert etcd is not None and etcd.rdzv_backend is RdzvBackend.ETCD and etcd.rdzv_backend.external
    v6 = parse_job(kit.job_body(rdzvEndpoint="[fd00::1]:29400")).spec
    assert v6 is not None and v6.rdzv_endpoint == "[fd00::1]:29400"


def test_args_only_container_takes_the_launchers_place(kit: SimpleNamespace) -> None:
    """pytorch/elastic's examples gave only args: launcher options, then the script."""
    body = kit.job_body()
    _main(body).update(command=None, args=["--nproc_per_node=2", "--module", "pkg.train", "--arch=resnet18"])
    spec = parse_job(body).spec
    assert spec is not None
    cmd = spec.command
    assert (cmd.interpreter, cmd.module, cmd.program, cmd.args) == (
        "python",
        True,
        "pkg.train",
        ("--arch=resnet18",),
    )
    assert cmd.launcher_options == ("--nproc_per_node=2",)
    _main(body).update(args=["--no_python", "/bin/train", "-v"])
    binary = parse_job(body).spec
    assert (
        binary is not None and binary.command.interpreter is None and binary.command.program == "/bin/train"
    )


def test_parse_never_raises_on_garbage() -> None:
    for body in (
        {},
        {"spec": None},
        {"metadata": {"name": "x"}, "spec": []},
        {"metadata": {"name": "x"}, "spec": {"minReplicas": 1}},
    ):
        job = parse_job(body)
        assert job.spec is None and job.error is not None


@pytest.mark.parametrize(
    ("argv", "interpreter", "options", "module", "program", "args"),
    [
        (["python", "train.py", "--lr", "0.1"], "python", (), False, "train.py", ("--lr", "0.1")),
        (["/usr/bin/python3.11", "-u", "train.py"], "/usr/bin/python3.11", ("-u",), False, "train.py", ()),
        (
            ["python3", "-X", "dev", "-m", "pkg.train", "--x"],
            "python3",
            ("-X", "dev"),
            True,
            "pkg.train",
            ("--x",),
        ),
        (["python", "-mpkg.train"], "python", (), True, "pkg.train", ()),
        (["bash", "-c", "echo hi"], None, (), False, "bash", ("-c", "echo hi")),
        (["/opt/bin/train"], None, (), False, "/opt/bin/train", ()),
        (["pythonic-tool", "x"], None, (), False, "pythonic-tool", ("x",)),
    ],
)
def test_split_worker_command(
    argv: list[str],
    interpreter: str | None,
    options: tuple[str, ...],
    module: bool,
    program: str,
    args: tuple[str, ...],
) -> None:
    cmd = split_worker_command(argv)
    assert (cmd.interpreter, cmd.interpreter_options, cmd.module, cmd.program, cmd.args) == (
        interpreter,
        options,
        module,
        program,
        args,
    )


def test_container_args_are_appended_to_command(kit: SimpleNamespace) -> None:
    body = kit.job_body(command=["python"])
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"] = [
        "train.py",
        "--epochs",
        "2",
    ]
    spec = parse_job(body).spec
    assert spec is not None
    assert (spec.command.program, spec.command.args) == ("train.py", ("--epochs", "2"))

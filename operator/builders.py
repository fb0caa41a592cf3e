"""Manifests of what the operator creates for an ElasticJob (pure functions).

Every object carries an ownerReference to the job (so deleting the job deletes it)
and the labels of :mod:`kelastic.agent.contract`. Worker pods run the user's
command wrapped in ``kelastic-agent``; the rendezvous store runs
``kelastic-rendezvous`` on its pod IP behind a ClusterIP Service, and workers get
that Service's cluster IP (never a DNS name) as their rendezvous endpoint.

With ``spec.agent: inject`` (the default) a worker pod gets an init container from
the operator's image (``BuildConfig.agent_image``) that copies the agent into an
``emptyDir`` (:mod:`kelastic.agent.inject`), and the worker runs it with the image's
own Python: the worker image needs Python and torch, nothing of ours. With
``spec.agent: image`` the image must have kelastic installed; when it has not, the
worker exits at once with a line saying so (and what to do), which becomes the
container's termination message and the job's Failed condition.

Every worker pod gets a memory-backed ``emptyDir`` at /dev/shm for the checkpoint the
agent keeps (``spec.checkpoint``, docs/checkpointing.md) unless its template mounts one,
and the job's secret, read-only, at ``contract.JOB_SECRET_MOUNT_DIR``
(:mod:`kelastic.operator.jobsecret`), which its agent reads (``--job-secret-file``). A
worker pod mounts no service-account token unless its template names a service account or
sets ``automountServiceAccountToken`` itself: training needs no access to the API server.

Everything the operator adds itself (the store pod, the injection init container)
passes the ``restricted`` Pod Security Standard, carries small requests and limits,
and mounts no service-account token, so a locked-down namespace accepts it.

Worker and store pods tolerate the taints of a lost node for ``BuildConfig.node_loss_toleration``
seconds (a few), not the API server's 300, unless their template names those taints itself
(:mod:`kelastic.operator.nodeloss`): the control plane then evicts them from a dead node soon,
and the operator replaces them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kelastic.agent import contract
from kelastic.operator import jobsecret, nodeloss, podgroup
from kelastic.operator.spec import (
    API_VERSION,
    CHECKPOINT_DEFAULTS,
    KIND,
    AgentMode,
    CheckpointSpec,
    Job,
    JobSpec,
    RdzvBackend,
    format_quantity,
)

__all__ = [
    "DEFAULT_OPERATOR_IMAGE",
    "READINESS_DELAY",
    "BuildConfig",
    "agent_command",
    "checkpoint_flags",
    "inject_init_container",
    "owner_reference",
    "restricted_security_context",
    "scrape_annotations",
    "shm_volume",
    "store_pod",
    "store_pod_name",
    "store_service",
    "store_service_name",
    "worker_pod",
    "worker_pod_name",
    "worker_selector",
]

ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
STORE_CONTAINER = "rendezvous"
INJECT_CONTAINER = "kelastic-agent"
#: The emptyDir volume holding the injected agent, and where worker containers mount it.
INJECT_VOLUME = "kelastic-agent"
INJECT_MOUNT_PATH = "/kelastic-agent"
_RESERVED_ENV = (ENV_POD_IP, ENV_POD_NAME, contract.ENV_NODE_NAME)
#: The memory-backed emptyDir the operator mounts at /dev/shm of the worker container: the
#: agent's checkpoint memory (``--checkpoint-dir`` defaults to a folder in it) and what NCCL
#: and DataLoader workers put in shared memory (a container runtime's own /dev/shm is 64 MiB).
SHM_VOLUME = "kelastic-shm"
SHM_MOUNT_PATH = "/dev/shm"
#: Room left in /dev/shm beside ``spec.checkpoint.memoryLimit`` for its other users (NCCL,
#: DataLoader workers, torch.multiprocessing): the volume's sizeLimit is the sum.
SHM_HEADROOM = 1024**3

#: The image built from the repository's Dockerfile (the chart's default image).
DEFAULT_OPERATOR_IMAGE = "kelastic:0.1.0"
#: The user the Dockerfile's image runs as; the operator's own containers run as it.
DEFAULT_RUN_AS_USER = 10001

#: What ``spec.agent: image`` runs instead of ``-m kelastic.agent``: the same, after a check
#: that turns "No module named kelastic" into a line that says what to do.
IMAGE_AGENT_BOOTSTRAP = (
    "import sys, importlib.util as u; "
    "u.find_spec('kelastic') or sys.exit("
    "'kelastic-agent: this image has no kelastic installed (' + sys.executable + ' cannot import kelastic) "
    "and the ElasticJob sets spec.agent: image. Remove spec.agent (or set it to inject) to have the operator "
    "inject the agent into any image with Python and torch, or install kelastic in the worker image.'); "
    "import runpy; sys.argv[0] = 'kelastic-agent'; runpy.run_module('kelastic.agent', run_name='__main__')"
)


def _default_store_resources() -> dict[str, dict[str, str]]:
    # kelastic-rendezvous holds no torch: about 25 MiB at rest, at most about 330 MiB with every
    # bound of its defaults filled (docs/security.md, tests/agent/test_store_memory_hostile.py).
    return {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}


def _default_inject_resources() -> dict[str, dict[str, str]]:
    # Copying a few hundred kilobytes of Python files.
    return {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"cpu": "500m", "memory": "128Mi"}}


@dataclass(frozen=True)
class BuildConfig:
    """Operator-wide settings that shape the manifests."""

    #: Interpreter that runs the agent for non-python training commands.
    agent_python: str = "python"
    #: Image of the injection init container (the operator's own image: it has kelastic).
    agent_image: str = DEFAULT_OPERATOR_IMAGE
    #: Image of the rendezvous store pod; None means ``agent_image``.
    store_image: str | None = None
    #: Program serving the rendezvous store in the store pod.
    store_command: tuple[str, ...] = ("kelastic-rendezvous",)
    #: Requests and limits of the store container and of the injection init container.
    store_resources: Mapping[str, Mapping[str, str]] = field(default_factory=_default_store_resources)
    inject_resources: Mapping[str, Mapping[str, str]] = field(default_factory=_default_inject_resources)
    #: The non-root user the operator's own containers (store, injection) run as.
    run_as_user: int = DEFAULT_RUN_AS_USER
    rdzv_port: int = contract.DEFAULT_RDZV_PORT
    #: ``schedulerName`` of the scheduler-plugins coscheduling scheduler (``kelastic.operator.podgroup``).
    coscheduling_scheduler: str = podgroup.DEFAULT_COSCHEDULING_SCHEDULER
    #: Workers of a job that names no other gang scheduler join a ``scheduling.k8s.io`` PodGroup
    #: (kube-scheduler's own gang scheduling): set where the API server serves them.
    kubernetes_gang: bool = False
    #: ``kelastic-agent --health-port``; None runs the agent without health endpoints (and probe).
    health_port: int | None = contract.DEFAULT_HEALTH_PORT
    #: Add a readiness probe on the agent's ``/readyz`` unless the template has one. Off by
    #: default: the agent is ready from its start until it exits (a standby, a finished worker
    #: too), which a running container already says, and every probe that finds the agent
    #: still starting (a busy node) would be an Unhealthy Warning event.
    readiness_probe: bool = False
    #: Seconds a worker or store pod stays bound to a node the control plane gave up
    #: (``kelastic.operator.nodeloss``) unless its template tolerates the node-loss taints
    #: itself; None leaves the API server's default (300 s).
    node_loss_toleration: int | None = nodeloss.DEFAULT_TOLERATION_SECONDS


#: Seconds from a worker container's start to its first readiness probe: what an agent
#: takes to start and import torch on a busy node (about 4 s on an idle one).
READINESS_DELAY = 10


def worker_pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-worker-{index}"


def store_pod_name(job_name: str) -> str:
    return f"{job_name}-rendezvous"


def store_service_name(job_name: str) -> str:
    return f"{job_name}-rendezvous"


def worker_selector(job_name: str) -> str:
    """Label selector of the job's worker pods (``status.selector``, used by the scale subresource)."""
    return f"{contract.LABEL_JOB_NAME}={job_name},{contract.LABEL_ROLE}={contract.ROLE_WORKER}"


def owner_reference(job: Job) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.meta.name,
        "uid": job.meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(job: Job, role: str, index: int | None = None) -> dict[str, str]:
    labels = {contract.LABEL_JOB_NAME: job.meta.name, contract.LABEL_ROLE: role}
    if index is not None:
        labels[contract.LABEL_REPLICA_INDEX] = str(index)
    return labels


def _metadata(
    job: Job, name: str, labels: dict[str, str], extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = dict(copy.deepcopy(extra or {}))
    meta.pop("name", None)
    meta.pop("generateName", None)
    meta["name"] = name
    meta["namespace"] = job.meta.namespace
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["ownerReferences"] = [owner_reference(job)]
    return meta


def _downward_env() -> list[dict[str, Any]]:
    # POD_NAME must precede KELASTIC_NODE_NAME: $(VAR) only expands earlier variables.
    return [
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": contract.ENV_NODE_NAME, "value": f"$({ENV_POD_NAME})"},
    ]


def agent_command(spec: JobSpec, *, run_id: str, endpoint: str, config: BuildConfig) -> list[str]:
    """The worker container's command: ``<python> <agent> <flags> <training command>``.

    ``<agent>`` is the injected launcher (``/kelastic-agent/kelastic-agent``) with
    ``spec.agent: inject``, else ``-c`` :data:`IMAGE_AGENT_BOOTSTRAP` (``-m kelastic.agent``
    with a clear message when the image lacks kelastic). A python training command runs
    under the interpreter it names (its interpreter options go first) and, when
    ``spec.warm_start``, with ``--warm-start``; anything else runs under
    ``config.agent_python`` with ``--no-python`` and never warm.
    """
    cmd = spec.command
    python = cmd.interpreter or config.agent_python
    argv = [python, *cmd.interpreter_options]
    if spec.agent is AgentMode.INJECT:
        argv.append(f"{INJECT_MOUNT_PATH}/{contract.INJECT_LAUNCHER}")
    else:
        argv += ["-c", IMAGE_AGENT_BOOTSTRAP]
    argv += [
        contract.FLAG_NNODES,
        f"{spec.min_replicas}:{spec.max_replicas}",
        contract.FLAG_NPROC_PER_NODE,
        str(spec.nproc_per_node),
        contract.FLAG_RDZV_BACKEND,
        spec.rdzv_backend.value,
        contract.FLAG_RDZV_ENDPOINT,
        endpoint,
        contract.FLAG_RDZV_ID,
        run_id,
        contract.FLAG_MAX_RESTARTS,
        str(spec.max_restarts),
        contract.FLAG_LOCAL_ADDR,
        f"$({ENV_POD_IP})",
        contract.FLAG_JOB_SECRET_FILE,
        contract.JOB_SECRET_FILE,
    ]
    if config.health_port is not None:
        argv += [contract.FLAG_HEALTH_PORT, str(config.health_port)]
    if spec.hang_timeout_seconds is not None:
        argv += [contract.FLAG_HANG_TIMEOUT, str(spec.hang_timeout_seconds)]
    if spec.stragglers is not None:
        argv += [contract.FLAG_STRAGGLERS, spec.stragglers.to_text()]
    argv += checkpoint_flags(spec.checkpoint)
    rdzv_conf = dict(spec.rdzv_conf)
    if uses_control(spec):
        # The membership and the bounds are the ones this operator publishes (max_nodes is
        # replicas, not the maxReplicas of --nnodes): the agent joins no round before they
        # are in the store, a new one or one recreated.
        rdzv_conf[contract.RDZV_CONF_CONTROLLED] = "1"
    if rdzv_conf:
        argv += [contract.FLAG_RDZV_CONF, ",".join(f"{k}={v}" for k, v in sorted(rdzv_conf.items()))]
    argv += cmd.launcher_options
    if cmd.interpreter is None:
        argv.append(contract.FLAG_NO_PYTHON)  # the agent refuses --warm-start with it
    elif spec.warm_start:
        argv.append(contract.FLAG_WARM_START)
    if cmd.module:
        argv.append(contract.FLAG_MODULE)
    argv += [cmd.program, *cmd.args]
    return argv


def checkpoint_flags(checkpoint: CheckpointSpec) -> list[str]:
    """The agent's ``--checkpoint-*`` flags for ``spec.checkpoint``: the folder under the pod's
    ``/dev/shm``, and the others only where their value differs from the agent's own default.
    The memory limit goes as a number of bytes, which every quantity parser reads."""
    # Named although it is the agent's default: a kubelet that runs containers on the host's
    # filesystem (kelastic local) relocates a path under a volume's mountPath into that pod's
    # own volume, so each pod's checkpoint memory is private and dies with the pod, as on a node.
    argv: list[str] = [contract.FLAG_CHECKPOINT_DIR, SHM_MOUNT_PATH + "/kelastic-checkpoints"]
    if checkpoint.replicas != CHECKPOINT_DEFAULTS["replicas"]:
        argv += [contract.FLAG_CHECKPOINT_REPLICAS, str(checkpoint.replicas)]
    if checkpoint.memory_limit is not None:
        argv += [contract.FLAG_CHECKPOINT_MEMORY, str(checkpoint.memory_limit)]
    persist = checkpoint.persist
    if persist is not None:
        argv += [contract.FLAG_CHECKPOINT_PERSIST_DIR, persist.path]
        if persist.every is not None:
            argv += [contract.FLAG_CHECKPOINT_PERSIST_EVERY, str(persist.every)]
        if persist.interval_seconds is not None:
            argv += [contract.FLAG_CHECKPOINT_PERSIST_INTERVAL, str(persist.interval_seconds)]
    return argv


def shm_volume(checkpoint: CheckpointSpec) -> dict[str, Any]:
    """The worker pod's /dev/shm: an emptyDir of medium Memory.

    With ``spec.checkpoint.memoryLimit`` its sizeLimit is that plus :data:`SHM_HEADROOM`;
    without, it has none, and the agent's ``auto`` limit (from its container's memory
    limit) bounds the checkpoint. Either way the pages written count against the worker
    container's memory limit, which is why the spec refuses a memoryLimit not below it.
    """
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if checkpoint.memory_limit is not None:
        empty_dir["sizeLimit"] = format_quantity(checkpoint.memory_limit + SHM_HEADROOM)
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def _mounts_shm(container: Mapping[str, Any]) -> bool:
    return any(
        str(m.get("mountPath") or "").rstrip("/") == SHM_MOUNT_PATH
        for m in container.get("volumeMounts") or []
    )


def worker_pod(job: Job, index: int, *, endpoint: str, config: BuildConfig) -> dict[str, Any]:
    """Worker pod ``<job>-worker-<index>`` from the job's template.

    The pod's own restartPolicy is Never: the operator decides about recreation
    (``spec.replicaSpecs.Worker.restartPolicy``) so every failure is seen and counted.
    The worker container gets :func:`shm_volume` at /dev/shm (the agent's checkpoint
    memory) unless the template mounts a volume there itself, and the job's secret
    (:mod:`kelastic.operator.jobsecret`; it replaces a template volume of its name, and the
    spec refuses another volume mounted at its path). ``automountServiceAccountToken`` is false unless the template sets
    it or names a service account (``serviceAccountName``), whose own setting then holds.
    """
    spec = job.spec
    assert spec is not None, "worker_pod needs a validated job"
    template = copy.deepcopy(dict(spec.template))
    pod_spec: dict[str, Any] = dict(template.get("spec") or {})
    containers = [dict(c) for c in pod_spec.get("containers") or []]
    main = containers[0]
    main["command"] = agent_command(spec, run_id=job.meta.uid, endpoint=endpoint, config=config)
    main.pop("args", None)
    user_env = [e for e in main.get("env") or [] if e.get("name") not in _RESERVED_ENV]
    main["env"] = [*_downward_env(), *user_env]
    if config.health_port is not None:
        ports = [p for p in main.get("ports") or [] if p.get("containerPort") != config.health_port]
        main["ports"] = [
            *ports,
            {"name": "agent-health", "containerPort": config.health_port, "protocol": "TCP"},
        ]
    # On a failure the agent's last lines (naming the failed rank and its exit code) become
    # the container's termination message, which the job's Failed condition quotes.
    main.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    if config.readiness_probe and config.health_port is not None and "readinessProbe" not in main:
        # Asked for (--readiness-probe): ready while the agent is in the job, only a failed
        # agent answers 503. The first probe waits READINESS_DELAY, the agent's start.
        main["readinessProbe"] = {
            "httpGet": {"path": "/readyz", "port": config.health_port},
            "initialDelaySeconds": READINESS_DELAY,
            "periodSeconds": 2,
            "failureThreshold": 1,
        }
    if spec.agent is AgentMode.INJECT:
        mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != INJECT_VOLUME]
        main["volumeMounts"] = [
            *mounts,
            {"name": INJECT_VOLUME, "mountPath": INJECT_MOUNT_PATH, "readOnly": True},
        ]
        init = [c for c in pod_spec.get("initContainers") or [] if c.get("name") != INJECT_CONTAINER]
        pod_spec["initContainers"] = [inject_init_container(config), *init]
        volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != INJECT_VOLUME]
        pod_spec["volumes"] = [*volumes, {"name": INJECT_VOLUME, "emptyDir": {}}]
    mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != SHM_VOLUME]
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != SHM_VOLUME]
    if not _mounts_shm({"volumeMounts": mounts}):
        # The template's own /dev/shm mount wins (the user sized it); else the checkpoint's.
        main["volumeMounts"] = [*mounts, {"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH}]
        pod_spec["volumes"] = [*volumes, shm_volume(spec.checkpoint)]
    # The job's secret replaces a volume of its name (a template copied from a worker pod has it).
    mode = jobsecret.secret_file_mode(pod_spec, main)
    mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != jobsecret.JOB_SECRET_VOLUME]
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != jobsecret.JOB_SECRET_VOLUME]
    main["volumeMounts"] = [*mounts, jobsecret.secret_mount()]
    pod_spec["volumes"] = [*volumes, jobsecret.secret_volume(job, mode)]
    if not {"automountServiceAccountToken", "serviceAccountName", "serviceAccount"} & pod_spec.keys():
        pod_spec["automountServiceAccountToken"] = False
    containers[0] = main
    pod_spec["containers"] = containers
    pod_spec["restartPolicy"] = "Never"
    _tolerate_node_loss(pod_spec, config)
    labels = _labels(job, contract.ROLE_WORKER, index)
    # A gang-scheduled worker names its PodGroup (named after the job) by a label, an
    # annotation or its schedulingGroup.
    gang = podgroup.gang_scheduler(spec, config.coscheduling_scheduler, kubernetes=config.kubernetes_gang)
    marks = podgroup.member_marks(gang, job.meta.name) if gang else podgroup.MemberMarks({}, {})
    if marks.scheduling_group is not None:
        pod_spec["schedulingGroup"] = dict(marks.scheduling_group)
    metadata = _metadata(
        job, worker_pod_name(job.meta.name, index), {**labels, **marks.labels}, template.get("metadata")
    )
    if marks.annotations:
        metadata["annotations"] = {**(metadata.get("annotations") or {}), **marks.annotations}
    if config.health_port is not None:
        # The usual annotations of annotation-based Prometheus scraping: the agent serves
        # /metrics on its health port. The template's own annotations win.
        metadata["annotations"] = {
            **scrape_annotations(config.health_port),
            **(metadata.get("annotations") or {}),
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _tolerate_node_loss(pod_spec: dict[str, Any], config: BuildConfig) -> None:
    """A pod on a lost node is evicted after ``config.node_loss_toleration`` seconds, not the
    API server's 300, so that the operator can replace it (``kelastic.operator.nodeloss``)."""
    if config.node_loss_toleration is not None:
        pod_spec["tolerations"] = nodeloss.with_node_loss_tolerations(
            pod_spec.get("tolerations") or [], config.node_loss_toleration
        )


def scrape_annotations(port: int) -> dict[str, str]:
    """``prometheus.io/scrape``, ``/port`` and ``/path`` for a pod serving ``/metrics`` on ``port``."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def restricted_security_context() -> dict[str, Any]:
    """A container securityContext that the ``restricted`` Pod Security Standard accepts."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _restricted_pod_context(config: BuildConfig) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": config.run_as_user,
        "runAsGroup": config.run_as_user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def inject_init_container(config: BuildConfig) -> dict[str, Any]:
    """The init container that copies the agent from the operator's image into the shared emptyDir."""
    return {
        "name": INJECT_CONTAINER,
        "image": config.agent_image,
        "command": ["python", "-m", "kelastic.agent.inject", INJECT_MOUNT_PATH],
        "securityContext": {**restricted_security_context(), "runAsUser": config.run_as_user},
        "resources": copy.deepcopy(dict(config.inject_resources)),
        "volumeMounts": [{"name": INJECT_VOLUME, "mountPath": INJECT_MOUNT_PATH}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def store_pod(job: Job, *, config: BuildConfig) -> dict[str, Any]:
    """The rendezvous store pod: ``kelastic-rendezvous`` on the pod IP, in the operator's image.

    It runs ``config.store_image`` (default ``config.agent_image``), never the workers'
    image, as a non-root user under the ``restricted`` Pod Security Standard, without a
    service-account token, with small requests and limits (a ResourceQuota needs them).
    It copies the template's scheduling fields (node selector, affinity, tolerations,
    priority class, image pull secrets, service account) so it can run wherever the
    workers can.
    """
    spec = job.spec
    assert spec is not None, "store_pod needs a validated job"
    template_spec = spec.template.get("spec") or {}
    pod_spec: dict[str, Any] = {
        key: copy.deepcopy(template_spec[key])
        for key in (
            "nodeSelector",
            "tolerations",
            "imagePullSecrets",
            "serviceAccountName",
            "affinity",
            "priorityClassName",
        )
        if key in template_spec
    }
    container: dict[str, Any] = {
        "name": STORE_CONTAINER,
        "image": config.store_image or config.agent_image,
        "command": [*config.store_command, "--host", f"$({ENV_POD_IP})", "--port", str(config.rdzv_port)],
        "env": _downward_env()[:1],
        "ports": [{"name": "rendezvous", "containerPort": config.rdzv_port, "protocol": "TCP"}],
        "resources": copy.deepcopy(dict(config.store_resources)),
        "securityContext": restricted_security_context(),
    }
    pod_spec["containers"] = [container]
    pod_spec["restartPolicy"] = "Always"
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["securityContext"] = _restricted_pod_context(config)
    _tolerate_node_loss(pod_spec, config)
    labels = _labels(job, contract.ROLE_RENDEZVOUS)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(job, store_pod_name(job.meta.name), labels),
        "spec": pod_spec,
    }


def store_service(job: Job, *, config: BuildConfig) -> dict[str, Any]:
    """ClusterIP Service in front of the store pod; its cluster IP is the rendezvous endpoint."""
    labels = _labels(job, contract.ROLE_RENDEZVOUS)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, store_service_name(job.meta.name), labels),
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [
                {
                    "name": "rendezvous",
                    "port": config.rdzv_port,
                    "targetPort": config.rdzv_port,
                    "protocol": "TCP",
                }
            ],
        },
    }


def uses_control(spec: JobSpec) -> bool:
    """Whether the operator steers membership and reads progress through the store."""
    return spec.rdzv_backend is RdzvBackend.KELASTIC

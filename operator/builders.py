"""Manifests of what the operator creates for an ElasticJob (pure functions).

Every object carries an ownerReference to the job (so deleting the job deletes it)
and the labels of :mod:`kelastic.agent.contract`. Worker pods run the user's
command wrapped in ``kelastic-agent``; the rendezvous store runs
``kelastic-rendezvous`` on its pod IP behind a ClusterIP Service, and workers get
that Service's cluster IP (never a DNS name) as their rendezvous endpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kelastic.agent import contract
from kelastic.operator.spec import API_VERSION, KIND, Job, JobSpec, RdzvBackend

__all__ = [
    "BuildConfig",
    "agent_command",
    "owner_reference",
    "scrape_annotations",
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
_RESERVED_ENV = (ENV_POD_IP, ENV_POD_NAME, contract.ENV_NODE_NAME)


@dataclass(frozen=True)
class BuildConfig:
    """Operator-wide settings that shape the manifests."""

    #: Interpreter that runs ``-m kelastic.agent`` for non-python training commands.
    agent_python: str = "python"
    #: Program serving the rendezvous store in the store pod.
    store_command: tuple[str, ...] = ("kelastic-rendezvous",)
    rdzv_port: int = contract.DEFAULT_RDZV_PORT
    #: ``kelastic-agent --health-port``; None runs the agent without health endpoints (and probe).
    health_port: int | None = contract.DEFAULT_HEALTH_PORT
    #: Add a readiness probe on the agent's ``/readyz`` unless the template has one.
    readiness_probe: bool = True


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


def _metadata(job: Job, name: str, labels: dict[str, str], extra: Mapping[str, Any] | None = None) -> dict:
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
    """The worker container's command: ``<python> -m kelastic.agent <flags> <training command>``.

    A python training command runs under the interpreter it names (its interpreter
    options go before ``-m kelastic.agent``) and, when ``spec.warm_start``, with
    ``--warm-start``; anything else runs under ``config.agent_python`` with
    ``--no-python`` and never warm.
    """
    cmd = spec.command
    python = cmd.interpreter or config.agent_python
    argv = [python, *cmd.interpreter_options, "-m", "kelastic.agent"]
    argv += [
        "--nnodes",
        f"{spec.min_replicas}:{spec.max_replicas}",
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--rdzv-backend",
        spec.rdzv_backend.value,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        str(spec.max_restarts),
        "--local-addr",
        f"$({ENV_POD_IP})",
    ]
    if config.health_port is not None:
        argv += ["--health-port", str(config.health_port)]
    if spec.rdzv_conf:
        argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in sorted(spec.rdzv_conf.items()))]
    if cmd.interpreter is None:
        argv.append("--no-python")  # the agent refuses --warm-start with it
    elif spec.warm_start:
        argv.append("--warm-start")
    if cmd.module:
        argv.append("-m")
    argv += [cmd.program, *cmd.args]
    return argv


def worker_pod(job: Job, index: int, *, endpoint: str, config: BuildConfig) -> dict[str, Any]:
    """Worker pod ``<job>-worker-<index>`` from the job's template.

    The pod's own restartPolicy is Never: the operator decides about recreation
    (``spec.replicaSpecs.Worker.restartPolicy``) so every failure is seen and counted.
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
        main["readinessProbe"] = {
            "httpGet": {"path": "/readyz", "port": config.health_port},
            "periodSeconds": 2,
            "failureThreshold": 1,
        }
    containers[0] = main
    pod_spec["containers"] = containers
    pod_spec["restartPolicy"] = "Never"
    labels = _labels(job, contract.ROLE_WORKER, index)
    metadata = _metadata(job, worker_pod_name(job.meta.name, index), labels, template.get("metadata"))
    if config.health_port is not None:
        # The usual annotations of annotation-based Prometheus scraping: the agent serves
        # /metrics on its health port. The template's own annotations win.
        metadata["annotations"] = {
            **scrape_annotations(config.health_port),
            **(metadata.get("annotations") or {}),
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def scrape_annotations(port: int) -> dict[str, str]:
    """``prometheus.io/scrape``, ``/port`` and ``/path`` for a pod serving ``/metrics`` on ``port``."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def store_pod(job: Job, *, config: BuildConfig) -> dict[str, Any]:
    """The rendezvous store pod: ``kelastic-rendezvous`` on the pod IP, in the workers' image.

    It inherits the template's scheduling fields (node selector, tolerations, image
    pull secrets, service account) so it can run wherever the workers can.
    """
    spec = job.spec
    assert spec is not None, "store_pod needs a validated job"
    template_spec = spec.template.get("spec") or {}
    pod_spec: dict[str, Any] = {
        key: copy.deepcopy(template_spec[key])
        for key in ("nodeSelector", "tolerations", "imagePullSecrets", "serviceAccountName", "affinity")
        if key in template_spec
    }
    first = (template_spec.get("containers") or [{}])[0]
    container: dict[str, Any] = {
        "name": STORE_CONTAINER,
        "image": spec.image,
        "command": [*config.store_command, "--host", f"$({ENV_POD_IP})", "--port", str(config.rdzv_port)],
        "env": _downward_env()[:1],
        "ports": [{"name": "rendezvous", "containerPort": config.rdzv_port, "protocol": "TCP"}],
    }
    if "imagePullPolicy" in first:
        container["imagePullPolicy"] = first["imagePullPolicy"]
    pod_spec["containers"] = [container]
    pod_spec["restartPolicy"] = "Always"
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

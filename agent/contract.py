"""Names shared by the agent, the operator and users' scripts.

This module is the operator↔agent contract (docs/architecture.md) in code: flag names,
environment variables, label keys and well-known ports. The operator may import
it; it imports nothing else from kelastic, so it is safe to import anywhere.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_HEALTH_PORT",
    "DEFAULT_RDZV_PORT",
    "DEFAULT_TERMINATION_MESSAGE_PATH",
    "ENV_CHECKPOINT_DIR",
    "ENV_CHECKPOINT_ENDPOINT",
    "ENV_INSECURE_NO_SECRET",
    "ENV_JOB_SECRET_FILE",
    "ENV_NODE_NAME",
    "ENV_PROGRESS_FILE",
    "ENV_TERMINATION_MESSAGE_PATH",
    "FLAG_CHECKPOINT_DIR",
    "FLAG_CHECKPOINT_MEMORY",
    "FLAG_CHECKPOINT_PERSIST_DIR",
    "FLAG_CHECKPOINT_PERSIST_EVERY",
    "FLAG_CHECKPOINT_PERSIST_INTERVAL",
    "FLAG_CHECKPOINT_REPLICAS",
    "FLAG_HANG_TIMEOUT",
    "FLAG_HEALTH_PORT",
    "FLAG_INSECURE_NO_SECRET",
    "FLAG_JOB_SECRET_FILE",
    "FLAG_LOCAL_ADDR",
    "FLAG_MAX_RESTARTS",
    "FLAG_MODULE",
    "FLAG_NNODES",
    "FLAG_NO_PYTHON",
    "FLAG_NPROC_PER_NODE",
    "FLAG_RDZV_BACKEND",
    "FLAG_RDZV_CONF",
    "FLAG_RDZV_ENDPOINT",
    "FLAG_RDZV_ID",
    "FLAG_STANDBY",
    "FLAG_STRAGGLERS",
    "FLAG_WARM_START",
    "INJECT_LAUNCHER",
    "INJECT_LIB",
    "JOB_SECRET_FILE",
    "JOB_SECRET_KEY",
    "JOB_SECRET_MIN_BYTES",
    "JOB_SECRET_MOUNT_DIR",
    "LABEL_JOB_NAME",
    "LABEL_REPLICA_INDEX",
    "LABEL_ROLE",
    "PET_PREFIX",
    "RDZV_CONF_CONTROLLED",
    "ROLE_RENDEZVOUS",
    "ROLE_WORKER",
    "WORKER_ENV_VARS",
    "format_endpoint",
]

#: Variables every worker process receives, exactly as torchrun sets them, so a
#: script written for torchrun runs unchanged.
WORKER_ENV_VARS: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)

#: Set by the agent for each worker: the file that ``kelastic.agent.progress.update``
#: writes the worker's latest progress report to.
ENV_PROGRESS_FILE = "KELASTIC_PROGRESS_FILE"

#: Where a failed agent writes its one-line root cause, the container's termination
#: message (default ``/dev/termination-log``, Kubernetes' ``terminationMessagePath``).
ENV_TERMINATION_MESSAGE_PATH = "KELASTIC_TERMINATION_MESSAGE_PATH"
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

#: The agent's identity in a rendezvous. The operator sets it to the pod name
#: (downward API) so the membership it publishes names the same nodes the agents
#: join as. Without it the agent uses ``<hostname>_<pid>``.
ENV_NODE_NAME = "KELASTIC_NODE_NAME"

#: Flags of ``kelastic-agent`` that the operator writes into a worker's command
#: (``kelastic.operator.builders.agent_command``); ``kelastic.agent.cli`` defines them under
#: these names (and accepts each with underscores too, and as ``PET_<NAME>``).
FLAG_NNODES = "--nnodes"
FLAG_NPROC_PER_NODE = "--nproc-per-node"
FLAG_RDZV_BACKEND = "--rdzv-backend"
FLAG_RDZV_ENDPOINT = "--rdzv-endpoint"
FLAG_RDZV_ID = "--rdzv-id"
FLAG_RDZV_CONF = "--rdzv-conf"
FLAG_MAX_RESTARTS = "--max-restarts"
FLAG_LOCAL_ADDR = "--local-addr"
FLAG_HEALTH_PORT = "--health-port"
#: Restart the workers when none of a node's ranks reported progress for this many seconds.
FLAG_HANG_TIMEOUT = "--hang-timeout"
#: The straggler rule (``policy=Report|Replace,ratio=R,window=SECONDS``, :mod:`kelastic.agent.straggler`).
FLAG_STRAGGLERS = "--stragglers"
FLAG_NO_PYTHON = "--no-python"
FLAG_WARM_START = "--warm-start"
#: What the warm start's fork server imports ahead of the workers: ``script`` (the
#: default: torch, then the installed modules the script imports at module level) or
#: ``torch`` (torch only).
FLAG_WARM_IMPORTS = "--warm-imports"
#: Start this node as a standby: it waits in the rendezvous without a rank and only
#: takes the place of a lost member (the rendezvous setting ``standby=1``).
FLAG_STANDBY = "--standby"
#: The ``--rdzv-conf`` key (value ``1``) the operator gives every agent of a kelastic-backend
#: job: the rendezvous' membership and size bounds are the ones it publishes in the store, so
#: an agent joins no round before they are there (``--nnodes`` says ``maxReplicas``; the
#: operator's bound is ``replicas``, the pods past it standbys).
RDZV_CONF_CONTROLLED = "controlled"
#: The training program is a Python module (``python -m``).
FLAG_MODULE = "-m"

#: The memory checkpoint the agent keeps for its workers (``kelastic.checkpoint``):
#: where its bytes live (a tmpfs folder, ``/dev/shm`` in a pod), how many bytes it may
#: hold on this node (a Kubernetes quantity such as ``4Gi``, or ``auto``: derived from the
#: container's memory limit), how many peers hold a copy of this node's part, and the
#: durable copy: a directory (a PersistentVolumeClaim's mount path) written every Nth
#: checkpoint and/or at most every T seconds, in torch.distributed.checkpoint's own layout.
FLAG_CHECKPOINT_DIR = "--checkpoint-dir"
FLAG_CHECKPOINT_MEMORY = "--checkpoint-memory"
FLAG_CHECKPOINT_REPLICAS = "--checkpoint-replicas"
FLAG_CHECKPOINT_PERSIST_DIR = "--checkpoint-persist-dir"
FLAG_CHECKPOINT_PERSIST_EVERY = "--checkpoint-persist-every"
FLAG_CHECKPOINT_PERSIST_INTERVAL = "--checkpoint-persist-interval"

#: Set by the agent for each worker: ``HOST:PORT`` of the agent's checkpoint service and
#: the folder holding the node's checkpoint memory; ``MemoryWriter``/``MemoryReader`` find
#: the agent through them (outside a kelastic worker they are unset).
ENV_CHECKPOINT_ENDPOINT = "KELASTIC_CHECKPOINT_ENDPOINT"
ENV_CHECKPOINT_DIR = "KELASTIC_CHECKPOINT_MEMORY_DIR"

#: The job's secret: what proves to an agent's services (checkpoint service, peer links)
#: that a request comes from the same job (docs/security.md). The operator creates one
#: Secret per ElasticJob holding ``JOB_SECRET_KEY`` (64 hex digits, 256 random bits) and
#: mounts it read-only into every worker pod at ``JOB_SECRET_MOUNT_DIR`` (a projected
#: volume, never an environment variable); the agent reads the file named by
#: ``--job-secret-file`` (or ``$KELASTIC_JOB_SECRET_FILE``): its bytes, with surrounding
#: whitespace stripped, are the key, at least ``JOB_SECRET_MIN_BYTES`` of them. The agent
#: hands its workers the file's path under the same variable, never the key itself.
#: Without one, an agent whose services would listen beyond loopback, or of a job of
#: several nodes, does not start (a single-node run on loopback makes a key of its own);
#: ``--insecure-no-secret`` (``KELASTIC_INSECURE_NO_SECRET=1``) lets it serve anyway, with
#: a public key that authenticates nothing; it says so once in its log.
FLAG_JOB_SECRET_FILE = "--job-secret-file"
ENV_JOB_SECRET_FILE = "KELASTIC_JOB_SECRET_FILE"
FLAG_INSECURE_NO_SECRET = "--insecure-no-secret"
ENV_INSECURE_NO_SECRET = "KELASTIC_INSECURE_NO_SECRET"
JOB_SECRET_KEY = "job-secret"
JOB_SECRET_MOUNT_DIR = "/var/run/secrets/kelastic.dev/job"
JOB_SECRET_FILE = f"{JOB_SECRET_MOUNT_DIR}/{JOB_SECRET_KEY}"
JOB_SECRET_MIN_BYTES = 32

#: torchrun/Kubeflow convention: ``PET_NNODES`` is the fallback for ``--nnodes``.
PET_PREFIX = "PET_"

#: Labels the operator puts on everything it creates.
LABEL_JOB_NAME = "kelastic.dev/job-name"
LABEL_REPLICA_INDEX = "kelastic.dev/replica-index"
LABEL_ROLE = "kelastic.dev/role"
ROLE_WORKER = "worker"
ROLE_RENDEZVOUS = "rendezvous"

#: The rendezvous store's port (torchrun's default rendezvous port).
DEFAULT_RDZV_PORT = 29400
#: ``kelastic-agent --health-port`` as the operator configures it for probes.
DEFAULT_HEALTH_PORT = 8081

#: Layout of an injected agent (``python -m kelastic.agent.inject DEST``): ``DEST/<INJECT_LAUNCHER>``
#: is the script a worker's Python runs; ``DEST/<INJECT_LIB>`` holds the ``kelastic.agent`` package.
INJECT_LAUNCHER = "kelastic-agent"
INJECT_LIB = "lib"


def format_endpoint(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 address in brackets (``[fd00::1]:29400``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

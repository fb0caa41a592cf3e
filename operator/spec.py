"""Parse and validate an ElasticJob object into typed, immutable values.

``parse_job(body)`` never raises: it returns a :class:`Job` whose ``spec`` is a
:class:`JobSpec` when the object is valid, or ``None`` with ``error`` set to a
:class:`SpecError` naming the offending field (``spec.maxReplicas`` …) and saying
what to do. The CRD schema rejects most bad input at ``kubectl apply``; this module
checks what a schema cannot say (``maxReplicas >= minReplicas``, ``replicas`` within
``[minReplicas, maxReplicas]``, a worker container with a command) and re-applies the
schema's defaults, so the operator behaves the same on an API server that does not
default.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime, timezone
from fractions import Fraction
from typing import Any

from kelastic.agent import contract
from kelastic.agent.stragglerrule import Policy as StragglerPolicy
from kelastic.agent.stragglerrule import StragglerRule

__all__ = [
    "API_VERSION",
    "CHECKPOINT_DEFAULTS",
    "DEFAULTS",
    "GROUP",
    "JOB_SECRET_VOLUME",
    "KIND",
    "PLURAL",
    "VERSION",
    "AgentMode",
    "CheckpointPersist",
    "CheckpointSpec",
    "CleanPodPolicy",
    "Job",
    "JobMeta",
    "JobSpec",
    "RdzvBackend",
    "RestartPolicy",
    "SchedulingPolicy",
    "SpecError",
    "WorkerCommand",
    "format_quantity",
    "format_time",
    "parse_job",
    "parse_quantity",
    "parse_time",
    "split_launcher_args",
    "split_worker_command",
]

GROUP = "kelastic.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ElasticJob"
PLURAL = "elasticjobs"

#: Longest job name: the store Service is ``<name>-rendezvous`` and must fit the
#: 63-character DNS label limit; label values have the same limit.
MAX_NAME_LENGTH = 63 - len("-rendezvous")

#: The worker pod's volume holding the job's secret, which the operator mounts read-only at
#: ``contract.JOB_SECRET_MOUNT_DIR`` of the worker container (``kelastic.operator.jobsecret``).
#: A template may mount no other volume at or below that path.
JOB_SECRET_VOLUME = "kelastic-job-secret"

#: Annotation overriding the operator's ``--min-replicas-timeout`` for one job.
ANNOTATION_MIN_REPLICAS_TIMEOUT = "kelastic.dev/min-replicas-timeout-seconds"

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)*)?$")
# HOST:PORT with a host name or IPv4 address, or [IPv6]:PORT (brackets required: the
# port cannot be told apart from the address's last group otherwise).
_ENDPOINT_RE = re.compile(r"^(?:[^:\s\[\]]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")
_NPROC_WORDS = ("auto", "cpu", "gpu")


class RestartPolicy(str, enum.Enum):
    """What a failed worker pod means (``spec.replicaSpecs.Worker.restartPolicy``)."""

    EXIT_CODE = "ExitCode"  # signals and exit codes >= 128 are retried, 1-127 are permanent
    ON_FAILURE = "OnFailure"  # every failure is retried, within backoffLimit
    NEVER = "Never"  # every failure fails the job


class CleanPodPolicy(str, enum.Enum):
    """Which worker pods are deleted when the job finishes."""

    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class RdzvBackend(str, enum.Enum):
    KELASTIC = "kelastic"
    C10D = "c10d"
    #: torch's etcd rendezvous (the pytorch/elastic controller's); needs ``spec.rdzvEndpoint``
    #: naming an etcd and the ``etcd`` client library (python-etcd) in the worker image.
    ETCD = "etcd"
    ETCD_V2 = "etcd-v2"

    @property
    def external(self) -> bool:
        """The backend talks to a store the user runs (the operator runs none)."""
        return self in (RdzvBackend.ETCD, RdzvBackend.ETCD_V2)


class AgentMode(str, enum.Enum):
    """Where the worker container finds kelastic-agent (``spec.agent``)."""

    #: An init container copies the agent from the operator's image into an emptyDir;
    #: the worker image needs only Python and torch.
    INJECT = "inject"
    #: The worker image has kelastic installed (``python -m kelastic.agent``).
    IMAGE = "image"


class SpecError(ValueError):
    """An invalid ElasticJob: ``field`` is the JSON path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class WorkerCommand:
    """The user's training command split for ``kelastic-agent``.

    ``interpreter`` is the python the user named (``python``, ``python3.11`` …) or
    ``None`` for a non-python command, which the agent runs with ``--no-python``.
    ``interpreter_options`` are options for that interpreter placed before
    ``-m kelastic.agent`` (``-u``, ``-X dev`` …). ``module`` is True for
    ``python -m pkg.mod``. ``program`` and ``args`` are what the agent launches.
    ``launcher_options`` are torchrun-style agent flags (``--nproc_per_node=2``) that
    came first in an ``args``-only container (see :func:`split_launcher_args`).
    """

    interpreter: str | None
    interpreter_options: tuple[str, ...]
    module: bool
    program: str
    args: tuple[str, ...]
    launcher_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobMeta:
    name: str
    namespace: str
    uid: str
    generation: int
    creation_timestamp: datetime | None
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointPersist:
    """``spec.checkpoint.persist``: the durable copy of the memory checkpoint.

    ``path`` is a directory inside the worker container, under one of its volumeMounts
    (checked): the agent writes every ``every``-th checkpoint (and/or at most every
    ``interval_seconds``) there in torch.distributed.checkpoint's own layout. With neither
    set, ``every`` is 1: each checkpoint is persisted, in the background.
    """

    path: str
    every: int | None = 1
    interval_seconds: int | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    """``spec.checkpoint``: the memory checkpoint kelastic-agent keeps for the workers.

    Every job has one (the defaults below when the spec says nothing); the operator
    passes the agent only the flags whose value differs from the agent's own default.
    """

    #: Peers holding a copy of each node's part (``kelastic-agent --checkpoint-replicas``).
    replicas: int = 1
    #: Bytes of checkpoint memory per worker pod; None: the agent's ``auto`` (from its
    #: container's memory limit).
    memory_limit: int | None = None
    persist: CheckpointPersist | None = None


#: CheckpointSpec's defaults; the CRD declares the same ones under ``spec.checkpoint``.
CHECKPOINT_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(CheckpointSpec) if f.default is not MISSING
}


@dataclass(frozen=True)
class JobSpec:
    """A validated ElasticJob spec with every default applied."""

    min_replicas: int
    max_replicas: int
    replicas: int
    template: Mapping[str, Any]
    command: WorkerCommand
    image: str
    restart_policy: RestartPolicy = RestartPolicy.EXIT_CODE
    clean_pod_policy: CleanPodPolicy = CleanPodPolicy.RUNNING
    ttl_seconds_after_finished: int | None = None
    active_deadline_seconds: int | None = None
    #: Restart the group when no rank reported progress this long (``kelastic-agent --hang-timeout``).
    hang_timeout_seconds: int | None = None
    #: Gang scheduling (``spec.schedulingPolicy``); None when the job has none.
    scheduling_policy: SchedulingPolicy | None = None
    backoff_limit: int = 6
    nproc_per_node: int | str = 1
    max_restarts: int = 3
    rdzv_backend: RdzvBackend = RdzvBackend.KELASTIC
    rdzv_endpoint: str | None = None
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    suspend: bool = False
    #: Fork python workers from a process that already imported torch (``kelastic-agent --warm-start``).
    warm_start: bool = True
    min_replicas_timeout: float | None = None
    #: The out-of-range ``replicas`` a started job was scaled to; ``replicas`` holds the clamped value.
    replicas_requested: int | None = None
    #: How the worker container gets kelastic-agent (``spec.agent``).
    agent: AgentMode = AgentMode.INJECT
    #: The agent's memory checkpoint (``spec.checkpoint``); every job has one.
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    #: Hot standby pods beside the ``replicas`` workers (``spec.standbyReplicas``).
    standby_replicas: int = 0
    #: The straggler rule the agents apply (``spec.stragglers``); None: the agent's default (Report).
    stragglers: StragglerRule | None = None

    @property
    def pods(self) -> int:
        """The worker pods the job runs: ``replicas`` plus its standbys.

        Every one runs the same agent; which of them are members and which wait as
        standbys is the rendezvous' choice (the group takes ``replicas`` of them).
        """
        return self.replicas + self.standby_replicas


#: JobSpec's field defaults: the one place the operator's defaults are written. The CRD
#: declares the same ones for the API server to fill in; a test holds the two equal.
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(JobSpec) if f.default is not MISSING}


@dataclass(frozen=True)
class Job:
    """An ElasticJob as the reconciler sees it: identity, validated spec, last status."""

    meta: JobMeta
    spec: JobSpec | None
    error: SpecError | None
    status: Mapping[str, Any]
    deleting: bool = False


def parse_time(value: Any) -> datetime | None:
    """RFC 3339 timestamp (as the API server writes it) → aware datetime, else None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def format_time(value: datetime) -> str:
    """Aware datetime → the API's ``2024-01-02T03:04:05Z`` form."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_job(body: Mapping[str, Any]) -> Job:
    """Turn an ElasticJob object into a :class:`Job`; never raises on bad input."""
    metadata = body.get("metadata") or {}
    meta = JobMeta(
        name=str(metadata.get("name", "")),
        namespace=str(metadata.get("namespace", "default")),
        uid=str(metadata.get("uid", "")),
        generation=int(metadata.get("generation") or 0),
        creation_timestamp=parse_time(metadata.get("creationTimestamp")),
        annotations=dict(metadata.get("annotations") or {}),
        labels=dict(metadata.get("labels") or {}),
    )
    status = body.get("status") or {}
    deleting = bool(metadata.get("deletionTimestamp"))
    try:
        spec = _parse_spec(meta, body.get("spec"), started=bool(status.get("scaledTo")))
    except SpecError as err:
        return Job(meta=meta, spec=None, error=err, status=status, deleting=deleting)
    return Job(meta=meta, spec=spec, error=None, status=status, deleting=deleting)


def _int(spec: Mapping[str, Any], key: str, path: str, *, default: int | None, minimum: int) -> int | None:
    value = spec.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(path, f"must be at least {minimum}, got {value}")
    return value


def _bool(spec: Mapping[str, Any], key: str, path: str, *, default: bool) -> bool:
    value = spec.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, got {value!r}")
    return value


def _enum(spec: Mapping[str, Any], key: str, path: str, kind: type[enum.Enum], default: enum.Enum) -> Any:
    value = spec.get(key, default.value)
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise SpecError(path, f"must be one of {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class SchedulingPolicy:
    """``spec.schedulingPolicy`` (Kubeflow's run-policy names), for gang schedulers' PodGroups."""

    #: Workers the gang scheduler must place together before any starts; None: ``minReplicas``.
    min_available: int | None = None
    queue: str | None = None
    priority_class: str | None = None
    schedule_timeout_seconds: int | None = None


def _str(spec: Mapping[str, Any], key: str, path: str) -> str | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"must be a non-empty string, got {value!r}")
    return value


def _parse_scheduling_policy(spec: Mapping[str, Any], max_replicas: int) -> SchedulingPolicy | None:
    policy = spec.get("schedulingPolicy")
    if policy is None:
        return None
    if not isinstance(policy, Mapping):
        raise SpecError("spec.schedulingPolicy", f"must be an object, got {policy!r}")
    path = "spec.schedulingPolicy"
    min_available = _int(policy, "minAvailable", f"{path}.minAvailable", default=None, minimum=1)
    if min_available is not None and min_available > max_replicas:
        raise SpecError(
            f"{path}.minAvailable", f"must be at most spec.maxReplicas={max_replicas}, got {min_available}"
        )
    return SchedulingPolicy(
        min_available=min_available,
        queue=_str(policy, "queue", f"{path}.queue"),
        priority_class=_str(policy, "priorityClass", f"{path}.priorityClass"),
        schedule_timeout_seconds=_int(
            policy, "scheduleTimeoutSeconds", f"{path}.scheduleTimeoutSeconds", default=None, minimum=1
        ),
    )


@dataclass(frozen=True)
class _Replicas:
    """``spec.minReplicas``, ``spec.maxReplicas`` and the Worker replica spec, validated."""

    min: int
    max: int
    replicas: int
    #: The out-of-range value a started job was scaled to (``replicas`` is then clamped).
    requested: int | None
    restart_policy: RestartPolicy
    worker: Mapping[str, Any]


@dataclass(frozen=True)
class _Container:
    """The worker pod template and what its first container runs."""

    template: Mapping[str, Any]
    image: str
    command: WorkerCommand


@dataclass(frozen=True)
class _Rendezvous:
    backend: RdzvBackend
    endpoint: str | None
    conf: dict[str, str]


def _parse_spec(meta: JobMeta, spec: Any, *, started: bool = False) -> JobSpec:
    """Validate ``spec``. A ``started`` job (one that has run at full size) scaled out of
    ``[minReplicas, maxReplicas]`` keeps running at the nearest bound instead of failing:
    a mistyped ``kubectl scale`` must not end a training run. (The CRD's rules refuse such a
    scale, and the other cross-field errors here, at the API server, in these words; these
    checks stay for jobs written before the rules, and for clusters that lack them.)

    The parts are checked in a fixed order (name, replicas, container, processes,
    rendezvous, the rest), so a spec with several errors always reports the same one."""
    _check_name(meta)
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "is required and must be an object")
    replicas = _parse_replicas(spec, started=started)
    container = _parse_container(replicas.worker)
    _check_job_secret_room(container.template)
    nproc = _parse_nproc(spec)
    rdzv = _parse_rendezvous(spec)
    suspend = _bool(spec, "suspend", "spec.suspend", default=DEFAULTS["suspend"])
    warm_start = _bool(spec, "warmStart", "spec.warmStart", default=DEFAULTS["warm_start"])
    timeout = _parse_min_replicas_timeout(meta)
    backoff = _int(spec, "backoffLimit", "spec.backoffLimit", default=DEFAULTS["backoff_limit"], minimum=0)
    max_restarts = _int(spec, "maxRestarts", "spec.maxRestarts", default=DEFAULTS["max_restarts"], minimum=0)
    assert backoff is not None and max_restarts is not None
    return JobSpec(
        min_replicas=replicas.min,
        max_replicas=replicas.max,
        replicas=replicas.replicas,
        template=container.template,
        command=container.command,
        image=container.image,
        restart_policy=replicas.restart_policy,
        clean_pod_policy=_enum(
            spec, "cleanPodPolicy", "spec.cleanPodPolicy", CleanPodPolicy, DEFAULTS["clean_pod_policy"]
        ),
        ttl_seconds_after_finished=_int(
            spec, "ttlSecondsAfterFinished", "spec.ttlSecondsAfterFinished", default=None, minimum=0
        ),
        active_deadline_seconds=_int(
            spec, "activeDeadlineSeconds", "spec.activeDeadlineSeconds", default=None, minimum=1
        ),
        hang_timeout_seconds=_int(
            spec, "hangTimeoutSeconds", "spec.hangTimeoutSeconds", default=None, minimum=1
        ),
        scheduling_policy=_parse_scheduling_policy(spec, replicas.max),
        backoff_limit=backoff,
        nproc_per_node=nproc,
        max_restarts=max_restarts,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_conf=rdzv.conf,
        suspend=suspend,
        warm_start=warm_start,
        min_replicas_timeout=timeout,
        replicas_requested=replicas.requested,
        agent=_enum(spec, "agent", "spec.agent", AgentMode, DEFAULTS["agent"]),
        checkpoint=_parse_checkpoint(spec, container.template),
        standby_replicas=_parse_standby(spec, rdzv.backend),
        stragglers=_parse_stragglers(spec, rdzv.backend),
    )


#: The most peers that may hold a copy of a node's checkpoint part (the CRD's maximum too).
MAX_CHECKPOINT_REPLICAS = 3

#: A Kubernetes quantity of bytes as the CRD admits it: a number (``1.5``, ``.5``) with an optional
#: binary (``Ki`` … ``Ei``) or decimal (``k`` … ``E``) suffix or exponent (``4e9``). No sign, no milli.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][0-9]+)?$"
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_QUANTITY_SUFFIXES = {
    "": 1,
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def parse_quantity(value: Any) -> int | None:
    """Bytes of a Kubernetes quantity (``4Gi``, ``1.5G``, ``4e9``, ``1048576``), rounded up as
    Kubernetes does; None when ``value`` is not one (negative, milli, other units, not a number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    match = _QUANTITY_RE.match(value.strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(3) or ""
    # Fractions, not floats: 1.1Gi must come out exact, not a byte short.
    scaled: Fraction
    if suffix[:1] in ("e", "E") and suffix not in _QUANTITY_SUFFIXES:
        scaled = Fraction(number) * Fraction(10) ** int(suffix[1:])
    else:
        scaled = Fraction(number) * _QUANTITY_SUFFIXES[suffix]
    return math.ceil(scaled)


def format_quantity(size: int) -> str:
    """``size`` bytes as a quantity: ``5Gi`` or ``1536Mi`` when whole, else the plain number."""
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        unit = _QUANTITY_SUFFIXES[suffix]
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def _parse_checkpoint(spec: Mapping[str, Any], template: Mapping[str, Any]) -> CheckpointSpec:
    """``spec.checkpoint``: replicas, memoryLimit (below the worker container's memory limit) and
    persist (a path under a volumeMount of the worker container that outlives the pod)."""
    raw = spec.get("checkpoint")
    if raw is None:
        return CheckpointSpec()
    path = "spec.checkpoint"
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be an object, got {raw!r}")
    replicas = _int(raw, "replicas", f"{path}.replicas", default=CHECKPOINT_DEFAULTS["replicas"], minimum=0)
    assert replicas is not None
    if replicas > MAX_CHECKPOINT_REPLICAS:
        raise SpecError(f"{path}.replicas", f"must be at most {MAX_CHECKPOINT_REPLICAS}, got {replicas}")
    container: Mapping[str, Any] = template["spec"]["containers"][0]  # checked by _parse_container
    memory_limit: int | None = None
    if raw.get("memoryLimit") is not None:
        memory_limit = parse_quantity(raw["memoryLimit"])
        if not memory_limit:
            raise SpecError(
                f"{path}.memoryLimit",
                f"must be a positive quantity of bytes such as 4Gi or 512Mi, got {raw['memoryLimit']!r}",
            )
        limits = (container.get("resources") or {}).get("limits") or {}
        container_limit = parse_quantity(limits.get("memory"))
        if container_limit and memory_limit >= container_limit:
            raise SpecError(
                f"{path}.memoryLimit",
                f"({raw['memoryLimit']}) must be less than the worker container's memory limit "
                f"({limits['memory']}): checkpoint memory (tmpfs) counts against that limit, beside the "
                "training processes; lower memoryLimit or raise the container's limit",
            )
    persist = _parse_persist(raw.get("persist"), f"{path}.persist", template, container)
    return CheckpointSpec(replicas=replicas, memory_limit=memory_limit, persist=persist)


def _parse_persist(
    raw: Any, path: str, template: Mapping[str, Any], container: Mapping[str, Any]
) -> CheckpointPersist | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be an object, got {raw!r}")
    target = _str(raw, "path", f"{path}.path")
    if target is None:
        raise SpecError(f"{path}.path", "is required: a directory inside the worker container")
    if not target.startswith("/") or any(part in (".", "..") for part in target.split("/")):
        raise SpecError(f"{path}.path", f"must be an absolute path without . or .., got {target!r}")
    _check_durable_mount(target, f"{path}.path", template, container)
    every = _int(raw, "every", f"{path}.every", default=None, minimum=1)
    interval = _int(raw, "intervalSeconds", f"{path}.intervalSeconds", default=None, minimum=1)
    if every is None and interval is None:
        every = 1
    return CheckpointPersist(path=target.rstrip("/") or "/", every=every, interval_seconds=interval)


def _check_durable_mount(
    target: str, path: str, template: Mapping[str, Any], container: Mapping[str, Any]
) -> None:
    """``target`` lies under a writable volumeMount of the worker container whose volume outlives
    the pod (not an emptyDir): the durable copy is what survives every pod being gone."""
    mounts = [m for m in container.get("volumeMounts") or [] if isinstance(m, Mapping)]

    def under(mount: Mapping[str, Any]) -> bool:
        root = str(mount.get("mountPath") or "").rstrip("/")
        return bool(root) and (target == root or target.startswith(root + "/"))

    inside = [m for m in mounts if under(m)]
    if not inside:
        listed = ", ".join(str(m.get("mountPath")) for m in mounts) or "none"
        raise SpecError(
            path,
            f"{target} is not under a volumeMount of the worker container (its mounts: {listed}); mount a "
            "PersistentVolumeClaim (or another volume that outlives the pod) in the template and point "
            "path inside it",
        )
    mount = max(inside, key=lambda m: len(str(m.get("mountPath"))))
    name = mount.get("name")
    if mount.get("readOnly"):
        raise SpecError(path, f"{target} is on volumeMount {name!r}, which is readOnly")
    volumes = (template.get("spec") or {}).get("volumes") or []
    volume = next((v for v in volumes if isinstance(v, Mapping) and v.get("name") == name), None)
    if volume is not None and "emptyDir" in volume:
        raise SpecError(
            path,
            f"{target} is on volume {name!r}, an emptyDir, which is deleted with its pod; persist to a "
            "PersistentVolumeClaim (or another volume that outlives the pod)",
        )


def _check_name(meta: JobMeta) -> None:
    if not meta.name:
        raise SpecError("metadata.name", "is required")
    if len(meta.name) > MAX_NAME_LENGTH:
        raise SpecError(
            "metadata.name",
            f"is {len(meta.name)} characters; at most {MAX_NAME_LENGTH} fit the names of the "
            "job's pods and Service",
        )


#: The most standby pods a job may have (the CRD's maximum).
MAX_STANDBY_REPLICAS = 100


def _parse_standby(spec: Mapping[str, Any], backend: RdzvBackend) -> int:
    """``spec.standbyReplicas``: hot standby pods, kept in kelastic's rendezvous only."""
    path = "spec.standbyReplicas"
    standbys = _int(spec, "standbyReplicas", path, default=DEFAULTS["standby_replicas"], minimum=0)
    assert standbys is not None
    if standbys > MAX_STANDBY_REPLICAS:
        raise SpecError(path, f"must be at most {MAX_STANDBY_REPLICAS}, got {standbys}")
    if standbys and backend is not RdzvBackend.KELASTIC:
        raise SpecError(
            path,
            f"needs spec.rdzvBackend kelastic (got {backend.value}): standbys wait in kelastic's rendezvous "
            "without a rank; set standbyReplicas to 0 or use the kelastic backend",
        )
    return standbys


def _number(spec: Mapping[str, Any], key: str, path: str, default: float) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(path, f"must be a number, got {value!r}")
    return float(value)


def _parse_stragglers(spec: Mapping[str, Any], backend: RdzvBackend) -> StragglerRule | None:
    """``spec.stragglers``: the straggler rule, applied by the agents of kelastic's rendezvous."""
    rule = spec.get("stragglers")
    if rule is None:
        return None
    path = "spec.stragglers"
    if not isinstance(rule, Mapping):
        raise SpecError(path, f"must be an object with policy, ratio and windowSeconds, got {rule!r}")
    base = StragglerRule()
    policy = _enum(rule, "policy", f"{path}.policy", StragglerPolicy, base.policy)
    ratio = _number(rule, "ratio", f"{path}.ratio", base.ratio)
    window = _number(rule, "windowSeconds", f"{path}.windowSeconds", base.window)
    if not ratio > 1.0:
        raise SpecError(f"{path}.ratio", f"must be above 1 (a member this many times slower), got {ratio:g}")
    if window < 0:
        raise SpecError(f"{path}.windowSeconds", f"must be at least 0, got {window:g}")
    if backend is not RdzvBackend.KELASTIC:
        raise SpecError(
            path,
            f"needs spec.rdzvBackend kelastic (got {backend.value}): the agents judge stragglers through "
            "kelastic's rendezvous store; remove spec.stragglers or use the kelastic backend",
        )
    return StragglerRule(policy=policy, ratio=ratio, window=window)


def _parse_replicas(spec: Mapping[str, Any], *, started: bool) -> _Replicas:
    """The replica bounds, the Worker replica spec, its replicas and restart policy."""
    min_r = _int(spec, "minReplicas", "spec.minReplicas", default=None, minimum=1)
    if min_r is None:
        raise SpecError("spec.minReplicas", "is required (the fewest worker pods the job trains with)")
    max_r = _int(spec, "maxReplicas", "spec.maxReplicas", default=None, minimum=1)
    if max_r is None:
        raise SpecError("spec.maxReplicas", "is required (the most worker pods the job trains with)")
    if max_r < min_r:
        raise SpecError(
            "spec.maxReplicas",
            f"({max_r}) must be at least spec.minReplicas ({min_r}); raise maxReplicas or lower minReplicas",
        )

    replica_specs = spec.get("replicaSpecs")
    if not isinstance(replica_specs, Mapping) or not isinstance(replica_specs.get("Worker"), Mapping):
        raise SpecError(
            "spec.replicaSpecs.Worker", "is required: the worker replica spec with a pod template"
        )
    worker = replica_specs["Worker"]
    wpath = "spec.replicaSpecs.Worker"
    # Required, not defaulted: the scale subresource and an HPA read this field, and a
    # schema default cannot say "minReplicas".
    replicas = _int(worker, "replicas", f"{wpath}.replicas", default=None, minimum=0)
    if replicas is None:
        raise SpecError(
            f"{wpath}.replicas",
            f"is required: the worker pods to start, within [minReplicas, maxReplicas] = [{min_r}, {max_r}] "
            "(kubectl scale and autoscalers change it)",
        )
    requested: int | None = None
    if not min_r <= replicas <= max_r and started:
        requested, replicas = replicas, min(max(replicas, min_r), max_r)
    if not min_r <= replicas <= max_r:
        raise SpecError(
            f"{wpath}.replicas",
            f"({replicas}) must be within [spec.minReplicas, spec.maxReplicas] = [{min_r}, {max_r}]",
        )
    restart_policy = _enum(
        worker, "restartPolicy", f"{wpath}.restartPolicy", RestartPolicy, DEFAULTS["restart_policy"]
    )
    return _Replicas(min_r, max_r, replicas, requested, restart_policy, worker)


def _parse_container(worker: Mapping[str, Any]) -> _Container:
    """The Worker's pod template and its first container's image and training command."""
    wpath = "spec.replicaSpecs.Worker"
    template = worker.get("template")
    if not isinstance(template, Mapping) or not template:
        raise SpecError(f"{wpath}.template", "is required: the pod template of a worker")
    pod_spec = template.get("spec")
    if not isinstance(pod_spec, Mapping):
        raise SpecError(f"{wpath}.template.spec", "is required: a pod spec with the training container")
    containers = pod_spec.get("containers")
    if not isinstance(containers, list) or not containers or not isinstance(containers[0], Mapping):
        raise SpecError(
            f"{wpath}.template.spec.containers",
            "must list at least one container; the first one runs the training command",
        )
    container = containers[0]
    cpath = f"{wpath}.template.spec.containers[0]"
    image = container.get("image")
    if not isinstance(image, str) or not image:
        raise SpecError(f"{cpath}.image", "is required: the worker image (Python and torch)")
    return _Container(template, image, _worker_command(container, cpath))


def _check_job_secret_room(template: Mapping[str, Any]) -> None:
    """No container of the template mounts another volume than :data:`JOB_SECRET_VOLUME` at or
    below ``contract.JOB_SECRET_MOUNT_DIR``: it would hide the job's secret, or sit inside its
    read-only volume. (A volume of that name is the operator's: the worker pod gets the secret's
    in its place, as a template copied from a worker pod has it.)"""
    tpath = "spec.replicaSpecs.Worker.template.spec"
    pod_spec: Mapping[str, Any] = template["spec"]  # checked by _parse_container
    root = contract.JOB_SECRET_MOUNT_DIR
    for kind in ("initContainers", "containers"):
        for c, container in enumerate(pod_spec.get(kind) or []):
            if not isinstance(container, Mapping):
                continue
            for m, mount in enumerate(container.get("volumeMounts") or []):
                if not isinstance(mount, Mapping) or mount.get("name") == JOB_SECRET_VOLUME:
                    continue
                target = str(mount.get("mountPath") or "").rstrip("/")
                if target == root or target.startswith(root + "/"):
                    raise SpecError(
                        f"{tpath}.{kind}[{c}].volumeMounts[{m}].mountPath",
                        f"{mount.get('mountPath')} is where the operator mounts the job's secret "
                        f"({root}, read-only); mount volume {mount.get('name')!r} elsewhere",
                    )


def _parse_nproc(spec: Mapping[str, Any]) -> int | str:
    """``spec.nprocPerNode``: a positive integer (also as digits) or one of the words."""
    raw = spec.get("nprocPerNode", DEFAULTS["nproc_per_node"])
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise SpecError("spec.nprocPerNode", f"must be a positive integer or 'auto', got {raw!r}")
    nproc: int | str = raw
    if isinstance(nproc, str):
        if nproc.isdigit():
            nproc = int(nproc)
        elif nproc not in _NPROC_WORDS:
            raise SpecError("spec.nprocPerNode", f"must be a positive integer or 'auto', got {nproc!r}")
    if isinstance(nproc, int) and nproc < 1:
        raise SpecError("spec.nprocPerNode", f"must be at least 1, got {nproc}")
    return nproc


def _parse_rendezvous(spec: Mapping[str, Any]) -> _Rendezvous:
    """``spec.rdzvEndpoint``, ``spec.rdzvBackend`` and ``spec.rdzvConf``."""
    endpoint = spec.get("rdzvEndpoint") or None
    if endpoint is not None:
        match = _ENDPOINT_RE.match(str(endpoint))
        if not match or not 0 < int(match.group(1)) < 65536:
            raise SpecError(
                "spec.rdzvEndpoint", f"must be HOST:PORT (an IPv6 address as [ADDR]:PORT), got {endpoint!r}"
            )
    backend = _enum(spec, "rdzvBackend", "spec.rdzvBackend", RdzvBackend, DEFAULTS["rdzv_backend"])
    if backend.external and endpoint is None:
        raise SpecError(
            "spec.rdzvEndpoint",
            f"is required with rdzvBackend {backend.value}: HOST:PORT of your etcd (the operator runs "
            "a rendezvous store only for the kelastic and c10d backends)",
        )

    conf_raw = spec.get("rdzvConf") or {}
    if not isinstance(conf_raw, Mapping):
        raise SpecError("spec.rdzvConf", "must be an object of key: value settings")
    rdzv_conf: dict[str, str] = {}
    for key, value in conf_raw.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if "," in text or "=" in str(key) or "," in str(key):
            raise SpecError(f"spec.rdzvConf.{key}", "keys and values may not contain ',' (or '=' in keys)")
        rdzv_conf[str(key)] = text
    if backend is RdzvBackend.KELASTIC and contract.RDZV_CONF_CONTROLLED in rdzv_conf:
        raise SpecError(
            f"spec.rdzvConf.{contract.RDZV_CONF_CONTROLLED}",
            "is set by the operator: the agents of a kelastic-backend job always wait for the membership "
            "it publishes; remove the key",
        )
    return _Rendezvous(backend, endpoint, rdzv_conf)


def _parse_min_replicas_timeout(meta: JobMeta) -> float | None:
    """The job's own minReplicas timeout (seconds) from its annotation, if it has one."""
    timeout_raw = meta.annotations.get(ANNOTATION_MIN_REPLICAS_TIMEOUT)
    if timeout_raw is None:
        return None
    try:
        timeout = float(timeout_raw)
    except ValueError:
        timeout = -1.0
    if timeout < 0:
        raise SpecError(
            f"metadata.annotations[{ANNOTATION_MIN_REPLICAS_TIMEOUT}]",
            f"must be a number of seconds >= 0, got {timeout_raw!r}",
        )
    return timeout


def _worker_command(container: Mapping[str, Any], path: str) -> WorkerCommand:
    """The training command of the worker container (``command`` + ``args``, or ``args`` alone)."""
    command = container.get("command") or []
    args = container.get("args") or []
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise SpecError(f"{path}.command", "must be a list of strings")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError(f"{path}.args", "must be a list of strings")
    if command:
        return split_worker_command([*command, *args], f"{path}.command")
    if not args:
        raise SpecError(
            f"{path}.command",
            "is required: the training command as you would run it on one machine "
            "(e.g. [python, train.py]); the operator wraps it in kelastic-agent",
        )
    return split_launcher_args(args, f"{path}.args")


#: Agent flags the operator sets from the job's spec; an ``args``-only container may not repeat them.
_OPERATOR_FLAGS = (
    "nnodes",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "max-restarts",
    "local-addr",
    "health-port",
    "standalone",
)


def split_launcher_args(args: list[str], path: str = "args") -> WorkerCommand:
    """An ``args``-only worker container, as pytorch/elastic's ElasticJob examples wrote it.

    There the image's entrypoint was the torchelastic launcher and ``args`` were its
    arguments: launcher options, then the training script and its arguments
    (``[--nproc_per_node=2, /workspace/train.py, --lr=0.1]``). kelastic-agent takes the
    launcher's place (it accepts torchrun's flags): the leading ``--flag=value`` options
    (or bare ``--flag`` switches) go to the agent, the script runs under ``python``
    (``-m``/``--module`` and ``--no-python``/``--no_python`` as torchrun reads them).
    Flags the operator derives from the spec (``--nnodes``, ``--rdzv-*`` …) are refused.
    """
    options: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg = args[i]
        name = arg[2:].split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg
        if name in _OPERATOR_FLAGS:
            field_name = {"nnodes": "minReplicas/maxReplicas", "max-restarts": "maxRestarts"}.get(
                name, "the job's spec"
            )
            raise SpecError(
                path, f"--{name} is set by the operator (from {field_name}); remove it from the arguments"
            )
        options.append(arg)
        i += 1
    if i >= len(args):
        raise SpecError(
            path,
            "has launcher options but no training script; with no command, args are "
            "[launcher options..., script, script args...] (e.g. [--nproc_per_node=2, train.py])",
        )
    module = any(o in ("-m", "--module") for o in options)
    no_python = any(o in ("--no-python", "--no_python") for o in options)
    kept = tuple(o for o in options if o not in ("-m", "--module", "--no-python", "--no_python"))
    for option in kept:
        if not option.startswith("--") or (
            "=" not in option and option[2:].replace("_", "-") in _VALUE_FLAGS
        ):
            raise SpecError(path, f"launcher option {option!r}: write options as --flag=value")
    program, rest = args[i], tuple(args[i + 1 :])
    if no_python:
        return WorkerCommand(None, (), False, program, rest, kept)
    return WorkerCommand("python", (), module, program, rest, kept)


#: torchrun flags that take a value (an ``args``-only container must write them as ``--flag=value``).
_VALUE_FLAGS = (
    "nproc-per-node",
    "rdzv-conf",
    "role",
    "monitor-interval",
    "start-method",
    "log-dir",
    "redirects",
    "tee",
    "local-ranks-filter",
    "node-rank",
    "master-addr",
    "master-port",
)


#: Python options that take a value as the next argument.
_PY_OPTS_WITH_VALUE = ("-X", "-W")


def split_worker_command(argv: list[str], path: str = "command") -> WorkerCommand:
    """Split ``argv`` (container command + args) into what ``kelastic-agent`` needs.

    Raises :class:`SpecError` (naming ``path``) for forms the agent cannot launch:
    ``python -c CODE``, ``python`` without a script, or an empty command.
    """
    if not argv or not argv[0]:
        raise SpecError(path, "is empty")
    first = argv[0]
    if not _PYTHON_RE.match(first.rsplit("/", 1)[-1]):
        return WorkerCommand(None, (), False, first, tuple(argv[1:]))
    options: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            if i + 1 >= len(argv):
                raise SpecError(path, "'python -m' needs a module name")
            return WorkerCommand(first, tuple(options), True, argv[i + 1], tuple(argv[i + 2 :]))
        if arg.startswith("-m") and len(arg) > 2:
            return WorkerCommand(first, tuple(options), True, arg[2:], tuple(argv[i + 1 :]))
        if arg == "-c" or arg.startswith("-c"):
            raise SpecError(path, "'python -c CODE' cannot be launched per rank; put the code in a script")
        if arg in _PY_OPTS_WITH_VALUE:
            if i + 1 >= len(argv):
                raise SpecError(path, f"python option {arg} needs a value")
            options += [arg, argv[i + 1]]
            i += 2
            continue
        if arg == "-" or not arg.startswith("-"):
            if arg == "-":
                raise SpecError(path, "reading the script from stdin ('python -') is not supported")
            return WorkerCommand(first, tuple(options), False, arg, tuple(argv[i + 1 :]))
        options.append(arg)
        i += 1
    raise SpecError(path, f"{first!r} without a script to run; name the training script (e.g. train.py)")

"""A pod's containers as processes: starting a run, its exit, its restart, its probes.

:class:`Container` is one container's runtime state (its process, its probes, the record
its status is written from). The functions start a container's run (its environment,
command and volumes resolved, the process spawned with its log), turn its exit into a
``terminated`` state and decide its restart (the restart policy, CrashLoopBackOff), and
run its startup, readiness and liveness probes. What they need of the pod that owns the
containers is :class:`PodView` (the pod's worker, :mod:`.podworker`, is one); the pod's
lifecycle itself (admission, binding, phase, status, deletion) is the worker's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..common.client import ApiRequestError
from .gpus import device_env
from .images import mount_table, relocate, relocate_argv
from .kubeconfigs import write_empty_kubeconfig
from .nodeview import KubeletView
from .podenv import (
    ContainerConfigError,
    PodContext,
    expand,
    resolve_command,
    resolve_env,
    without_credentials,
)
from .podstatus import (
    ContainerRecord,
    ContainerState,
    CrashBackoff,
    Terminated,
    exit_reason,
    should_restart,
)
from .probes import ProbeResult, ProbeSpec, ProbeTracker, probe_once
from .runtime import ContainerProcess, ExitStatus, spawn
from .satokens import IssuedToken
from .termination import ENV_TERMINATION_MESSAGE_PATH, message_file, read_termination_message
from .volumes import mount_env, prepare_volumes

__all__ = ["CONFIG_RETRY_S", "Container", "PodView", "exited", "start", "start_probes"]

#: How often a container that cannot be configured (missing configmap...) is retried.
CONFIG_RETRY_S = 2.0
#: How long after a pod's start a 403 on its secrets/configmaps/tokens is taken for
#: the Node authorizer not having seen the pod's binding yet.
AUTHORIZER_GRACE_S = 10.0


class Container:
    """Runtime state of one container of a pod."""

    def __init__(self, spec: Mapping[str, Any], init: bool) -> None:
        self.spec = spec
        self.name: str = spec.get("name", "")
        self.record = ContainerRecord(name=self.name, image=str(spec.get("image", "")), init=init)
        if init:
            self.record.waiting_reason = "PodInitializing"
        self.process: ContainerProcess | None = None
        self.exit_task: asyncio.Task[None] | None = None
        self.probe_tasks: list[asyncio.Task[None]] = []
        self.restart_due: float | None = None
        self.env: dict[str, str] = {}
        self.cwd: str = ""
        #: The current run's log and its mapped ``terminationMessagePath``.
        self.log_path: Path | None = None
        self.message_path: Path | None = None
        self.readiness: ProbeTracker | None = None
        self.startup: ProbeTracker | None = None
        self.liveness: ProbeTracker | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and not self.process.exited

    def cancel_probes(self) -> None:
        for task in self.probe_tasks:
            task.cancel()
        self.probe_tasks.clear()

    def refresh_ready(self) -> None:
        """Set ``started`` and ``ready`` from the process and its probes."""
        rec = self.record
        started = self.running and (self.startup is None or self.startup.ok)
        rec.started = bool(started)
        if rec.init:
            rec.ready = rec.state is ContainerState.TERMINATED and bool(
                rec.terminated and rec.terminated.exit_code == 0
            )
            return
        rec.ready = bool(started and (self.readiness is None or self.readiness.ok))

    def restore(self, prev: Mapping[str, Any], policy: str) -> None:
        """Carry over what a previous kubelet reported of this container (``prev``, its entry
        of the pod's status): its restarts, and a run that ended or whose process died
        with that kubelet, restarted now when ``policy`` says so."""
        rec = self.record
        rec.restart_count = int(prev.get("restartCount", 0))
        state = prev.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            rec.state = ContainerState.TERMINATED
            rec.terminated = Terminated(
                exit_code=int(t.get("exitCode", 0)),
                reason=str(t.get("reason", "")),
                started_at=None,
                finished_at=time.time(),
            )
            if should_restart(policy, rec.terminated.exit_code, init=rec.init):
                self.restart_due = time.time()
        elif "running" in state:
            # Its process died with the previous kubelet.
            rec.state = ContainerState.TERMINATED
            rec.terminated = Terminated(
                exit_code=137,
                reason="ContainerStatusUnknown",
                started_at=None,
                finished_at=time.time(),
                message="the kubelet restarted and the container's process was gone",
            )
            if should_restart(policy, 137, init=rec.init):
                self.restart_due = time.time()
        elif "terminated" in (prev.get("lastState") or {}):
            # Waiting in back-off: restart now, counting it as a restart.
            t = prev["lastState"]["terminated"]
            rec.last_terminated = Terminated(
                exit_code=int(t.get("exitCode", 0)),
                reason=str(t.get("reason", "")),
                started_at=None,
                finished_at=time.time(),
            )
            self.restart_due = time.time()


class PodView(Protocol):
    """What a container's run needs of the pod that owns it (its worker)."""

    kubelet: KubeletView
    uid: str
    namespace: str
    name: str
    pod_ip: str | None
    start_time: float | None
    volumes: dict[str, Path]
    tokens: dict[str, IssuedToken]
    deadline_exceeded: bool
    backoff: CrashBackoff
    wake: asyncio.Event
    init: list[Container]

    @property
    def pod(self) -> dict[str, Any] | None: ...

    @property
    def pod_dir(self) -> Path: ...

    def restart_policy(self, pod: Mapping[str, Any]) -> str: ...

    def grace(self, pod: Mapping[str, Any] | None) -> float: ...


async def _configure(w: PodView, pod: dict[str, Any], c: Container) -> tuple[list[str], dict[str, str]]:
    """The container's command and the environment it defines (its own and what the node
    provides), with the pod's volumes prepared on its first run."""
    config = w.kubelet.config
    configmaps, secrets = await w.kubelet.fetch_sources(w.namespace, pod, c.spec)
    if not w.volumes:
        w.tokens = await w.kubelet.fetch_tokens(pod)
        w.volumes = prepare_volumes(
            pod,
            w.pod_dir,
            configmaps,
            secrets,
            {key: issued.token for key, issued in w.tokens.items()},
            claims_dir=config.data_dir / "claims" / w.namespace,
        )
    provided = {
        **_device_env(w, c),
        "HOSTNAME": w.name,
        "PYTHONUNBUFFERED": "1",
        **w.kubelet.in_cluster_env(pod, c.spec, w.volumes, w.pod_dir),
        **mount_env(pod, c.spec, w.volumes),
    }
    ctx = PodContext(
        pod_ip=w.pod_ip or "",
        node_name=config.node_name,
        host_ip=config.host_ip,
        configmaps=configmaps,
        secrets=secrets,
        provided=provided,
    )
    defined = resolve_env(pod, c.spec, ctx)
    argv = resolve_command(c.spec, defined)
    # Volumes cannot sit at their mountPath here: name their host directories instead.
    mounts = mount_table(pod, c.spec, w.volumes)
    defined = {k: v if provided.get(k) == v else relocate(v, mounts) for k, v in defined.items()}
    written = [*(c.spec.get("command") or []), *(c.spec.get("args") or [])]
    argv = relocate_argv(
        config.images.resolve(c.spec, argv, defined), expand(str(written[0]), defined), mounts
    )
    return argv, defined


async def start(w: PodView, pod: dict[str, Any], c: Container) -> float | None:
    """Start one container run; return a retry time if it could not be configured."""
    config = w.kubelet.config
    rec = c.record
    try:
        argv, defined = await _configure(w, pod, c)
    except (ContainerConfigError, ApiRequestError, OSError) as exc:
        if (
            isinstance(exc, ApiRequestError)
            and exc.status == 403
            and time.time() - (w.start_time or 0.0) < AUTHORIZER_GRACE_S
        ):
            # The Node authorizer learns of a pod's binding from its own watch,
            # a moment after we do: a refused read of the pod's secret is retried
            # quietly for a little while before it counts as an error.
            return time.time() + 0.5
        rec.state = ContainerState.WAITING
        rec.waiting_reason = "CreateContainerConfigError"
        rec.waiting_message = str(exc)
        c.restart_due = None
        w.kubelet.event(pod, "Failed", f"Error: {exc}", warning=True)
        return time.time() + CONFIG_RETRY_S
    workdir = c.spec.get("workingDir")
    cwd = Path(workdir) if workdir else config.workdir
    log_path = w.pod_dir / c.name / f"{rec.restart_count}.log"
    message_path = message_file(w.pod_dir / c.name, rec.restart_count)
    # The container's terminationMessagePath, mapped to a file of its own on this host.
    # Not this process's kubeconfig, nor ~/.kube/config (the clients' fallback): a
    # pod without service-account credentials gets an empty one unless it sets its own.
    no_credentials = {"KUBECONFIG": str(write_empty_kubeconfig(w.pod_dir / "no-credentials.kubeconfig"))}
    env = config.images.environment(
        c.spec,
        {
            **without_credentials(config.base_env),
            **no_credentials,
            **defined,
            ENV_TERMINATION_MESSAGE_PATH: str(message_path),
        },
    )
    c.log_path, c.message_path = log_path, message_path
    try:
        cwd.mkdir(parents=True, exist_ok=True)
        message_path.parent.mkdir(parents=True, exist_ok=True)
        message_path.write_bytes(b"")
        process = spawn(argv, env, str(cwd), log_path)
    except OSError as exc:
        now = time.time()
        message = f"failed to start {argv[0]!r}: {exc.strerror or exc}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as f:
            f.write((message + "\n").encode())
        w.kubelet.event(pod, "Failed", f"Error: {message}", warning=True)
        exited(w, pod, c, Terminated(128, "StartError", now, now, message=message))
        return c.restart_due  # when the restart policy tries again (None: never)
    c.process = process
    c.env = env
    c.cwd = str(cwd)
    rec.state = ContainerState.RUNNING
    rec.started_at = process.started_at
    rec.container_id = f"kelastic://{process.pid}"
    rec.waiting_message = ""
    w.kubelet.event(pod, "Started", f"Started container {c.name}")
    c.exit_task = asyncio.get_running_loop().create_task(_watch_exit(w, c, process))
    start_probes(w, pod, c)
    return None


def _device_env(w: PodView, c: Container) -> dict[str, str]:
    """The container's GPUs as the device plugin names them (nothing on a node without GPUs)."""
    ledger = w.kubelet.gpus
    if not ledger.devices:
        return {}
    return device_env((ledger.held(w.uid) or {}).get(c.name))


async def _watch_exit(w: PodView, c: Container, process: ContainerProcess) -> None:
    status: ExitStatus = await process.wait()
    c.cancel_probes()
    pod = w.pod
    message = ""
    if c.message_path is not None and c.log_path is not None:
        message = read_termination_message(
            c.message_path, c.log_path, c.spec.get("terminationMessagePolicy"), status.exit_code
        )
    term = Terminated(
        exit_code=status.exit_code,
        reason=exit_reason(status.exit_code),
        started_at=process.started_at,
        finished_at=status.finished_at,
        message=message,
        signal=status.signal,
        container_id=f"kelastic://{process.pid}",
    )
    if pod is not None:
        exited(w, pod, c, term)
    else:
        c.record.state = ContainerState.TERMINATED
        c.record.terminated = term
    w.wake.set()


def exited(w: PodView, pod: Mapping[str, Any], c: Container, term: Terminated) -> None:
    rec = c.record
    rec.state = ContainerState.TERMINATED
    rec.terminated = term
    rec.ready = False
    if pod["metadata"].get("deletionTimestamp") or w.deadline_exceeded:
        return
    policy = w.restart_policy(pod)
    if not should_restart(policy, term.exit_code, init=c in w.init):
        return
    delay = w.backoff.delay_after_exit(c.name, term.finished_at - (term.started_at or term.finished_at))
    c.restart_due = time.time() + delay
    if delay > 0:
        rec.last_terminated = term
        rec.terminated = None
        rec.state = ContainerState.WAITING
        rec.waiting_reason = "CrashLoopBackOff"
        rec.waiting_message = (
            f"back-off {delay:g}s restarting failed container={c.name} pod={w.name}_{w.namespace}({w.uid})"
        )
        w.kubelet.event(pod, "BackOff", "Back-off restarting failed container", warning=True)


def start_probes(w: PodView, pod: Mapping[str, Any], c: Container) -> None:
    spec = c.spec
    try:
        startup = ProbeSpec.parse(spec.get("startupProbe"))
        readiness = ProbeSpec.parse(spec.get("readinessProbe"))
        liveness = ProbeSpec.parse(spec.get("livenessProbe"))
    except ValueError as exc:
        w.kubelet.event(pod, "Unhealthy", str(exc), warning=True)
        startup = readiness = liveness = None
    c.startup = ProbeTracker(startup, initial=False) if startup else None
    c.readiness = ProbeTracker(readiness, initial=False) if readiness else None
    c.liveness = ProbeTracker(liveness, initial=True) if liveness else None
    loop = asyncio.get_running_loop()
    for tracker, kind in ((c.startup, "Startup"), (c.readiness, "Readiness"), (c.liveness, "Liveness")):
        if tracker is not None:
            c.probe_tasks.append(loop.create_task(_probe_loop(w, c, tracker, kind)))


async def _probe_loop(w: PodView, c: Container, tracker: ProbeTracker, kind: str) -> None:
    spec = tracker.spec
    await asyncio.sleep(spec.initial_delay)
    while c.running:
        if kind != "Startup" and c.startup is not None and not c.startup.ok:
            await asyncio.sleep(min(spec.period, 0.5))
            continue
        result, output = await probe_once(
            spec,
            pod_ip=w.pod_ip or "",
            env=c.env,
            cwd=c.cwd,
            container_ports=c.spec.get("ports") or [],
        )
        pod = w.pod
        if result is ProbeResult.FAILURE and pod is not None:  # the real kubelet's words
            w.kubelet.event(pod, "Unhealthy", f"{kind} probe failed: {output}", warning=True)
        changed = tracker.record(result)
        if kind == "Startup" and tracker.ok:
            w.wake.set()
            return  # a startup probe stops once it succeeded
        if not tracker.ok and kind in ("Liveness", "Startup") and c.process is not None:
            if pod is not None:
                w.kubelet.event(
                    pod, "Killing", f"Container {c.name} failed {kind.lower()} probe, will be restarted"
                )
            await c.process.stop(w.grace(pod))
            return
        if changed:
            w.wake.set()
        await asyncio.sleep(spec.period)

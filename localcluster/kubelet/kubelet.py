"""The process kubelet: runs the pods of the one local node as local processes.

A client of the API server like a real node agent: it watches pods, binds
unscheduled ones to its node (it is the scheduler too), and for each pod bound
to it runs one :class:`PodWorker` that

- holds the GPUs the pod requests (``nvidia.com/gpu``; the pod waits, Pending,
  while too few are free) and names them to its containers as the NVIDIA device
  plugin does (see :mod:`kelastic.localcluster.kubelet.gpus`),
- gives the pod an address in ``127.1.0.0/16`` (``status.podIP``),
- prepares its volumes (see :mod:`kelastic.localcluster.kubelet.volumes`),
- runs the init containers one after another, then the containers, each as a
  process group of the current Python environment (see
  :mod:`kelastic.localcluster.kubelet.podenv` for env and argv), logging to
  ``<data_dir>/pods/<namespace>_<pod>_<uid>/<container>/<restartCount>.log``,
- restarts exited containers per ``restartPolicy`` with exponential back-off
  (``CrashLoopBackOff``), runs startup/readiness/liveness probes,
- writes the status a real kubelet writes (phase, conditions, container
  statuses) and posts Events,
- on graceful deletion (``deletionTimestamp``) sends SIGTERM to every
  container's process group, waits up to the grace period, sends SIGKILL, then
  deletes the pod with grace period 0; when the pod disappears at once (force
  deletion) it kills the processes immediately.

The kubelet is level-based: every pod event only wakes the pod's worker, which
compares what runs with what the latest pod object asks for.

One implementation for both API servers: against the emulator it also binds
pods (``KubeletConfig.bind_pods``); against a real control plane the scheduler
binds them and the kubelet watches only the pods of its node. Either way it
registers its Node, renews the node's Lease in ``kube-node-lease`` and the
Ready condition's heartbeat, so the node never goes NotReady. Service-account
tokens are mounted as the API server asks (the token Secret volume of
Kubernetes 1.20, projected volumes with a TokenRequest token of current
releases); since a mount path such as
``/var/run/secrets/kubernetes.io/serviceaccount`` cannot be honoured on a
shared filesystem, a container that mounts the token gets ``KUBECONFIG``
naming a kubeconfig with that token, plus ``KUBERNETES_SERVICE_HOST``/``PORT``
pointing at the API server's loopback address, so in-cluster clients (kopf,
the official client) authenticate as the pod's ServiceAccount.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import os
import platform
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.client import ApiClient, ApiRequestError, Informer
from ..common.ipam import POD_NETWORK, IpAllocator, IpExhaustedError
from ..common.podlogs import pod_log_dir
from .gpus import GPU_RESOURCE, GpuLedger, detect_gpus, device_env, pod_claim
from .images import ImageMap, mount_table, relocate, relocate_argv
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
    PodFacts,
    PodPhase,
    Terminated,
    exit_reason,
    parse_rfc3339,
    pod_phase,
    pod_status,
    rfc3339,
    should_restart,
)
from .preemption import choose_victims, holders, preempt
from .probes import ProbeResult, ProbeSpec, ProbeTracker, probe_once
from .runtime import ContainerProcess, ExitStatus, spawn
from .satokens import DEFAULT_EXPIRATION_S, IssuedToken, issued_token, refresh_due, write_atomically
from .termination import ENV_TERMINATION_MESSAGE_PATH, message_file, read_termination_message
from .volumes import mount_env, prepare_volumes, token_key

__all__ = ["DEFAULT_NODE_NAME", "Kubelet", "KubeletConfig"]

log = logging.getLogger(__name__)

DEFAULT_NODE_NAME = "kelastic-local"
#: How often a container that cannot be configured (missing configmap...) is retried.
CONFIG_RETRY_S = 2.0
#: How soon a status write that failed is tried again (a status must never stay stale).
STATUS_RETRY_S = 1.0
#: How long after a pod's start a 403 on its secrets/configmaps/tokens is taken for
#: the Node authorizer not having seen the pod's binding yet.
AUTHORIZER_GRACE_S = 10.0
#: Where Kubernetes mounts a pod's service-account credentials.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The kubeconfig (in the pod's directory) that hands a container its service-account token.
SERVICE_ACCOUNT_KUBECONFIG = "serviceaccount.kubeconfig"
#: Seconds before a refused token refresh is tried again (the old token is still valid).
TOKEN_RETRY_S = 10.0
#: The node Lease's duration, as a real kubelet sets it.
LEASE_DURATION_S = 40


@dataclass
class KubeletConfig:
    """How the kubelet runs pods."""

    data_dir: Path
    node_name: str = DEFAULT_NODE_NAME
    #: Working directory of containers that set no ``workingDir``.
    workdir: Path = field(default_factory=Path.cwd)
    host_ip: str = "127.0.0.1"
    backoff_base: float = 10.0
    backoff_cap: float = 300.0
    #: Grace given to pods when the kubelet itself shuts down.
    shutdown_grace: float = 2.0
    #: Seconds a deleted pod's logs are kept before its directory is removed.
    log_retention: float = 60.0
    #: Where pod IPs come from (a LocalCluster passes the block it claimed).
    pod_network: ipaddress.IPv4Network = POD_NETWORK
    #: Environment every container starts from (the current one by default:
    #: containers are processes of this Python environment).
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    #: Bind unscheduled pods to this node (the emulator has no scheduler); with a
    #: real kube-scheduler the kubelet only runs the pods bound to it.
    bind_pods: bool = True
    #: The API server as pods reach it (``https://127.0.0.1:PORT``): sets
    #: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the service-account kubeconfig.
    #: None for the emulator (plain http: in-cluster clients cannot use it).
    api_url: str | None = None
    #: The port of the kubelet's log server, published in the Node's daemonEndpoints (0: none).
    kubelet_port: int = 0
    #: How often the node's Lease and Ready heartbeat are renewed.
    heartbeat_s: float = 10.0
    #: The version the Node reports (that of the control plane, when there is a real one).
    version: str = "v1.37.2-kelastic"
    #: Which interpreter plays which image (unlisted images: this Python environment).
    images: ImageMap = field(default_factory=ImageMap)
    #: The node's ``nvidia.com/gpu`` count; None: detected (see :func:`~.gpus.detect_gpus`).
    gpus: int | None = None
    #: The node's cpu capacity and allocatable (a quantity: ``2``, ``1500m``); None: the machine's
    #: cores. Only the scheduler counts it: pods are not limited to it.
    cpus: str | None = None


class _Container:
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


class PodWorker:
    """Owns one pod (by UID) from binding to deletion; see the module docstring."""

    def __init__(self, kubelet: Kubelet, uid: str, key: str) -> None:
        self.kubelet = kubelet
        self.uid = uid
        self.key = key
        self.namespace, self.name = key.split("/", 1)
        self.wake = asyncio.Event()
        self.init: list[_Container] = []
        self.containers: list[_Container] = []
        self.pod_ip: str | None = None
        self.start_time: float | None = None
        self.last_status: dict[str, Any] | None = None
        self.volumes: dict[str, Path] = {}
        #: The projected service-account tokens written into ``volumes``, by token_key.
        self.tokens: dict[str, IssuedToken] = {}
        self.volume_error = ""
        self.facts_reason = ""
        self.facts_message = ""
        self.deadline_exceeded = False
        self._deadline_kill: asyncio.Task[None] | None = None
        self.backoff = CrashBackoff(kubelet.config.backoff_base, kubelet.config.backoff_cap)
        self.task: asyncio.Task[None] | None = None

    # -- helpers ------------------------------------------------------------
    @property
    def pod(self) -> dict[str, Any] | None:
        pod = self.kubelet.pods.get(self.key)
        if pod is None or pod["metadata"].get("uid") != self.uid:
            return None
        return pod

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    @property
    def pod_dir(self) -> Path:
        return pod_log_dir(self.kubelet.config.data_dir, self.namespace, self.name, self.uid)

    def all_containers(self) -> list[_Container]:
        return self.init + self.containers

    def restart_policy(self, pod: Mapping[str, Any]) -> str:
        return str(pod["spec"].get("restartPolicy") or "Always")

    # -- main loop ----------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod worker for %s failed", self.key)
        finally:
            await self._kill_all(0.0)
            if not self.kubelet.stopping:  # every process of the pod is gone
                self.kubelet.release_gpus(self.uid)
            if self.pod_ip:
                self.kubelet.ipam.release(self.pod_ip)
            self.kubelet.workers.pop(self.uid, None)
            self.kubelet.forget_events(self.uid)
            if not self.kubelet.stopping:
                # The pod is gone (a node shutdown keeps everything for the next start).
                # Its logs stay a while for whoever is still reading them.
                shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)
                asyncio.get_running_loop().call_later(
                    self.kubelet.config.log_retention, shutil.rmtree, self.pod_dir, True
                )

    async def _run(self) -> None:
        if not await self._admit_gpus():
            return
        pod = self.pod
        if pod is None:
            return
        while not pod["spec"].get("nodeName"):
            try:
                await self.kubelet.bind(pod)
            except Exception as exc:
                log.warning("could not bind pod %s to %s: %s", self.key, self.kubelet.config.node_name, exc)
                await asyncio.sleep(1.0)
            pod = self.pod
            if pod is None:
                return
        self._load(pod)
        while True:
            # Cleared before looking, so a change during the sync (a process exiting
            # while the status is written) wakes the next round instead of being lost.
            self.wake.clear()
            pod = self.pod
            if pod is None:
                # Gone without a grace period (force deletion): kill at once.
                await self._kill_all(0.0)
                return
            if pod["metadata"].get("deletionTimestamp"):
                await self._terminate(pod)
                return
            if pod["spec"].get("nodeName") == self.kubelet.config.node_name:
                due = await self._sync(pod)
                refresh = await self.refresh_tokens(pod)
                due = refresh if due is None else due if refresh is None else min(due, refresh)
            else:
                due = None
            timeout = None if due is None else max(0.0, due - time.time())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)

    async def refresh_tokens(self, pod: Mapping[str, Any], now: float | None = None) -> float | None:
        """Replace the tokens that are due (see :mod:`~kelastic.localcluster.kubelet.satokens`); when to look next.

        The token file is rewritten in place (atomically), and so is the container's
        service-account kubeconfig that carries it. A refused request keeps the old
        token (still valid for a fifth of its life) and is retried shortly.
        """
        now = time.time() if now is None else now
        sources = {
            token_key(
                str(vol.get("name", "")), str((src["serviceAccountToken"] or {}).get("path", "token"))
            ): src["serviceAccountToken"] or {}
            for vol in pod["spec"].get("volumes") or []
            for src in (vol.get("projected") or {}).get("sources") or []
            if "serviceAccountToken" in src
        }
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None  # no container will run again to read them
        upcoming: list[float] = []
        for key, old in list(self.tokens.items()):
            directory = self.volumes.get(old.volume)
            if key not in sources or directory is None:
                continue  # nowhere to write it
            if not refresh_due(old, now):
                upcoming.append(old.refresh_at)
                continue
            try:
                new = await self.kubelet.request_token(pod, old.volume, sources[key])
                write_atomically(directory / old.path, new.token, 0o644)
                kubeconfig = self.pod_dir / SERVICE_ACCOUNT_KUBECONFIG
                if kubeconfig.is_file():
                    rewrite_token_kubeconfig(kubeconfig, old.token, new.token)
            except (ApiRequestError, OSError) as exc:
                log.warning(
                    "could not refresh the service-account token of pod %s volume %s: %s",
                    self.key,
                    old.volume,
                    exc,
                )
                upcoming.append(now + TOKEN_RETRY_S)
                continue
            self.tokens[key] = new
            upcoming.append(max(new.refresh_at, now + TOKEN_RETRY_S))
        return min(upcoming, default=None)

    async def _admit_gpus(self) -> bool:
        """Hold the pod's GPUs before it is bound or started, waiting while too few are free;
        False when the pod went away meanwhile.

        Without a scheduler (the emulator) the kubelet binds pods itself, so it also says
        what a scheduler would: the pod stays Pending, PodScheduled False (Unschedulable,
        ``Insufficient nvidia.com/gpu``). With a scheduler this waits only for a pod of
        ours that is still stopping (the scheduler counted its devices free already).
        """
        kubelet = self.kubelet
        reported = False
        try:
            while True:
                self.wake.clear()  # before looking: a release meanwhile wakes the wait below
                pod = self.pod
                if pod is None:
                    return False
                claim = pod_claim(pod)
                if claim.total == 0 or pod["metadata"].get("deletionTimestamp"):
                    return True
                if kubelet.gpus.claim(self.uid, claim) is not None:
                    return True
                kubelet.gpu_waiters.add(self)
                if not reported and kubelet.config.bind_pods and not pod["spec"].get("nodeName"):
                    # No scheduler: preempt lower-priority pods as it would, else say it waits.
                    victims = choose_victims(
                        int(pod["spec"].get("priority") or 0),
                        str(pod["spec"].get("preemptionPolicy") or "PreemptLowerPriority"),
                        claim.total,
                        kubelet.gpus.free,
                        holders(kubelet, kubelet.gpus.holders()),
                    )
                    if victims:
                        await preempt(kubelet, pod, victims)
                        reported = True
                    else:
                        reported = await self._report_unschedulable(pod, claim.total)
                await self.wake.wait()
        finally:
            kubelet.gpu_waiters.discard(self)

    async def _report_unschedulable(self, pod: Mapping[str, Any], wanted: int) -> bool:
        """Say, as kube-scheduler would, that the pod waits for GPUs; True once written."""
        message = f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE}."
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": rfc3339(time.time()),
        }
        try:
            await self.kubelet.client.strategic_patch(
                self.path + "/status", {"status": {"phase": "Pending", "conditions": [condition]}}
            )
        except Exception as exc:  # the next release tries again
            log.debug("could not report pod %s unschedulable: %s", self.key, exc)
            return False
        self.kubelet.event(pod, "FailedScheduling", f"{message} (it requests {wanted})", warning=True)
        return True

    def _release_gpus_when_done(self) -> None:
        """Free the pod's GPUs once no container of it runs or will run again."""
        if self.kubelet.gpus.held(self.uid) is None or any(c.running for c in self.all_containers()):
            return
        pod = self.pod
        policy = self.restart_policy(pod) if pod is not None else "Never"
        phase = pod_phase(policy, [c.record for c in self.init], [c.record for c in self.containers])
        if phase in (PodPhase.SUCCEEDED, PodPhase.FAILED) or self.deadline_exceeded:
            self.kubelet.release_gpus(self.uid)

    def _load(self, pod: Mapping[str, Any]) -> None:
        """Build container state, carrying over what a previous kubelet reported."""
        spec = pod["spec"]
        status = pod.get("status") or {}
        self.init = [_Container(c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [_Container(c, init=False) for c in spec.get("containers") or []]
        previous = {
            s.get("name"): s
            for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
        }
        for c in self.all_containers():
            prev = previous.get(c.name)
            if not prev:
                continue
            c.record.restart_count = int(prev.get("restartCount", 0))
            state = prev.get("state") or {}
            if "terminated" in state:
                t = state["terminated"]
                c.record.state = ContainerState.TERMINATED
                c.record.terminated = Terminated(
                    exit_code=int(t.get("exitCode", 0)),
                    reason=str(t.get("reason", "")),
                    started_at=None,
                    finished_at=time.time(),
                )
                if should_restart(
                    self.restart_policy(pod), c.record.terminated.exit_code, init=c.record.init
                ):
                    c.restart_due = time.time()
            elif "running" in state:
                # Its process died with the previous kubelet.
                c.record.state = ContainerState.TERMINATED
                c.record.terminated = Terminated(
                    exit_code=137,
                    reason="ContainerStatusUnknown",
                    started_at=None,
                    finished_at=time.time(),
                    message="the kubelet restarted and the container's process was gone",
                )
                if should_restart(self.restart_policy(pod), 137, init=c.record.init):
                    c.restart_due = time.time()
            elif "terminated" in (prev.get("lastState") or {}):
                # Waiting in back-off: restart now, counting it as a restart.
                t = prev["lastState"]["terminated"]
                c.record.last_terminated = Terminated(
                    exit_code=int(t.get("exitCode", 0)),
                    reason=str(t.get("reason", "")),
                    started_at=None,
                    finished_at=time.time(),
                )
                c.restart_due = time.time()
        ip = status.get("podIP")
        if ip and self.kubelet.ipam.reserve(ip, self.uid):
            self.pod_ip = ip
        if status.get("startTime"):
            self.start_time = parse_rfc3339(str(status["startTime"])) or time.time()
        self.last_status = status or None

    # -- reconciliation -----------------------------------------------------
    async def _sync(self, pod: dict[str, Any]) -> float | None:
        """Move the pod one step towards its spec; return when to look again (or None)."""
        now = time.time()
        policy = self.restart_policy(pod)
        if self.start_time is None:
            self.start_time = now
            if self.kubelet.config.bind_pods:  # else the scheduler said so
                self.kubelet.event(
                    pod, "Scheduled", f"Successfully assigned {self.key} to {self.kubelet.config.node_name}"
                )
        if self.pod_ip is None and pod["spec"].get("hostNetwork"):
            self.pod_ip = self.kubelet.config.host_ip  # the node's address, as on a real node
        if self.pod_ip is None:
            try:
                self.pod_ip = self.kubelet.ipam.allocate(self.uid)
                self.facts_reason = self.facts_message = ""
            except IpExhaustedError as exc:
                self.facts_reason, self.facts_message = "NoPodIP", str(exc)
                await self._write_status(pod)
                return now + CONFIG_RETRY_S
        due: list[float] = []
        phase = pod_phase(policy, [c.record for c in self.init], [c.record for c in self.containers])
        active = phase not in (PodPhase.SUCCEEDED, PodPhase.FAILED) and not self.deadline_exceeded
        deadline_s = pod["spec"].get("activeDeadlineSeconds")
        if active and deadline_s is not None:
            deadline = (self.start_time or now) + float(deadline_s)
            if now >= deadline:
                self._exceed_deadline(pod)
                active = False
            else:
                due.append(deadline)
        if active and not self.kubelet.stopping:
            await self._progress(pod, policy, now, due)
        for c in self.all_containers():
            self._refresh_ready(c)
        # Before the status says so: a scheduler that reads the pod finished may at once
        # bind another pod to its devices.
        self._release_gpus_when_done()
        if not await self._write_status(pod):
            due.append(time.time() + STATUS_RETRY_S)
        return min(due) if due else None

    def _exceed_deadline(self, pod: Mapping[str, Any]) -> None:
        """``activeDeadlineSeconds`` passed: stop every container for good, the pod fails."""
        self.deadline_exceeded = True
        self.facts_reason = "DeadlineExceeded"
        self.facts_message = "Pod was active on the node longer than the specified deadline"
        self.kubelet.event(pod, "DeadlineExceeded", self.facts_message, warning=True)
        for c in self.all_containers():
            c.restart_due = None
        self._deadline_kill = asyncio.get_running_loop().create_task(self._kill_all(self._grace(pod)))

    async def _progress(self, pod: dict[str, Any], policy: str, now: float, due: list[float]) -> None:
        # Init containers: one at a time, in order; the next starts when the previous succeeded.
        for c in self.init:
            rec = c.record
            if c.running:
                return
            if rec.state is ContainerState.TERMINATED and rec.terminated and rec.terminated.exit_code == 0:
                continue
            if rec.state is ContainerState.TERMINATED and c.restart_due is None:
                return  # failed for good: the pod has failed
            await self._start_if_due(pod, c, policy, now, due)
            return
        for c in self.containers:
            if c.running:
                continue
            rec = c.record
            if rec.state is ContainerState.TERMINATED and c.restart_due is None:
                continue  # finished for good
            await self._start_if_due(pod, c, policy, now, due)

    async def _start_if_due(
        self, pod: dict[str, Any], c: _Container, policy: str, now: float, due: list[float]
    ) -> None:
        if c.restart_due is not None and c.restart_due > now:
            due.append(c.restart_due)
            return
        if c.record.state is ContainerState.TERMINATED or c.record.last_terminated is not None:
            if c.record.state is ContainerState.TERMINATED and c.record.terminated is not None:
                c.record.last_terminated = c.record.terminated
            if c.restart_due is not None:
                c.record.restart_count += 1
        c.restart_due = None
        retry = await self._start(pod, c)
        if retry is not None:
            due.append(retry)

    async def _start(self, pod: dict[str, Any], c: _Container) -> float | None:
        """Start one container run; return a retry time if it could not be configured."""
        config = self.kubelet.config
        rec = c.record
        try:
            configmaps, secrets = await self.kubelet.fetch_sources(self.namespace, pod, c.spec)
            if not self.volumes:
                self.tokens = await self.kubelet.fetch_tokens(pod)
                self.volumes = prepare_volumes(
                    pod,
                    self.pod_dir,
                    configmaps,
                    secrets,
                    {key: issued.token for key, issued in self.tokens.items()},
                    claims_dir=config.data_dir / "claims" / self.namespace,
                )
            provided = {
                **self._device_env(c),
                "HOSTNAME": self.name,
                "PYTHONUNBUFFERED": "1",
                **self.kubelet.in_cluster_env(pod, c.spec, self.volumes, self.pod_dir),
                **mount_env(pod, c.spec, self.volumes),
            }
            ctx = PodContext(
                pod_ip=self.pod_ip or "",
                node_name=config.node_name,
                host_ip=config.host_ip,
                configmaps=configmaps,
                secrets=secrets,
                provided=provided,
            )
            defined = resolve_env(pod, c.spec, ctx)
            argv = resolve_command(c.spec, defined)
            # Volumes cannot sit at their mountPath here: name their host directories instead.
            mounts = mount_table(pod, c.spec, self.volumes)
            defined = {k: v if provided.get(k) == v else relocate(v, mounts) for k, v in defined.items()}
            written = [*(c.spec.get("command") or []), *(c.spec.get("args") or [])]
            argv = relocate_argv(
                config.images.resolve(c.spec, argv, defined), expand(str(written[0]), defined), mounts
            )
        except (ContainerConfigError, ApiRequestError, OSError) as exc:
            if (
                isinstance(exc, ApiRequestError)
                and exc.status == 403
                and time.time() - (self.start_time or 0.0) < AUTHORIZER_GRACE_S
            ):
                # The Node authorizer learns of a pod's binding from its own watch,
                # a moment after we do: a refused read of the pod's secret is retried
                # quietly for a little while before it counts as an error.
                return time.time() + 0.5
            rec.state = ContainerState.WAITING
            rec.waiting_reason = "CreateContainerConfigError"
            rec.waiting_message = str(exc)
            c.restart_due = None
            self.kubelet.event(pod, "Failed", f"Error: {exc}", warning=True)
            return time.time() + CONFIG_RETRY_S
        workdir = c.spec.get("workingDir")
        cwd = Path(workdir) if workdir else config.workdir
        log_path = self.pod_dir / c.name / f"{rec.restart_count}.log"
        message_path = message_file(self.pod_dir / c.name, rec.restart_count)
        # The container's terminationMessagePath, mapped to a file of its own on this host.
        # Not this process's kubeconfig, nor ~/.kube/config (the clients' fallback): a
        # pod without service-account credentials gets an empty one unless it sets its own.
        no_credentials = {
            "KUBECONFIG": str(write_empty_kubeconfig(self.pod_dir / "no-credentials.kubeconfig"))
        }
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
            self.kubelet.event(pod, "Failed", f"Error: {message}", warning=True)
            self._exited(pod, c, Terminated(128, "StartError", now, now, message=message))
            return c.restart_due  # when the restart policy tries again (None: never)
        c.process = process
        c.env = env
        c.cwd = str(cwd)
        rec.state = ContainerState.RUNNING
        rec.started_at = process.started_at
        rec.container_id = f"kelastic://{process.pid}"
        rec.waiting_message = ""
        self.kubelet.event(pod, "Started", f"Started container {c.name}")
        c.exit_task = asyncio.get_running_loop().create_task(self._watch_exit(c, process))
        self._start_probes(pod, c)
        return None

    def _device_env(self, c: _Container) -> dict[str, str]:
        """The container's GPUs as the device plugin names them (nothing on a node without GPUs)."""
        ledger = self.kubelet.gpus
        if not ledger.devices:
            return {}
        return device_env((ledger.held(self.uid) or {}).get(c.name))

    async def _watch_exit(self, c: _Container, process: ContainerProcess) -> None:
        status: ExitStatus = await process.wait()
        c.cancel_probes()
        pod = self.pod
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
            self._exited(pod, c, term)
        else:
            c.record.state = ContainerState.TERMINATED
            c.record.terminated = term
        self.wake.set()

    def _exited(self, pod: Mapping[str, Any], c: _Container, term: Terminated) -> None:
        rec = c.record
        rec.state = ContainerState.TERMINATED
        rec.terminated = term
        rec.ready = False
        if pod["metadata"].get("deletionTimestamp") or self.deadline_exceeded:
            return
        policy = self.restart_policy(pod)
        if not should_restart(policy, term.exit_code, init=c in self.init):
            return
        delay = self.backoff.delay_after_exit(
            c.name, term.finished_at - (term.started_at or term.finished_at)
        )
        c.restart_due = time.time() + delay
        if delay > 0:
            rec.last_terminated = term
            rec.terminated = None
            rec.state = ContainerState.WAITING
            rec.waiting_reason = "CrashLoopBackOff"
            rec.waiting_message = (
                f"back-off {delay:g}s restarting failed container={c.name} "
                f"pod={self.name}_{self.namespace}({self.uid})"
            )
            self.kubelet.event(pod, "BackOff", "Back-off restarting failed container", warning=True)

    # -- probes -------------------------------------------------------------
    def _start_probes(self, pod: Mapping[str, Any], c: _Container) -> None:
        spec = c.spec
        try:
            startup = ProbeSpec.parse(spec.get("startupProbe"))
            readiness = ProbeSpec.parse(spec.get("readinessProbe"))
            liveness = ProbeSpec.parse(spec.get("livenessProbe"))
        except ValueError as exc:
            self.kubelet.event(pod, "Unhealthy", str(exc), warning=True)
            startup = readiness = liveness = None
        c.startup = ProbeTracker(startup, initial=False) if startup else None
        c.readiness = ProbeTracker(readiness, initial=False) if readiness else None
        c.liveness = ProbeTracker(liveness, initial=True) if liveness else None
        loop = asyncio.get_running_loop()
        for tracker, kind in ((c.startup, "Startup"), (c.readiness, "Readiness"), (c.liveness, "Liveness")):
            if tracker is not None:
                c.probe_tasks.append(loop.create_task(self._probe_loop(c, tracker, kind)))

    async def _probe_loop(self, c: _Container, tracker: ProbeTracker, kind: str) -> None:
        spec = tracker.spec
        await asyncio.sleep(spec.initial_delay)
        while c.running:
            if kind != "Startup" and c.startup is not None and not c.startup.ok:
                await asyncio.sleep(min(spec.period, 0.5))
                continue
            result, output = await probe_once(
                spec,
                pod_ip=self.pod_ip or "",
                env=c.env,
                cwd=c.cwd,
                container_ports=c.spec.get("ports") or [],
            )
            pod = self.pod
            if result is ProbeResult.FAILURE and pod is not None:  # the real kubelet's words
                self.kubelet.event(pod, "Unhealthy", f"{kind} probe failed: {output}", warning=True)
            changed = tracker.record(result)
            if kind == "Startup" and tracker.ok:
                self.wake.set()
                return  # a startup probe stops once it succeeded
            if not tracker.ok and kind in ("Liveness", "Startup") and c.process is not None:
                if pod is not None:
                    self.kubelet.event(
                        pod, "Killing", f"Container {c.name} failed {kind.lower()} probe, will be restarted"
                    )
                await c.process.stop(self._grace(pod))
                return
            if changed:
                self.wake.set()
            await asyncio.sleep(spec.period)

    def _refresh_ready(self, c: _Container) -> None:
        rec = c.record
        started = c.running and (c.startup is None or c.startup.ok)
        rec.started = bool(started)
        if c.record.init:
            rec.ready = rec.state is ContainerState.TERMINATED and bool(
                rec.terminated and rec.terminated.exit_code == 0
            )
            return
        rec.ready = bool(started and (c.readiness is None or c.readiness.ok))

    # -- status -------------------------------------------------------------
    async def _write_status(self, pod: Mapping[str, Any]) -> bool:
        """Write the pod's status if it changed; False when the write failed (retry later)."""
        if self.kubelet.stopping:
            # The node is going away, not the pod: leave the last status, so a
            # kubelet started on the same state restarts the containers.
            return True
        previous = (self.last_status or {}).get("conditions") or []
        facts = PodFacts(
            restart_policy=self.restart_policy(pod),
            pod_ip=self.pod_ip,
            host_ip=self.kubelet.config.host_ip,
            start_time=self.start_time,
            previous_conditions=previous,
            reason=self.facts_reason,
            message=self.facts_message,
            failed=self.deadline_exceeded,
        )
        status = pod_status(
            facts, [c.record for c in self.init], [c.record for c in self.containers], time.time()
        )
        if status == self.last_status:
            return True
        body: dict[str, Any] = {"status": dict(status)}
        for optional in ("reason", "message", "podIP", "podIPs", "nominatedNodeName"):
            body["status"].setdefault(optional, None)
        try:
            # Strategic: the conditions are merged by type, so one another component set (the
            # scheduler's or the eviction's DisruptionTarget) stays, as with a real kubelet.
            await self.kubelet.client.strategic_patch(self.path + "/status", body)
        except ApiRequestError as exc:
            if exc.status == 404:
                return True  # the pod is gone: nothing to report to
            log.warning("could not write status of pod %s: %s", self.key, exc)
            return False
        except Exception as exc:  # e.g. the API server is restarting
            log.debug("could not write status of pod %s: %s", self.key, exc)
            return False
        self.last_status = status
        return True

    # -- stopping -----------------------------------------------------------
    def _grace(self, pod: Mapping[str, Any] | None) -> float:
        if pod is None:
            return 0.0
        meta = pod.get("metadata") or {}
        if meta.get("deletionGracePeriodSeconds") is not None:
            return float(meta["deletionGracePeriodSeconds"])
        value = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        return 30.0 if value is None else float(value)

    async def _kill_all(self, grace: float) -> None:
        procs = [c for c in self.all_containers() if c.process is not None and not c.process.exited]
        for c in self.all_containers():
            c.cancel_probes()
        if procs:
            await asyncio.gather(*(c.process.stop(grace) for c in procs if c.process is not None))
        for c in self.all_containers():
            if c.exit_task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(c.exit_task, 5.0)

    async def _terminate(self, pod: dict[str, Any]) -> None:
        """Graceful deletion: stop every container within the grace period, then remove the pod."""
        grace = self._grace(pod)
        running = [c for c in self.all_containers() if c.running]
        for c in running:
            self.kubelet.event(pod, "Killing", f"Stopping container {c.name}")
        # Containers that were waiting to restart stay stopped.
        for c in self.all_containers():
            c.restart_due = None
        stopping = asyncio.ensure_future(self._kill_all(grace))
        # Force deletion while waiting for the grace period kills at once.
        while not stopping.done():
            self.wake.clear()
            if self.pod is None:
                for c in self.all_containers():
                    if c.process is not None:
                        c.process.kill_group(signal.SIGKILL)
            waiter = asyncio.ensure_future(self.wake.wait())
            await asyncio.wait({stopping, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        await stopping
        current = self.pod or pod
        await self._write_status(current)
        try:
            await self.kubelet.client.delete(
                self.path,
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiRequestError as exc:
            if exc.status not in (404, 409):
                log.warning("could not remove pod %s after stopping it: %s", self.key, exc)


class Kubelet:
    """Runs the pods bound to one node; create, ``await start()``, ``await stop()`` in one loop."""

    def __init__(self, client: ApiClient, config: KubeletConfig) -> None:
        self.client = client
        self.config = config
        self.ipam = IpAllocator(config.pod_network)
        #: The node's GPUs and which pod holds which (see :mod:`~.gpus`).
        self.gpus = GpuLedger(detect_gpus(config.gpus))
        #: Pod workers waiting for GPUs, woken when some are released.
        self.gpu_waiters: set[PodWorker] = set()
        self.pods: dict[str, dict[str, Any]] = {}
        self.workers: dict[str, PodWorker] = {}
        # With a scheduler, only this node's pods concern us (and the Node authorizer
        # lets a node see them); without one, unscheduled pods are ours to bind.
        params = {} if config.bind_pods else {"fieldSelector": f"spec.nodeName={config.node_name}"}
        self._informer = Informer(client, "/api/v1/pods", self._on_pod, params)
        self._heartbeat: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        #: Events posted per pod UID: (reason, message, warning) → (event name, count).
        self._events: dict[str, dict[tuple[str, str, bool], tuple[str, int]]] = {}
        self._node_uid = ""
        self._ready_since = ""
        self.stopping = False

    async def start(self, timeout: float = 30.0) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        await self.register_node()
        self._heartbeat = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name="node heartbeat"
        )
        self._informer.start()
        try:
            await asyncio.wait_for(self._informer.synced.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the kubelet could not list pods from {self.client.base_url} within {timeout}s"
            ) from None

    async def stop(self) -> None:
        """Stop watching and kill every pod process (SIGTERM, a short grace, SIGKILL)."""
        self.stopping = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        await self._informer.stop()
        workers = list(self.workers.values())
        await asyncio.gather(
            *(w._kill_all(self.config.shutdown_grace) for w in workers), return_exceptions=True
        )
        for w in workers:
            if w.task is not None:
                w.task.cancel()
        await asyncio.gather(*(w.task for w in workers if w.task is not None), return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _on_pod(self, etype: str, key: str, pod: dict[str, Any]) -> None:
        if etype == "DELETED":
            current = self.pods.get(key)
            if current is not None and current["metadata"].get("uid") == pod["metadata"].get("uid"):
                del self.pods[key]
        else:
            self.pods[key] = pod
        uid = pod["metadata"].get("uid", "")
        worker = self.workers.get(uid)
        if worker is not None:
            worker.wake.set()
            return
        if etype == "DELETED" or self.stopping:
            return
        node = pod["spec"].get("nodeName")
        if node != self.config.node_name and (node or not self.config.bind_pods):
            return  # another node's, or waiting for the scheduler
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and not pod["metadata"].get(
            "deletionTimestamp"
        ):
            return  # finished before this kubelet started: nothing to run
        worker = PodWorker(self, uid, key)
        self.workers[uid] = worker
        worker.task = asyncio.get_running_loop().create_task(worker.run(), name=f"pod {key}")

    def release_gpus(self, uid: str) -> None:
        """Free a pod's GPUs (call only once its processes are gone) and wake the pods waiting."""
        if self.gpus.release(uid):
            for waiter in list(self.gpu_waiters):
                waiter.wake.set()

    # -- API helpers ----------------------------------------------------------
    async def bind(self, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": ns, "uid": meta.get("uid")},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.config.node_name},
        }
        try:
            await self.client.post(f"/api/v1/namespaces/{ns}/pods/{name}/binding", binding)
        except ApiRequestError as exc:
            if exc.status == 409:
                return  # already bound
            # Servers without the binding subresource: set the field directly.
            await self.client.merge_patch(
                f"/api/v1/namespaces/{ns}/pods/{name}", {"spec": {"nodeName": self.config.node_name}}
            )
        self.pods.setdefault(f"{ns}/{name}", dict(pod))["spec"]["nodeName"] = self.config.node_name

    async def fetch_sources(
        self, namespace: str, pod: Mapping[str, Any], container: Mapping[str, Any]
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """The configmaps and secrets the container or the pod's volumes refer to, by name."""
        wanted: dict[str, set[str]] = {"configmaps": set(), "secrets": set()}
        for source in container.get("envFrom") or []:
            if source.get("configMapRef"):
                wanted["configmaps"].add(source["configMapRef"].get("name", ""))
            if source.get("secretRef"):
                wanted["secrets"].add(source["secretRef"].get("name", ""))
        for var in container.get("env") or []:
            ref = var.get("valueFrom") or {}
            if ref.get("configMapKeyRef"):
                wanted["configmaps"].add(ref["configMapKeyRef"].get("name", ""))
            if ref.get("secretKeyRef"):
                wanted["secrets"].add(ref["secretKeyRef"].get("name", ""))
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            if vol.get("configMap"):
                wanted["configmaps"].add(vol["configMap"].get("name", ""))
            if vol.get("secret"):
                wanted["secrets"].add(vol["secret"].get("secretName", ""))
            for source in (vol.get("projected") or {}).get("sources") or []:
                if source.get("configMap"):
                    wanted["configmaps"].add(source["configMap"].get("name", ""))
                if source.get("secret"):
                    wanted["secrets"].add(source["secret"].get("name", ""))
        found: dict[str, dict[str, dict[str, str]]] = {"configmaps": {}, "secrets": {}}
        for resource, names in wanted.items():
            for name in names:
                try:
                    obj = await self.client.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
                except ApiRequestError as exc:
                    if exc.status == 404:
                        continue
                    raise
                found[resource][name] = dict(obj.get("data") or {})
        return found["configmaps"], found["secrets"]

    async def fetch_tokens(self, pod: Mapping[str, Any]) -> dict[str, IssuedToken]:
        """Tokens for the pod's projected ``serviceAccountToken`` sources, by :func:`token_key`."""
        tokens: dict[str, IssuedToken] = {}
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            for source in (vol.get("projected") or {}).get("sources") or []:
                request = source.get("serviceAccountToken")
                if request is not None:
                    issued = await self.request_token(pod, str(vol.get("name", "")), request)
                    tokens[token_key(issued.volume, issued.path)] = issued
        return tokens

    async def request_token(
        self, pod: Mapping[str, Any], volume: str, request: Mapping[str, Any]
    ) -> IssuedToken:
        """A token for one ``serviceAccountToken`` source of ``pod``'s ``volume``.

        Requested through the ServiceAccount's ``token`` subresource (TokenRequest),
        bound to the pod like a real kubelet's, so they die with it.
        """
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace", "default")
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        seconds = int(request.get("expirationSeconds") or DEFAULT_EXPIRATION_S)
        body: dict[str, Any] = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [request["audience"]] if request.get("audience") else [],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta.get("name"),
                    "uid": meta.get("uid"),
                },
            },
        }
        answer = await self.client.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", body
        )
        return issued_token(volume, str(request.get("path", "token")), answer, seconds, time.time())

    def in_cluster_env(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path], pod_dir: Path
    ) -> dict[str, str]:
        """What in-cluster clients of this container need to reach the API server.

        ``KUBERNETES_SERVICE_HOST``/``PORT`` name the API server's loopback address
        (the ``kubernetes`` Service's ClusterIP is not routed here). A container that
        mounts service-account credentials also gets ``KUBECONFIG``: the mount path
        cannot be honoured on a shared filesystem, so the token is handed over as a
        kubeconfig, which kopf and the official client fall back to.
        """
        if not self.config.api_url:
            return {}
        host_port = self.config.api_url.split("://", 1)[-1]
        host, _, port = host_port.rpartition(":")
        env = {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host_port}",
        }
        for mount in container.get("volumeMounts") or []:
            if (
                mount.get("mountPath", "").rstrip("/") != SERVICE_ACCOUNT_DIR
                or mount.get("name") not in volumes
            ):
                continue
            source = volumes[mount["name"]]
            token_file, ca_file = source / "token", source / "ca.crt"
            if not token_file.is_file():
                break
            kubeconfig = pod_dir / SERVICE_ACCOUNT_KUBECONFIG
            write_token_kubeconfig(
                kubeconfig,
                self.config.api_url,
                token_file.read_text().strip(),
                ca_file if ca_file.is_file() else None,
                str((pod.get("metadata") or {}).get("namespace", "default")),
            )
            env["KUBECONFIG"] = str(kubeconfig)
            break
        return env

    async def _heartbeat_loop(self) -> None:
        """Renew the node Lease and the Ready condition's heartbeat, so the node stays Ready."""
        lease_served = True
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if lease_served:
                try:
                    await self.renew_lease()
                except ApiRequestError as exc:
                    lease_served = exc.status != 404  # an API server without node Leases
                    if lease_served:
                        log.warning("could not renew the node lease of %s: %s", self.config.node_name, exc)
                except Exception as exc:
                    log.debug("could not renew the node lease: %s", exc)
            try:
                await self.client.request(
                    "PATCH",
                    f"/api/v1/nodes/{self.config.node_name}/status",
                    body={"status": {"conditions": [self._ready_condition()]}},
                    content_type="application/strategic-merge-patch+json",
                )
            except ApiRequestError as exc:
                if exc.status == 415:  # no strategic merge: the whole condition list then
                    with contextlib.suppress(Exception):
                        await self.client.merge_patch(
                            f"/api/v1/nodes/{self.config.node_name}/status",
                            {"status": {"conditions": [self._ready_condition()]}},
                        )
                elif exc.status == 404:
                    await self.register_node()  # deleted under us: register again
                else:
                    log.warning("could not post the node status of %s: %s", self.config.node_name, exc)
            except Exception as exc:
                log.debug("could not post the node status: %s", exc)

    async def renew_lease(self) -> None:
        """Create or renew ``kube-node-lease/<node>`` (coordination.k8s.io/v1)."""
        name = self.config.node_name
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        renew = micro_time(time.time())
        try:
            await self.client.merge_patch(path, {"spec": {"holderIdentity": name, "renewTime": renew}})
        except ApiRequestError as exc:
            if exc.status != 404:
                raise
            await self.client.post(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [
                            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self._node_uid}
                        ]
                        if self._node_uid
                        else [],
                    },
                    "spec": {
                        "holderIdentity": name,
                        "leaseDurationSeconds": LEASE_DURATION_S,
                        "renewTime": renew,
                    },
                },
            )

    def _ready_condition(self) -> dict[str, str]:
        now = rfc3339(time.time())
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kelastic local kubelet is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": self._ready_since or now,
        }

    async def register_node(self) -> None:
        """Create (or refresh) this node's Node object and Lease; servers without nodes are tolerated."""
        now = rfc3339(time.time())
        self._ready_since = self._ready_since or now
        cpus = self.config.cpus or str(os.cpu_count() or 1)
        try:
            memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 1024}Ki"
        except (ValueError, OSError):
            memory = "0"
        capacity = {"cpu": cpus, "memory": memory, "pods": "1000"}
        if self.gpus.devices:  # as a device plugin registers them: only where there are some
            capacity[GPU_RESOURCE] = str(len(self.gpus.devices))
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.config.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.config.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": platform.machine(),
                },
            },
            "spec": {},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [
                    {"type": "InternalIP", "address": self.config.host_ip},
                    {"type": "Hostname", "address": self.config.node_name},
                ],
                "conditions": [self._ready_condition()],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.config.kubelet_port}},
                "nodeInfo": {
                    "kubeletVersion": self.config.version,
                    "containerRuntimeVersion": "kelastic-process://1",
                    "operatingSystem": "linux",
                    "architecture": platform.machine(),
                    "osImage": platform.platform(),
                    "kernelVersion": platform.release(),
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kubeProxyVersion": "",
                },
            },
        }
        try:
            created = await self.client.post("/api/v1/nodes", node)
            self._node_uid = str(created.get("metadata", {}).get("uid", ""))
        except ApiRequestError as exc:
            if exc.status == 409:
                with contextlib.suppress(ApiRequestError):
                    current = await self.client.merge_patch(
                        f"/api/v1/nodes/{self.config.node_name}/status", {"status": node["status"]}
                    )
                    self._node_uid = str(current.get("metadata", {}).get("uid", ""))
            elif exc.status in (401, 403):
                raise RuntimeError(
                    f"the API server refused to register node {self.config.node_name}: {exc}"
                ) from exc
            else:
                log.debug("node registration not supported by the API server: %s", exc)
        with contextlib.suppress(ApiRequestError):
            await self.renew_lease()

    def event(
        self,
        pod: Mapping[str, Any],
        reason: str,
        message: str,
        warning: bool = False,
        component: str = "kubelet",
    ) -> None:
        """Post a core/v1 Event about ``pod`` in the background (best effort), from ``component``
        (the kubelet, or the scheduler whose part it plays without one).

        A repeat of the same reason and message for the same pod bumps the first
        Event's ``count`` and ``lastTimestamp`` instead of adding another, as the
        kubelet's event recorder does (a crash loop shows as one line, xN).
        """
        meta = pod.get("metadata") or {}
        ns = meta.get("namespace", "default")
        uid = str(meta.get("uid", ""))
        now = rfc3339(time.time())
        key = (reason, message, warning)
        seen = self._events.setdefault(uid, {})
        collection = f"/api/v1/namespaces/{ns}/events"
        if key in seen:
            name, count = seen[key]
            seen[key] = (name, count + 1)
            request = self.client.merge_patch(
                f"{collection}/{name}", {"count": count + 1, "lastTimestamp": now}
            )
        else:
            name = f"{meta.get('name')}.{uuid.uuid4().hex[:16]}"
            seen[key] = (name, 1)
            request = self.client.post(
                collection,
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": name, "namespace": ns},
                    "involvedObject": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta.get("name"),
                        "namespace": ns,
                        "uid": uid,
                    },
                    "reason": reason,
                    "message": message,
                    "type": "Warning" if warning else "Normal",
                    "source": {"component": component, "host": self.config.node_name}
                    if component == "kubelet"
                    else {"component": component},
                    "reportingComponent": component,
                    "reportingInstance": self.config.node_name,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "count": 1,
                },
            )

        async def send() -> None:
            with contextlib.suppress(Exception):
                await request

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget_events(self, uid: str) -> None:
        self._events.pop(uid, None)

    def locate_logs(
        self, namespace: str, name: str, container: str
    ) -> tuple[Path, Callable[[int], bool]] | None:
        """Where a container's logs are, and whether its run number N still writes (for the log server)."""
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is not None:
            uid = str(pod["metadata"].get("uid", ""))
            folder = pod_log_dir(self.config.data_dir, namespace, name, uid) / container
        else:  # deleted: its logs are kept a while
            candidates = sorted(
                (self.config.data_dir / "pods").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime
            )
            if not candidates:
                return None
            folder, uid = candidates[-1] / container, ""

        def running(index: int) -> bool:
            worker = self.workers.get(uid)
            if worker is None:
                return False
            return any(
                c.name == container and c.running and c.record.restart_count == index
                for c in worker.all_containers()
            )

        return folder, running


def micro_time(t: float) -> str:
    """A ``MicroTime`` (RFC 3339 with microseconds), as Lease ``renewTime`` requires."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def write_empty_kubeconfig(path: Path) -> Path:
    """A kubeconfig with no cluster and no user (clients that read it fail saying so)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        empty = {"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [], "users": []}
        path.write_text(json.dumps(empty) + "\n")
    return path


def write_token_kubeconfig(path: Path, server: str, token: str, ca_file: Path | None, namespace: str) -> None:
    """A kubeconfig that authenticates with ``token`` (mode 0600)."""
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": cluster}],
        "users": [{"name": "service-account", "user": {"token": token}}],
        "contexts": [
            {
                "name": "in-cluster",
                "context": {"cluster": "in-cluster", "user": "service-account", "namespace": namespace},
            }
        ],
        "current-context": "in-cluster",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(config, indent=1))


def rewrite_token_kubeconfig(path: Path, old: str, new: str) -> None:
    """Put token ``new`` in place of ``old`` in a kubeconfig of :func:`write_token_kubeconfig`."""
    config = json.loads(path.read_text())
    for user in config.get("users") or []:
        if (user.get("user") or {}).get("token") == old:
            user["user"]["token"] = new
    write_atomically(path, json.dumps(config, indent=1))

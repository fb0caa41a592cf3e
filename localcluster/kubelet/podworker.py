"""One pod's lifecycle on the node, from binding to deletion: :class:`PodWorker`.

The worker holds the pod's GPUs (waiting, Pending, while too few are free; without a
scheduler it also preempts or reports the pod unschedulable as one would), binds it,
gives it an address, carries over what a previous kubelet reported, starts its init
containers one after another and then its containers (each run is :mod:`.containers`'),
enforces ``activeDeadlineSeconds``, refreshes its service-account tokens, writes its
status, and on deletion stops its containers within the grace period and removes it.
It is level-based: every event of the pod only wakes it, and it compares what runs with
what the latest pod object asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..common.client import ApiRequestError
from ..common.ipam import IpExhaustedError
from ..common.podlogs import pod_log_dir
from . import containers
from .containers import CONFIG_RETRY_S, Container
from .gpus import GPU_RESOURCE, pod_claim
from .kubeconfigs import SERVICE_ACCOUNT_KUBECONFIG, rewrite_token_kubeconfig
from .nodeview import KubeletView
from .podstatus import (
    ContainerState,
    CrashBackoff,
    PodFacts,
    PodPhase,
    parse_rfc3339,
    pod_phase,
    pod_status,
    rfc3339,
)
from .preemption import choose_victims, holders, preempt
from .satokens import IssuedToken, refresh_due, write_atomically
from .volumes import token_key

__all__ = ["PodWorker"]

log = logging.getLogger(__name__)

#: How soon a status write that failed is tried again (a status must never stay stale).
STATUS_RETRY_S = 1.0
#: Seconds before a refused token refresh is tried again (the old token is still valid).
TOKEN_RETRY_S = 10.0


class PodWorker:
    """Owns one pod (by UID) from binding to deletion; see the module docstring."""

    def __init__(self, kubelet: KubeletView, uid: str, key: str) -> None:
        self.kubelet = kubelet
        self.uid = uid
        self.key = key
        self.namespace, self.name = key.split("/", 1)
        self.wake = asyncio.Event()
        self.init: list[Container] = []
        self.containers: list[Container] = []
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

    def all_containers(self) -> list[Container]:
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
        self.init = [Container(c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [Container(c, init=False) for c in spec.get("containers") or []]
        previous = {
            s.get("name"): s
            for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
        }
        policy = self.restart_policy(pod)
        for c in self.all_containers():
            prev = previous.get(c.name)
            if prev:
                c.restore(prev, policy)
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
            c.refresh_ready()
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
        self._deadline_kill = asyncio.get_running_loop().create_task(self._kill_all(self.grace(pod)))

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
        self, pod: dict[str, Any], c: Container, policy: str, now: float, due: list[float]
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
        retry = await containers.start(self, pod, c)
        if retry is not None:
            due.append(retry)

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
    def grace(self, pod: Mapping[str, Any] | None) -> float:
        """The seconds the pod's containers get between SIGTERM and SIGKILL."""
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
        grace = self.grace(pod)
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

"""Leader election on a ``coordination.k8s.io/v1`` Lease, so several operator replicas are safe.

Only the holder of the Lease reconciles; the others keep their caches warm and
take over when the holder stops renewing, or at once when it releases the Lease
on a clean shutdown (SIGTERM). Writes use optimistic concurrency (the Lease's
resourceVersion), so two candidates can never both win the same term.

The numbers (defaults; see :class:`LeaderElector`):

- the holder renews every ``renew_every`` = 1.5 s;
- it trusts its leadership only until ``lease_seconds - safety_margin`` = 4 s
  after the start of its last successful renewal, so it stops acting 2 s before
  any candidate may take over (room for a write in flight and clock skew);
- a candidate retries every ``retry_every`` = 1 s and takes a Lease whose
  ``renewTime`` is more than ``lease_seconds`` = 6 s old.

So a standby replica takes over at most about 7 s after the holder died
(SIGKILL, node lost), and within about 1 s after a clean shutdown. Nothing in a
job depends on the operator being up meanwhile: its pods, the rendezvous store
and training carry on; only repairs and scaling wait for the new leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from kelastic.operator.clock import SYSTEM, Clock
from kelastic.operator.kube import ApiError, Kube
from kelastic.operator.spec import parse_time

__all__ = ["LeaderElector"]

log = logging.getLogger(__name__)


def _micro_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: int = 6,
        renew_every: float = 1.5,
        retry_every: float = 1.0,
        safety_margin: float = 2.0,
        release_timeout: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        if not 0 < safety_margin < lease_seconds or renew_every >= lease_seconds - safety_margin:
            raise ValueError(
                f"lease of {lease_seconds}s: the safety margin ({safety_margin}s) must be shorter than the lease, "
                f"and renewals (every {renew_every}s) more frequent than the lease minus the margin"
            )
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_every = renew_every
        self.retry_every = retry_every
        self.safety_margin = safety_margin
        self.release_timeout = release_timeout  # how long stop() tries to release the Lease
        self.on_change = on_change
        self._leader = False
        # Monotonic: leadership is trusted until then (the margin before the Lease can expire).
        self._valid_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._clock = clock

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    @property
    def is_leader(self) -> bool:
        return self._leader and self._clock.monotonic() < self._valid_until

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kelastic-leader-election")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._leader:
            try:
                # Bounded: an API server that does not answer must not hold up the shutdown.
                await asyncio.wait_for(asyncio.to_thread(self._release), self.release_timeout)
            except asyncio.TimeoutError:
                log.warning(
                    "could not release lease %s/%s: no answer within %g s; it expires by itself in %d s",
                    self.namespace,
                    self.name,
                    self.release_timeout,
                    self.lease_seconds,
                )
            except Exception as exc:  # best effort: the lease expires anyway
                log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)
        self._set(False)

    async def _run(self) -> None:
        while True:
            try:
                won = await asyncio.to_thread(self.try_acquire)
            except Exception as exc:  # API unreachable: keep leadership only while the lease is surely ours
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                won = self.is_leader
            self._set(won)
            await self._clock.sleep(self.renew_every if won else self.retry_every)

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            log.info(
                "%s leadership of lease %s/%s", "acquired" if leader else "lost", self.namespace, self.name
            )
            if self.on_change is not None:
                self.on_change(leader)

    def try_acquire(self) -> bool:
        """One election step (blocking): create, renew or take over the Lease. True if we hold it."""
        started = self._clock.monotonic()
        now = self._clock.now()
        try:
            lease = self.kube.request("GET", self.path)
        except ApiError as err:
            if err.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(now, acquired=True, transitions=0),
            }
            try:
                self.kube.request("POST", self.path.rsplit("/", 1)[0], body)
            except ApiError as err2:
                if err2.status == 409:
                    return False
                raise
            self._valid_until = started + self.lease_seconds - self.safety_margin
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
        duration = int(spec.get("leaseDurationSeconds") or self.lease_seconds)
        expired = renewed is None or (now - renewed).total_seconds() > duration
        if holder != self.identity and holder and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        lease["spec"] = {**spec, **self._spec(now, acquired=holder != self.identity, transitions=transitions)}
        if holder == self.identity:
            lease["spec"]["acquireTime"] = spec.get("acquireTime") or lease["spec"].get("acquireTime")
        try:
            self.kube.request("PUT", self.path, lease)
        except ApiError as err:
            if err.status == 409:  # someone else wrote first
                return False
            raise
        self._valid_until = started + self.lease_seconds - self.safety_margin
        return True

    def _spec(self, now: datetime, *, acquired: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = _micro_time(now)
        return spec

    def _release(self) -> None:
        lease = self.kube.request("GET", self.path)
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return
        lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1}
        self.kube.request("PUT", self.path, lease)

"""A local volume provisioner: every PersistentVolumeClaim becomes a directory of the node.

The kubelet gives a pod's ``persistentVolumeClaim`` volume the claim's directory,
``<data_dir>/claims/<namespace>/<claimName>``, shared by every pod that names the
claim (see :mod:`kelastic.localcluster.kubelet.volumes`). This controller makes the API
agree, so that a claim does not stay ``Pending`` and keep its pods from being
scheduled:

- against a real control plane it creates, for each unbound claim, a
  PersistentVolume ``kelastic-<claim uid>`` (``hostPath`` of that directory,
  the claim's access modes, its requested size, ``claimRef`` to the claim,
  reclaim policy Retain); the controller-manager's binder then binds the two as
  for any pre-bound volume;
- against the emulator (which serves no PersistentVolumes) it marks the claim
  ``Bound`` in its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..common.client import ApiClient, ApiRequestError, Informer

__all__ = ["ClaimProvisioner", "volume_for"]

log = logging.getLogger(__name__)

CLAIMS = "/api/v1/persistentvolumeclaims"


def volume_for(claim: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The PersistentVolume that serves ``claim`` from ``directory`` (pre-bound to it)."""
    meta = claim.get("metadata") or {}
    spec = claim.get("spec") or {}
    size = ((spec.get("resources") or {}).get("requests") or {}).get("storage") or "1Gi"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"kelastic-{meta.get('uid')}", "labels": {"kelastic.dev/local-claim": "true"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": spec.get("storageClassName") or "",
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta.get("namespace"),
                "name": meta.get("name"),
                "uid": meta.get("uid"),
            },
        },
    }


class ClaimProvisioner:
    """Binds the cluster's claims to node directories; create, ``await start()``, ``await stop()``."""

    def __init__(self, client: ApiClient, claims_dir: Path, *, real: bool) -> None:
        self.client = client
        self.claims_dir = claims_dir
        self.real = real
        self._informer = Informer(client, CLAIMS, self._on_claim)
        self._tasks: set[asyncio.Task[None]] = set()
        self._done: set[str] = set()

    async def start(self, timeout: float = 30.0) -> None:
        self._informer.start()
        try:
            await asyncio.wait_for(self._informer.synced.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"could not list PersistentVolumeClaims within {timeout}s") from None

    async def stop(self) -> None:
        await self._informer.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_claim(self, etype: str, key: str, claim: dict[str, Any]) -> None:
        uid = str((claim.get("metadata") or {}).get("uid", ""))
        bound = (claim.get("status") or {}).get("phase") == "Bound" or (claim.get("spec") or {}).get(
            "volumeName"
        )
        if etype == "DELETED" or bound or uid in self._done:
            return
        self._done.add(uid)
        task = asyncio.get_running_loop().create_task(self._bind(claim))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bind(self, claim: Mapping[str, Any]) -> None:
        meta = claim.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "default")), str(meta.get("name", ""))
        directory = self.claims_dir / namespace / name
        directory.mkdir(parents=True, exist_ok=True)
        spec = claim.get("spec") or {}
        try:
            if self.real:
                with contextlib.suppress(ApiRequestError):  # 409: made by an earlier run of this node
                    await self.client.post("/api/v1/persistentvolumes", volume_for(claim, directory))
            else:
                size = ((spec.get("resources") or {}).get("requests") or {}).get("storage") or "1Gi"
                status = {
                    "phase": "Bound",
                    "accessModes": spec.get("accessModes") or [],
                    "capacity": {"storage": size},
                }
                await self.client.merge_patch(
                    f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}/status", {"status": status}
                )
        except ApiRequestError as exc:
            self._done.discard(str(meta.get("uid", "")))
            log.warning("could not bind PersistentVolumeClaim %s/%s: %s", namespace, name, exc)

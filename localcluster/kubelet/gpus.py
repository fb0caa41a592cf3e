"""The node's GPUs as an extended resource, ``nvidia.com/gpu``, handed out as a device plugin does.

The process kubelet finds the node's GPUs (:func:`detect_gpus`), reports them as the
Node's ``nvidia.com/gpu`` capacity and allocatable, and gives every container that
requests some its own devices: ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES``
name them (:func:`device_env`), as the NVIDIA device plugin does. A device belongs to
one pod at a time (:class:`GpuLedger`), from admission until every container of the pod
has stopped for good, so that no two running containers ever share a device and a
device is free again only once the process that held its memory is gone.

Devices are named by their ordinal in PCI bus order (``nvidia-smi``'s order), and
containers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA numbers them the same way.
A pod's claim is what the scheduler counts for it: the largest of the sum over its
containers and each init container's own request; init containers run one at a time
before the others and use the first devices of the pod's claim.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_GPUS",
    "GPU_RESOURCE",
    "GpuClaim",
    "GpuLedger",
    "allot",
    "container_gpus",
    "detect_gpus",
    "device_env",
    "narrow_to_visible",
    "pod_claim",
]

#: The extended resource name the NVIDIA device plugin registers.
GPU_RESOURCE = "nvidia.com/gpu"
#: Overrides detection: the number of GPUs the node reports (``kelastic local up --gpus N``).
ENV_GPUS = "KELASTIC_LOCAL_GPUS"
#: Where the NVIDIA driver lists the GPUs it drives, one directory per PCI address.
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def detect_gpus(
    override: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    proc_dir: Path = PROC_GPUS,
    nvidia_smi: str = "nvidia-smi",
) -> tuple[str, ...]:
    """The node's GPU ordinals (``"0"``, ``"1"``, …). First answer wins: ``override``, then
    ``$KELASTIC_LOCAL_GPUS`` (both a count, 0 turns GPUs off), the driver's
    ``/proc/driver/nvidia/gpus``, ``nvidia-smi -L``. A detected list is narrowed to the
    ordinals that ``CUDA_VISIBLE_DEVICES`` names, when ``kelastic local`` was started with
    one (:func:`narrow_to_visible`). A bad ``$KELASTIC_LOCAL_GPUS`` raises ValueError.
    Neither source initialises CUDA."""
    environ = os.environ if environ is None else environ
    if override is None and environ.get(ENV_GPUS, "").strip():
        text = environ[ENV_GPUS].strip()
        if not text.isdigit():
            raise ValueError(f"{ENV_GPUS} must be a number of GPUs, got {text!r}")
        override = int(text)
    if override is not None:
        if override < 0:
            raise ValueError(f"the number of GPUs must be >= 0, got {override}")
        return tuple(str(i) for i in range(override))
    try:
        count = sum(1 for entry in proc_dir.iterdir() if entry.is_dir())
    except OSError:
        count = 0
    if count == 0:
        try:
            listed = subprocess.run(
                [nvidia_smi, "-L"], capture_output=True, text=True, timeout=30, check=False
            )
            if listed.returncode == 0:
                count = sum(1 for line in listed.stdout.splitlines() if re.match(r"GPU \d+:", line))
        except (OSError, subprocess.TimeoutExpired):
            count = 0
    return narrow_to_visible(count, environ.get("CUDA_VISIBLE_DEVICES"))


def narrow_to_visible(count: int, visible: str | None) -> tuple[str, ...]:
    """The ordinals of ``count`` GPUs that ``visible`` (a ``CUDA_VISIBLE_DEVICES`` value of
    ordinals) leaves, in its order; all of them when it is unset or names devices by UUID
    (pure). Entries are read as CUDA reads them: the list ends at the first one that is not
    an ordinal of this node, and a repeated one leaves none."""
    every = tuple(str(i) for i in range(count))
    if visible is None or visible.strip().startswith(("GPU-", "MIG-")):
        return every
    kept: list[str] = []
    for entry in visible.split(","):
        digits = re.match(r"\s*(\d+)", entry)
        if digits is None or int(digits.group(1)) >= count:
            break
        ordinal = str(int(digits.group(1)))
        if ordinal in kept:
            return ()
        kept.append(ordinal)
    return tuple(kept)


def container_gpus(container: Mapping[str, Any]) -> int:
    """The GPUs a container asks for: its ``nvidia.com/gpu`` limit (an extended resource's
    request must equal its limit), else its request; 0 when it names none or an unreadable
    quantity (the API server rejects those before a pod gets here)."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(GPU_RESOURCE)
        if value is not None:
            text = str(value).strip()
            return int(text) if text.isdigit() else 0
    return 0


@dataclass(frozen=True)
class GpuClaim:
    """What a pod asks for: GPUs per container, init containers apart."""

    containers: tuple[tuple[str, int], ...]
    init: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        """The devices the pod holds (what the scheduler counts for it)."""
        return max([sum(n for _, n in self.containers), *(n for _, n in self.init)])


def pod_claim(pod: Mapping[str, Any]) -> GpuClaim:
    """The pod's :class:`GpuClaim`, read from its spec."""
    spec = pod.get("spec") or {}

    def read(kind: str) -> tuple[tuple[str, int], ...]:
        return tuple((str(c.get("name", "")), container_gpus(c)) for c in spec.get(kind) or [])

    return GpuClaim(containers=read("containers"), init=read("initContainers"))


def allot(
    devices: Sequence[str], taken: Collection[str], claim: GpuClaim
) -> dict[str, tuple[str, ...]] | None:
    """Devices for each container of ``claim`` out of the free ones (``devices`` less
    ``taken``, in the node's order), or None when too few are free. Containers get
    disjoint devices; init containers the first ones of the pod's share. Containers that
    ask for none are left out (pure)."""
    free = [d for d in devices if d not in taken]
    if claim.total > len(free):
        return None
    share = free[: claim.total]
    allotted: dict[str, tuple[str, ...]] = {}
    start = 0
    for name, n in claim.containers:
        if n > 0:
            allotted[name] = tuple(share[start : start + n])
            start += n
    for name, n in claim.init:
        if n > 0:
            allotted[name] = tuple(share[:n])
    return allotted


def device_env(allotted: Sequence[str] | None) -> dict[str, str]:
    """The variables a container gets on a node with GPUs: its devices (none: it sees
    none, as a container without a GPU request on a device-plugin node)."""
    names = ",".join(allotted or ())
    return {
        "CUDA_VISIBLE_DEVICES": names,
        "NVIDIA_VISIBLE_DEVICES": names or "void",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


class GpuLedger:
    """Which pod holds which of the node's devices (not thread-safe: the kubelet's loop owns it)."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self._pods: dict[str, dict[str, tuple[str, ...]]] = {}

    def claim(self, uid: str, claim: GpuClaim) -> dict[str, tuple[str, ...]] | None:
        """The pod's devices by container (the same ones again for a pod that has them), or
        None when too few are free now."""
        held = self._pods.get(uid)
        if held is not None:
            return held
        allotted = allot(self.devices, self.taken(), claim)
        if allotted is not None:
            self._pods[uid] = allotted
        return allotted

    def held(self, uid: str) -> dict[str, tuple[str, ...]] | None:
        return self._pods.get(uid)

    def holders(self) -> list[str]:
        """The uids of the pods that hold devices."""
        return list(self._pods)

    def release(self, uid: str) -> bool:
        """Free the pod's devices; True when it held any."""
        return bool(self._pods.pop(uid, None))

    def taken(self) -> set[str]:
        return {d for allotted in self._pods.values() for ds in allotted.values() for d in ds}

    @property
    def free(self) -> int:
        return len(self.devices) - len(self.taken())

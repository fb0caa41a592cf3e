"""The node's GPUs, counted without initialising CUDA in the agent.

``kelastic-agent --warm-start`` forks its workers, without ``exec``, from a process
that is a fork of the agent itself (:mod:`kelastic.agent.warm`). CUDA does not survive
such a fork: once a process has initialised the CUDA driver (``cuInit``, which
``torch.cuda.is_available()`` does through ``cudaGetDeviceCount``), torch marks every
fork of it as a "bad fork" and any CUDA call there raises *Cannot re-initialize CUDA
in forked subprocess*. So the agent never asks the CUDA runtime anything. It counts
devices as follows, first answer wins:

1. a torch build without CUDA: 0 (no GPU is usable from it, whatever the node has);
2. CUDA already initialised in this process (not by kelastic): torch's own count;
3. NVML (``libnvidia-ml.so.1``, the driver's management library, which creates no
   CUDA context) for the physical count, narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA
   would narrow it (:func:`visible_count`);
4. otherwise a short-lived subprocess asks torch (it may initialise CUDA: it exits
   right after, and the agent never forks from it).

:func:`cuda_touched` tells whether the CUDA driver was loaded into this process anyway
(by a script run in-process, a plugin), so that the warm start falls back to a fresh
fork server instead of forking a poisoned one.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

__all__ = [
    "COUNT_TIMEOUT_S",
    "cuda_device_count",
    "cuda_touched",
    "maps_load_cuda_driver",
    "nvml_device_count",
    "visible_count",
]

#: How long the subprocess fallback of :func:`cuda_device_count` may take (it imports torch).
COUNT_TIMEOUT_S = 120.0

#: The file names of the CUDA driver library (``libcuda.so.1`` and its links); mapped into
#: a process once something there used the driver API.
_DRIVER_NAMES = ("libcuda.so", "libcuda.so.1")

_COUNT_SNIPPET = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def visible_count(visible: str | None, physical: int) -> int | None:
    """How many devices CUDA shows a process whose ``CUDA_VISIBLE_DEVICES`` is ``visible``
    on a node with ``physical`` GPUs; None when that cannot be told from the text alone
    (devices named by UUID, ``GPU-…`` or ``MIG-…``).

    The rules are CUDA's, as torch applies them before initialising CUDA: unset means
    every device; each entry is read like ``strtoul`` (``"1gpu"`` is 1); a negative or
    unparsable entry ends the list; a repeated ordinal hides every device; the list stops
    at the first ordinal the node does not have.
    """
    if visible is None:
        return max(physical, 0)
    if visible.startswith(("GPU-", "MIG-")):
        return None
    seen: list[int] = []
    for entry in visible.split(","):
        ordinal = _leading_int(entry.strip())
        if ordinal is None or ordinal < 0:
            break
        if ordinal in seen:
            return 0
        if ordinal >= physical:
            break
        seen.append(ordinal)
    return len(seen)


def _leading_int(text: str) -> int | None:
    """The integer ``text`` starts with (an optional sign, then digits), as ``strtoul`` reads it."""
    end = 0
    while end < len(text) and (text[end].isdigit() or (end == 0 and text[end] in "+-")):
        end += 1
    try:
        return int(text[:end])
    except ValueError:
        return None


def nvml_device_count() -> int | None:
    """The node's physical GPUs as NVML counts them, or None when NVML cannot tell (no
    driver library, no driver loaded). Creates no CUDA context and leaves forks usable."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    finally:
        nvml.nvmlShutdown()


def cuda_device_count() -> int:
    """The GPUs CUDA would give this process (``CUDA_VISIBLE_DEVICES`` applied), found
    without initialising CUDA here (see the module docstring for the order). 0 when CUDA
    is unusable. Raises RuntimeError when the subprocess fallback fails."""
    import torch

    if not hasattr(torch._C, "_cuda_getDeviceCount"):  # torch.cuda's own test of a CUDA build
        return 0
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return int(torch.cuda.device_count())
    physical = nvml_device_count()
    if physical is not None:
        counted = visible_count(os.environ.get("CUDA_VISIBLE_DEVICES"), physical)
        if counted is not None:
            return counted
    return _count_in_subprocess()


def _count_in_subprocess() -> int:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _COUNT_SNIPPET],
            capture_output=True,
            text=True,
            timeout=COUNT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not count the CUDA devices in a subprocess: {e}") from e
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(
            f"could not count the CUDA devices in a subprocess (exit {done.returncode}): {done.stderr[-500:]}"
        ) from None


def maps_load_cuda_driver(maps: str) -> bool:
    """Whether ``/proc/<pid>/maps`` text shows the CUDA driver library mapped (pure)."""
    for line in maps.splitlines():
        path = line.rpartition(" ")[2]
        if os.path.basename(path).startswith(_DRIVER_NAMES):
            return True
    return False


def cuda_touched() -> bool:
    """Whether this process initialised CUDA or loaded its driver (so that a fork of it
    could not use CUDA). Reads ``/proc/self/maps``; False where there is none."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return maps_load_cuda_driver(f.read())
    except OSError:
        return False

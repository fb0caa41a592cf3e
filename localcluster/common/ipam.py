"""Pod IP allocation on the loopback network.

Every pod of ``kelastic local`` gets its own address in ``127.1.0.0/16`` so that
two pods can listen on the same port, as they can in a real cluster. Linux routes
the whole of ``127.0.0.0/8`` to the loopback interface, so no interface setup is
needed: a process can bind any of these addresses directly.

The allocator is pure bookkeeping (no I/O): the kubelet asks it for an address
when a pod starts, reserves addresses that pods already carry (after a restart
with persisted state), and releases an address when its pod is gone.

Several local clusters can run on one machine (``kelastic local up`` in one
terminal, ``kelastic local run`` in another, parallel test runs). So that their
pods and services never get the same address, each cluster first claims one of
:data:`BLOCKS` blocks with :func:`claim_networks`: a ``/21`` of the pod network
and the matching ``/21`` of the service network (``127.2.0.0/16``), held by an
advisory file lock that the kernel releases when the process ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BLOCKS",
    "POD_NETWORK",
    "SERVICE_NETWORK",
    "IpAllocator",
    "IpExhaustedError",
    "NetworkClaim",
    "claim_networks",
]

#: The pod network of the local cluster.
POD_NETWORK = ipaddress.IPv4Network("127.1.0.0/16")
#: The service (ClusterIP) network of the local cluster.
SERVICE_NETWORK = ipaddress.IPv4Network("127.2.0.0/16")
#: How many clusters can run side by side on one machine (a /21 each: 2046 pods, 2046 services).
BLOCKS = 32


class IpExhaustedError(RuntimeError):
    """Every address of the network is held by a pod."""


class IpAllocator:
    """Hands out distinct host addresses of ``network``.

    Addresses are given out in increasing order and a released address is reused
    only after the allocator has wrapped around, so a freshly deleted pod's IP is
    not immediately handed to a new pod (stale clients then fail to connect
    instead of reaching the wrong pod).
    """

    def __init__(self, network: ipaddress.IPv4Network = POD_NETWORK) -> None:
        self._network = network
        # .0 is the network address and .1 is kept free (it reads like a gateway);
        # the broadcast address is never handed out either.
        self._first = int(network.network_address) + 2
        self._last = int(network.broadcast_address) - 1
        if self._first > self._last:
            raise ValueError(f"network {network} is too small to allocate pod addresses from")
        self._next = self._first
        self._used: dict[int, str] = {}

    @property
    def network(self) -> ipaddress.IPv4Network:
        return self._network

    def allocate(self, owner: str) -> str:
        """Return a free address and record ``owner`` (e.g. the pod's UID) as its holder.

        Raises :class:`IpExhaustedError` when every address is in use.
        """
        size = self._last - self._first + 1
        for _ in range(size):
            candidate = self._next
            self._next = candidate + 1 if candidate < self._last else self._first
            if candidate not in self._used:
                self._used[candidate] = owner
                return str(ipaddress.IPv4Address(candidate))
        raise IpExhaustedError(
            f"all {size} pod addresses of {self._network} are in use; delete finished pods to free some"
        )

    def reserve(self, ip: str, owner: str) -> bool:
        """Record that ``owner`` already holds ``ip``.

        Returns False (and records nothing) when ``ip`` is outside the network or
        held by another owner; the caller should then allocate a fresh address.
        """
        try:
            address = int(ipaddress.IPv4Address(ip))
        except ValueError:
            return False
        if not self._first <= address <= self._last:
            return False
        holder = self._used.get(address)
        if holder is not None and holder != owner:
            return False
        self._used[address] = owner
        return True

    def release(self, ip: str) -> None:
        """Free ``ip``; releasing an unknown address is a no-op."""
        try:
            self._used.pop(int(ipaddress.IPv4Address(ip)), None)
        except ValueError:
            pass

    def owner_of(self, ip: str) -> str | None:
        try:
            return self._used.get(int(ipaddress.IPv4Address(ip)))
        except ValueError:
            return None

    def __len__(self) -> int:
        return len(self._used)


@dataclass
class NetworkClaim:
    """One cluster's share of the loopback networks, held until :meth:`release`."""

    index: int
    pod_network: ipaddress.IPv4Network
    service_network: ipaddress.IPv4Network
    lock_path: Path
    _fd: int | None

    def release(self) -> None:
        """Give the block back (closing the lock file drops the lock). Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _block(network: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Network:
    return list(network.subnets(new_prefix=21))[index]


def claim_networks(lock_dir: Path | None = None) -> NetworkClaim:
    """Claim the lowest free block (see the module docstring).

    ``lock_dir`` defaults to ``<tmp>/kelastic-local-networks``. Raises
    :class:`IpExhaustedError` when every block is held by a running cluster.
    """
    if lock_dir is None:
        lock_dir = Path(tempfile.gettempdir()) / "kelastic-local-networks"
        if not lock_dir.exists():
            lock_dir.mkdir(parents=True, exist_ok=True)
            # Shared by every user of the machine, like /tmp itself.
            with contextlib.suppress(OSError):
                lock_dir.chmod(0o1777)
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(BLOCKS):
        path = lock_dir / f"block-{index}.lock"
        try:
            # Read-only is enough for flock, so another user's lock file works too.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            continue  # cannot even read it: leave that block alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return NetworkClaim(index, _block(POD_NETWORK, index), _block(SERVICE_NETWORK, index), path, fd)
    raise IpExhaustedError(
        f"no free local cluster network: all {BLOCKS} are held by running clusters or their lock files "
        f"in {lock_dir} cannot be opened; stop another kelastic local or fix that directory's permissions"
    )

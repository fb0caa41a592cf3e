"""Before a new group's workers restore: the parts they will read that this node lacks, pulled
into its memory while they start.

After every rendezvous the agent gives its checkpoint service the round's ring
(``CheckpointService.set_ring``). The workers' restore (``MemoryReader``) then chooses with
:func:`.plan.choose_restore` from the inventories of the group's nodes, reads the parts its
node holds from memory and fetches the others from their holders while it reads. The workers
get there only after their process group and their model's allocation: hundreds of
milliseconds after the ring is known, and the fetch is the longest part of their restore.

:class:`Prefetch` starts at the ring. It asks the ring's nodes what they hold, makes the same
choice (:func:`missing_parts`) and pulls each file of it this node lacks into its memory, as a
replica: counted against ``--checkpoint-memory`` (a file that does not fit is left to the
workers to fetch, as before) and dropped with its checkpoint. The workers' ``inventory``
request waits for a pull under way (:data:`WAIT` at most), so their restore finds those
parts on their own node and fetches nothing.

Nothing here decides what is restored: the workers still choose from what the nodes hold
when they ask. Where the two choices differ (a node's inventory changed in between), a file
pulled for nothing is a replica like any other, and a file not pulled is fetched by the
workers.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .client import ServiceClient
from .errors import CheckpointError
from .keeper import CheckpointKeeper
from .plan import Inventory, RestoreChoice, Source, choose_restore

__all__ = ["PREFETCH_TIMEOUT", "WAIT", "Prefetch", "Pull", "missing_parts"]

_log = logging.getLogger(__name__)

#: How long a worker's ``inventory`` request waits for a pull under way, at most (seconds). A
#: pull ends when its bytes are in or when a read stalls for PREFETCH_TIMEOUT, so the wait
#: is what the transfer takes, which the restore would spend fetching the same bytes; the
#: bound only keeps a pathological transfer (a trickle) from holding the restore forever.
WAIT = 120.0
#: Files pulled at once (from different holders where there are several).
PULLS = 4
#: A peer's connection, and each read on it: a frozen or unreachable node of the new ring
#: holds the pull (and the workers' restore behind it) this long, not a peer's whole timeout.
PREFETCH_TIMEOUT = 2.0


@dataclass(frozen=True)
class Pull:
    """A file of checkpoint ``id`` this node lacks: its size and the nodes that hold it."""

    id: int
    name: str
    size: int
    holders: tuple[str, ...]


def missing_parts(choice: RestoreChoice | None, me: str, manifest: Mapping[str, int]) -> list[Pull]:
    """The files of ``choice`` that node ``me`` does not hold, with their sizes (from the
    checkpoint's ``manifest``) and holders, each file's first holder a different one where
    several hold files (pure). None for a durable choice, or none at all."""
    if choice is None or choice.source is Source.DURABLE:
        return []
    pulls = []
    for i, (name, holders) in enumerate(sorted(choice.holders.items())):
        size = manifest.get(name)
        if me in holders or not holders or not size:
            continue
        k = i % len(holders)
        pulls.append(Pull(choice.id, name, size, holders[k:] + holders[:k]))
    return pulls


def _manifest(inventories: Sequence[Inventory], cid: int) -> Mapping[str, int]:
    for inv in inventories:
        for held in inv.held:
            if held.id == cid and held.required is not None:
                return held.required
    return {}


class Prefetch:
    """Pulls, in the background, what the next restore of this node's workers would fetch.

    ``client(endpoint)`` connects to a peer's service with the job's key. :meth:`start` after
    every rendezvous (a newer start supersedes one under way); :meth:`wait` until the pulls
    of the newest start are over.
    """

    def __init__(
        self, endpoint: str, keeper: CheckpointKeeper, client: Callable[[str], ServiceClient]
    ) -> None:
        self._endpoint = endpoint
        self._keeper = keeper
        self._client = client
        self._lock = threading.Lock()
        self._generation = 0
        self._idle = threading.Event()
        self._idle.set()

    def start(self, ring: Sequence[str]) -> None:
        """Pull what the group of ``ring`` would restore that this node lacks (returns at once)."""
        if self._endpoint not in ring or len(ring) < 2:
            return
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._idle.clear()
        threading.Thread(
            target=self._run, args=(tuple(ring), generation), name="kelastic-checkpoint-prefetch", daemon=True
        ).start()

    def stop(self) -> None:
        """Supersede any pull under way (it ends after the file it is on) and stop waiting."""
        with self._lock:
            self._generation += 1
            self._idle.set()

    def wait(self, timeout: float = WAIT) -> bool:
        """Until the newest start's pulls are over; False if ``timeout`` ran out first."""
        return self._idle.wait(timeout)

    def _current(self, generation: int) -> bool:
        with self._lock:
            return generation == self._generation

    def _run(self, ring: tuple[str, ...], generation: int) -> None:
        try:
            inventories = [self._keeper.inventory()]
            for endpoint in ring:
                if endpoint == self._endpoint:
                    continue
                client = self._client(endpoint)
                try:
                    header, _ = client.call({"op": "inventory"})
                    inventories.append(Inventory.from_json(header["inventory"]))
                except (CheckpointError, KeyError, TypeError, ValueError) as e:
                    _log.debug("checkpoint prefetch: no inventory from %s: %s", endpoint, e)
                finally:
                    client.close()
            choice = choose_restore(inventories)
            pulls = missing_parts(choice, self._endpoint, _manifest(inventories, choice.id) if choice else {})
            if pulls:
                with ThreadPoolExecutor(
                    min(PULLS, len(pulls)), thread_name_prefix="kelastic-prefetch"
                ) as pool:
                    list(pool.map(lambda p: self._pull(p, generation), pulls))
        except Exception:  # a pull is an optimisation: the workers fetch what is missing
            _log.debug("checkpoint prefetch failed", exc_info=True)
        finally:
            with self._lock:
                if generation == self._generation:
                    self._idle.set()

    def _pull(self, pull: Pull, generation: int) -> None:
        if not self._current(generation):
            return
        try:
            part = self._keeper.replica_target(pull.id, pull.name, pull.size)
        except CheckpointError as e:  # held meanwhile, superseded, or does not fit
            _log.debug("checkpoint prefetch: %s of checkpoint %d not pulled: %s", pull.name, pull.id, e)
            return
        try:
            with open(part, "r+b") as f:
                # Its pages now: a full tmpfs is an OSError here, never a SIGBUS in the copy.
                os.posix_fallocate(f.fileno(), 0, pull.size)
                self._receive(pull, f.fileno())
        except (CheckpointError, OSError) as e:
            self._keeper.replica_failed(pull.id, pull.name, part)
            _log.debug("checkpoint prefetch: %s of checkpoint %d: %s", pull.name, pull.id, e)
            return
        except BaseException:
            self._keeper.replica_failed(pull.id, pull.name, part)
            raise
        self._keeper.replica_done(pull.id, pull.name, part, pull.size)
        _log.debug(
            "checkpoint prefetch: pulled %s of checkpoint %d (%d bytes)", pull.name, pull.id, pull.size
        )

    def _receive(self, pull: Pull, fd: int) -> None:
        """The file from the first of its holders that gives it, straight into ``fd`` (mapped)."""
        last: CheckpointError | None = None
        request = {"op": "get", "id": pull.id, "name": pull.name, "offset": 0, "length": pull.size}
        with mmap.mmap(fd, pull.size) as mm, memoryview(mm) as view:
            for endpoint in pull.holders:
                client = self._client(endpoint)
                try:
                    client.call(request, into=view)
                    return
                except CheckpointError as e:
                    last = e
                finally:
                    client.close()
        raise last or CheckpointError(f"no holder of {pull.name}")

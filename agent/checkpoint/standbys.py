"""Where a job's nodes announce their checkpoint services for the standbys' copies: the
rendezvous store.

A node that waits without a slot (a hot standby, ``kelastic-agent --standby``, or a node
that found the group full) holds no rank and is on no round's ring, so the group's nodes
would not know where to send it their parts. Every node announces its service once it
started (:meth:`StandbyBoard.announce`): ``add`` on ``kelastic/<run id>/ckpt/standbys``
hands it a slot, and ``kelastic/<run id>/ckpt/standby/<slot>`` holds ``{"node",
"endpoint", "limit"}`` (JSON). The group's nodes read the announcements
(:meth:`StandbyBoard.holders`) when they send a checkpoint's parts out, and
:func:`~.plan.standby_holders` leaves out the nodes on the round's ring (its members): the
others are the standbys.

* **Signed.** With a job secret every announcement carries a MAC
  (:class:`~kelastic.agent.rendezvous.records.RecordSigner`, scoped to the run), and an
  announcement without a valid one is ignored: a stranger with store access cannot make
  the nodes send it their parts (it could not prove the job's secret to take them either).
* **Bounded.** A reader takes the newest :data:`MAX_SLOTS` slots, reads each slot once (a
  slot is written once), and keeps a node's newest announcement only (a node that
  restarted announces again). Standbys and replacements start after the members, so
  theirs are the newest.
* **Best effort.** A store that cannot be reached reads as no standby (the parts then go to
  the ring only, as without standbys), and an answer is reused for :data:`CACHE_S` seconds.

A node that is gone stays announced; its senders skip it after a failed try.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kelastic.agent.checkpoint.plan import StandbyHolder

__all__ = ["CACHE_S", "MAX_SLOTS", "StandbyBoard", "announce_when_reachable"]

_log = logging.getLogger(__name__)

#: Slots a reader reads (the newest ones): far more standbys than any job runs.
MAX_SLOTS = 64
#: Seconds an answer of :meth:`StandbyBoard.holders` is reused.
CACHE_S = 2.0


def _connect(endpoint: str) -> Any:
    from kelastic.agent.rendezvous import control  # torch.distributed: only when used

    return control.connect(endpoint, timeout=2.0)


class StandbyBoard:
    """The standby announcements of run ``run_id`` in the rendezvous store at ``endpoint``,
    signed under ``job_key`` (None: unsigned, a job without a secret). Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        job_key: bytes | None,
        *,
        connect: Callable[[str], Any] = _connect,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kelastic.agent.rendezvous.records import RecordSigner

        self.endpoint = endpoint
        self.run_id = run_id
        self._signer = RecordSigner.for_job(job_key).scoped(f"{run_id} checkpoint standbys")
        self._connect = connect
        self._clock = clock
        self._lock = threading.Lock()
        self._store: Any = None
        self._cached: tuple[float, list[StandbyHolder]] | None = None
        #: slot -> (node, holder) as announced, None for one that is not the job's
        self._slots: dict[int, tuple[str, StandbyHolder] | None] = {}

    def _key(self, name: str) -> str:
        return f"kelastic/{self.run_id}/{name}"

    def _client(self) -> Any:
        if self._store is None:
            self._store = self._connect(self.endpoint)
        return self._store

    def announce(self, node: str, holder: StandbyHolder) -> int:
        """Announce this standby's service (``holder``) under ``node``; its slot. Raises what
        the store raised when it cannot be reached."""
        with self._lock:
            try:
                store = self._client()
                slot = int(store.add(self._key("ckpt/standbys"), 1)) - 1
                name = f"ckpt/standby/{slot}"
                value = json.dumps({"node": node, "endpoint": holder.endpoint, "limit": holder.limit})
                store.set(self._key(name), self._signer.sign(name, value))
            except Exception:
                self._store = None
                raise
        return slot

    def holders(self) -> list[StandbyHolder]:
        """The announced standbys, in the order they announced (their newest announcement
        each); none when the store cannot be reached. Never raises."""
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < CACHE_S:
                return list(self._cached[1])
            try:
                found = self._read()
            except Exception as e:  # best effort: the ring still holds the replicas
                self._store = None
                _log.debug("checkpoint standbys: the store at %s did not answer: %s", self.endpoint, e)
                found = []
            self._cached = (now, found)
            return list(found)

    def _read(self) -> list[StandbyHolder]:
        """Every announcement, read once: a slot is written once and never changes, so only
        the slots not seen yet are asked for (one ``add`` per read when nothing is new)."""
        store = self._client()
        count = int(store.add(self._key("ckpt/standbys"), 0))
        new = [n for n in range(max(0, count - MAX_SLOTS), count) if n not in self._slots]
        present = [n for n in new if store.check([self._key(f"ckpt/standby/{n}")])]
        if present:
            values = store.multi_get([self._key(f"ckpt/standby/{n}") for n in present])
            for n, raw in zip(present, values, strict=True):
                self._slots[n] = self._parse(f"ckpt/standby/{n}", raw)
        newest: dict[str, StandbyHolder] = {}
        for n in sorted(self._slots)[-MAX_SLOTS:]:
            announced = self._slots[n]
            if announced is not None:
                node, holder = announced
                newest.pop(node, None)  # the newer announcement, in its own place
                newest[node] = holder
        return list(newest.values())

    def _parse(self, name: str, raw: bytes) -> tuple[str, StandbyHolder] | None:
        value = self._signer.open(name, raw)
        if value is None:
            return None
        try:
            d = json.loads(value)
            return str(d["node"]), StandbyHolder(str(d["endpoint"]), int(d["limit"]))
        except (ValueError, KeyError, TypeError):
            return None


def announce_when_reachable(
    board: StandbyBoard,
    node: str,
    holder: StandbyHolder,
    on_announced: Callable[[int], None],
    *,
    retry_s: float = 2.0,
) -> threading.Thread:
    """Announce ``holder`` from a daemon thread as soon as the store accepts connections.

    The node's start never waits for this: the store may not be up yet, and the rendezvous
    already says what it waits for. Until the store answers, the thread only probes it with a
    plain socket (torch's client would print a stack trace per failed connect), every
    ``retry_s`` seconds; a failed announcement is retried the same way. ``on_announced`` gets
    the slot, once. The thread ends with the process.
    """
    from kelastic.agent.rendezvous.dial import Reach, probe

    host, _, port = board.endpoint.rpartition(":")
    host = host.strip("[]")

    def run() -> None:
        while True:
            if probe(host, int(port), retry_s)[0] is Reach.ACCEPTS:
                try:
                    slot = board.announce(node, holder)
                except Exception as exc:  # the store went away again, or refused: try later
                    _log.debug("could not announce the checkpoint service yet: %s", exc)
                else:
                    on_announced(slot)
                    return
            time.sleep(retry_s)

    thread = threading.Thread(target=run, name="kelastic-standby-announce", daemon=True)
    thread.start()
    return thread

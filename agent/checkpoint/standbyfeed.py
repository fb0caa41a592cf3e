"""Sending this node's newest checkpoint part to the hot standbys, in the background.

After each commit, once its ring replica is in place, the checkpoint service hands
:class:`StandbyFeed` this node's files of that checkpoint and the round's ring; the feed asks
which standbys are announced (``standbys()``, :mod:`.standbys`), takes those
:class:`~.plan.ReplicaPlan` assigns this node's part to, and sends them the files (``put``,
as the ring's replicas). So a standby that replaces any member holds the state already and
restores it from its own memory.

* **Never in a save's way.** A save waits for the ring's replica of the previous checkpoint,
  never for the standbys' copy: the feed begins once the ring's replica is in place, runs
  on a thread of its own, and a standby that is slow or gone costs only its own copy.
  (Waiting for the standbys' copy as for the ring's would make the copy of a member lost
  at any moment certain, at the price of one more copy of the whole state before every
  save: on a busy 2-core machine with a save every step that cost a third of the goodput.)
* **The newest only.** While one checkpoint is being sent, a newer commit replaces the one
  waiting: a standby needs the newest, not each one.
* **Bounded waits.** A standby gets :data:`STANDBY_TIMEOUT` seconds per connection and
  request; one that could not be reached or refused is skipped for :data:`RETRY_AFTER`
  seconds (within the round: a new round tries every standby again).
* **Not while the group restores.** A new round (:meth:`StandbyFeed.new_round`) stops the
  copy in flight between two pieces and drops the one waiting: they were meant for the old
  round's standbys (one of which may be a member now), and the CPU goes to the restore.
  The new group's first commit is sent to the new round's standbys.
* **Whole or nothing.** A file is sent only while this node still holds it as that
  checkpoint's (a newer save may reuse a dropped file's pages): checked once every byte has
  been read, before the last piece goes; otherwise the connection is closed short and the
  standby keeps nothing of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kelastic.agent.checkpoint.client import ServiceClient
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.plan import ReplicaPlan, StandbyHolder
from kelastic.agent.checkpoint.settings import format_bytes

__all__ = ["RETRY_AFTER", "STANDBY_TIMEOUT", "StandbyFeed"]

_log = logging.getLogger(__name__)

#: Seconds a standby that could not be reached (or refused a copy) is left out: a replacement
#: announced a moment before its service listens is fed again soon.
RETRY_AFTER = 10.0
#: Seconds a standby may take to accept a connection or answer a request.
STANDBY_TIMEOUT = 5.0


@dataclass(frozen=True)
class _Job:
    cid: int
    files: tuple[tuple[str, int], ...]
    ring: tuple[str, ...]


class StandbyFeed:
    """Sends this node's (``endpoint``'s) newest committed part to its standbys; see the module
    docstring. ``connect(endpoint)`` opens a client with the job's key; ``on_sent(id, seconds,
    bytes, targets)`` is called after each checkpoint sent (optional)."""

    def __init__(
        self,
        endpoint: str,
        keeper: CheckpointKeeper,
        connect: Callable[[str], ServiceClient],
        standbys: Callable[[], Sequence[StandbyHolder]],
        replicas: int,
        on_sent: Callable[[int, float, int, list[str]], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._keeper = keeper
        self._connect = connect
        self._standbys = standbys
        self._replicas = replicas
        self._on_sent = on_sent
        self._cond = threading.Condition()
        self._next: _Job | None = None
        self._stopped = False
        self._round = 0  # counts new_round(): a copy of an older round is stopped
        #: standby -> (the round, when it may be tried again)
        self._unreachable: dict[str, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._run, name="kelastic-checkpoint-standbys", daemon=True)

    def start(self) -> StandbyFeed:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def new_round(self) -> None:
        """The group re-forms: the copy in flight stops before its next piece, the one waiting
        goes; what is committed next is sent to the new round's standbys."""
        with self._cond:
            self._round += 1
            self._next = None

    def offer(self, cid: int, files: Sequence[tuple[str, int]], ring: Sequence[str]) -> None:
        """Checkpoint ``cid`` was committed here: send ``files`` (this node's) once the feed is
        free, unless a newer one is offered first."""
        with self._cond:
            if self._next is None or self._next.cid < cid:
                self._next = _Job(cid, tuple(files), tuple(ring))
                self._cond.notify_all()

    def plan(self, ring: Sequence[str], part_bytes: int) -> ReplicaPlan:
        """The round's assignment as this node sees it now (the standbys announced so far)."""
        return ReplicaPlan(tuple(ring), self._replicas, tuple(self._standbys()), part_bytes)

    def _held(self, cid: int, file: tuple[str, int]) -> bool:
        """Whether this node still holds its own ``file`` of checkpoint ``cid`` (not dropped: its
        bytes are that checkpoint's, not a newer save's in a reused file)."""
        return file in self._keeper.own_files(cid)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job, self._next, round_ = self._next, None, self._round
            assert job is not None
            try:
                self._send(job, round_)
            except Exception:
                _log.exception("checkpoint %d: sending this node's part to the standbys failed", job.cid)

    def _send(self, job: _Job, round_: int) -> None:
        part = sum(size for _, size in job.files)
        now = time.monotonic()
        targets = [
            t
            for t in self.plan(job.ring, part).standbys_of(self.endpoint)
            if not _left_out(self._unreachable.get(t), round_, now)
        ]

        def stop() -> bool:
            return self._round != round_

        if not targets:
            return
        began, sent = time.monotonic(), 0
        for target in targets:
            client = self._connect(target)
            try:
                for name, size in job.files:
                    client.put_file(
                        job.cid,
                        name,
                        self._keeper.path_of(job.cid, name),
                        size,
                        guard=lambda held=(name, size): self._held(job.cid, held),  # type: ignore[misc]
                        sender=self.endpoint,
                        stop=stop,
                    )
                    sent += size
                self._unreachable.pop(target, None)
            except (CheckpointError, OSError) as e:
                if stop():
                    _log.debug("checkpoint %d: a new round stopped its copy to standby %s", job.cid, target)
                    return
                if not self._held(job.cid, job.files[0]):
                    _log.debug("checkpoint %d: superseded while sent to standby %s", job.cid, target)
                    return
                self._unreachable[target] = (round_, time.monotonic() + RETRY_AFTER)
                _log.warning(
                    "checkpoint %d: standby %s holds no copy of this node's part (%s); tried again in %g s",
                    job.cid,
                    target,
                    e,
                    RETRY_AFTER,
                )
            finally:
                client.close()
        seconds = time.monotonic() - began
        _log.debug(
            "checkpoint %d: %s sent to standbys %s in %.3f s", job.cid, format_bytes(sent), targets, seconds
        )
        if self._on_sent is not None:
            self._on_sent(job.cid, seconds, sent, targets)


def _left_out(entry: tuple[int, float] | None, round_: int, now: float) -> bool:
    """Whether a standby that failed (``entry``: in which round, until when) is skipped in
    round ``round_`` at ``now`` (pure)."""
    return entry is not None and entry[0] == round_ and now < entry[1]

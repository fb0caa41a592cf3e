"""Signed store records: what an agent reads from a rendezvous store and acts on carries a MAC.

The store (torch's ``TCPStore``) authenticates no client: whoever reaches it may write
any key. So the records that steer the job (a member's fate, an event that says a round
closed or the job finished, the job's ``closed`` mark, the round's rank assignments and
checkpoint ring) carry a MAC under a key derived from the job's secret, and a reader
takes a record only when its MAC holds; one that fails is ignored as if it were absent,
counted (``kelastic_agent_refused_total{service="store_record",reason="unauthenticated"}``
on the agent's ``/metrics``), and logged at most once per :data:`LOG_INTERVAL` seconds. A
record whose MAC holds but that its reader finds written for another round (a replay of
the job's own after a later one was read, :meth:`RecordSigner.other_round`) is ignored and
counted so too, with reason ``bad_request``. A stranger with store
access can then delete records or write garbage (which stalls, at worst, what waits for
the record), never put words in a member's mouth.

A signed value is ``value + MARK + tag``: ``tag`` is the first 16 bytes (hex) of
``HMAC-SHA256(K, label | name | scope | value)``, where ``K = HMAC-SHA256(job secret,
"kelastic store records v1")`` (a key of its own, never the secret or the peer link's),
``name`` is the key's name under the run's prefix (``r/4/fate/node-a``, ``ev/17``) and
``scope`` what else the record belongs to (the round of a round-private store), so a
record copied to another key, round or job fails. The value keeps its own text before
the mark, so that a reader that does not check (the operator's status) reads it as before.

Without a job secret (a torchrun-style run by hand with neither ``--job-secret-file`` nor
``--insecure-no-secret``) there is no key: records are written and read unsigned, as torch
does.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass, field

from kelastic.agent.auth import REFUSALS, Reason

__all__ = ["LOG_INTERVAL", "MARK", "SERVICE", "RecordSigner", "record_key"]

log = logging.getLogger(__name__)

#: Separates a value from its tag (a byte no record's text holds).
MARK = b"\x1fkmac1:"
_LABEL = b"kelastic store record v1\x00"
_TAG_BYTES = 16
#: A refused record is logged at most once per this many seconds (each is counted).
LOG_INTERVAL = 30.0
#: The ``service`` label of refused records in ``kelastic_agent_refused_total``.
SERVICE = "store_record"


def record_key(job_key: bytes) -> bytes:
    """The records' key, derived from the job's secret (domain-separated from its other uses)."""
    return hmac.new(job_key, b"kelastic store records v1", hashlib.sha256).digest()


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class _Refusals:
    """How many records failed their MAC, and when that was last logged (shared, thread-safe);
    per key of a record bound to a round, the latest round of one taken (:meth:`RecordSigner.took`)."""

    count: int = 0
    logged: float = float("-inf")
    lock: threading.Lock = field(default_factory=threading.Lock)
    rounds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordSigner:
    """Signs and checks the records of one run (``key`` None: no secret, records unsigned).

    ``scope`` is mixed into every MAC: :meth:`scoped` gives the signer of a round-private
    store. Signers made from one another share one count of refused records.
    """

    key: bytes | None
    scope: str = ""
    _refusals: _Refusals = field(default_factory=_Refusals, compare=False, repr=False)

    @staticmethod
    def for_job(job_key: bytes | None) -> RecordSigner:
        return RecordSigner(None if job_key is None else record_key(job_key))

    @property
    def signing(self) -> bool:
        return self.key is not None

    @property
    def refused(self) -> int:
        """Records that failed their MAC so far (each ignored as if absent)."""
        return self._refusals.count

    def scoped(self, scope: str) -> RecordSigner:
        return RecordSigner(self.key, scope, self._refusals)

    def _tag(self, name: str, value: bytes) -> bytes:
        assert self.key is not None
        msg = b"".join(
            (
                _LABEL,
                len(name).to_bytes(4, "big"),
                name.encode(),
                b"\x00",
                self.scope.encode(),
                b"\x00",
                value,
            )
        )
        return hmac.new(self.key, msg, hashlib.sha256).digest()[:_TAG_BYTES].hex().encode()

    def sign(self, name: str, value: str) -> str:
        """``value`` (text) as stored under ``name``: with its tag, or as is without a key."""
        if self.key is None:
            return value
        return (_bytes(value) + MARK + self._tag(name, _bytes(value))).decode()

    def open(self, name: str, stored: bytes | str | None) -> bytes | None:
        """The value of a record read from ``name``; None when absent or when its MAC fails
        (counted and logged, see the module doc). Without a key: the stored bytes as they are."""
        if stored is None:
            return None
        raw = _bytes(stored)
        if self.key is None:
            return raw
        value, mark, tag = raw.rpartition(MARK)
        if mark and hmac.compare_digest(tag, self._tag(name, value)):
            return value
        self._refuse(name, "no MAC" if not mark else "a wrong MAC")
        return None

    def holds(self, name: str, stored: bytes | str) -> bool:
        """Whether ``stored`` carries this signer's MAC for ``name`` (nothing counted or logged:
        for a reader that asks which key signed a record, not whether to take it)."""
        if self.key is None:
            return False
        value, mark, tag = _bytes(stored).rpartition(MARK)
        return bool(mark) and hmac.compare_digest(tag, self._tag(name, value))

    def valid(self, name: str, stored: bytes | str | None) -> bool:
        return self.open(name, stored) is not None

    def took(self, name: str, r: int) -> None:
        """A record of round r was taken from ``name`` (see :meth:`other_round`)."""
        with self._refusals.lock:
            self._refusals.rounds[name] = max(r, self._refusals.rounds.get(name, r))

    def other_round(self, name: str, written_in: object, r: int) -> None:
        """A record of ``name`` whose MAC holds was written in round ``written_in``, not in
        round r that its reader reads (the reader ignores it as if absent). Written in a round
        below one of which a record was taken from ``name`` before, it is a replay of the job's
        own record (its writer never goes back): counted and logged with reason
        ``bad_request``. Otherwise it is one its writer has not written again since the round
        changed: ignored, not counted."""
        with self._refusals.lock:
            newest = self._refusals.rounds.get(name)
        if newest is not None and (not isinstance(written_in, int) or written_in < newest):
            self._refuse(
                name,
                f"of round {written_in} read in round {r}, after one of round {newest}",
                Reason.BAD_REQUEST,
            )

    def _refuse(self, name: str, why: str, reason: Reason = Reason.UNAUTHENTICATED) -> None:
        REFUSALS.count(SERVICE, reason)
        r = self._refusals
        now = time.monotonic()
        with r.lock:
            r.count += 1
            due = now - r.logged >= LOG_INTERVAL
            if due:
                r.logged = now
            count = r.count
        if due and reason is Reason.BAD_REQUEST:
            log.warning(
                "kelastic rendezvous: ignored a store record %s %s (the job's own, written back by "
                "someone who can reach the store; %d ignored so far, logged at most every %gs)",
                name,
                why,
                count,
                LOG_INTERVAL,
            )
        elif due:
            log.warning(
                "kelastic rendezvous: ignored a store record %s with %s (not signed with this node's "
                "job secret: a stranger's, or an agent's given another --job-secret-file, and every agent "
                "of a job needs the same one; %d ignored so far, logged at most every %gs)",
                name,
                why,
                count,
                LOG_INTERVAL,
            )

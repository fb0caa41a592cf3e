"""The operator's side of the rendezvous control protocol, off the event loop.

Publishes each job's expected membership and reads its world size, restarts and
progress through :mod:`kelastic.agent.rendezvous.control`. Store calls block (they
are TCP round trips), so they run in a small thread pool of their own; one
connection per endpoint is kept and used by one thread at a time.

Tolerant of an unreachable store: a failed call returns ``None``/``False`` and the
endpoint is not retried for ``retry_after`` seconds, so a dead store neither stalls
the operator nor floods the pool. A store not reachable yet (a new job's Service not
routed, its pod starting) is expected: one line when it starts, then one every
``report_every`` seconds while it lasts, one when it ends; torch's C++ client logs,
which print a multi-line stack trace per failed connect, are silenced. Any other
error is logged each time it happens (at most once per ``retry_after``). A membership is
republished when it changes, when the store was restarted (``store_id``), and at
least every ``refresh`` seconds.

Every record published carries the MAC of the job's secret, which the client derives from the
operator's master key (:func:`kelastic.operator.jobsecret.derived_value`): agents that run
``controlled=1`` with the secret take no other. A job whose agents hold a secret the master key
does not derive (its Secret was made with a random value, before the operator derived them)
is found by its agents' own signed round close: its records are then published unsigned, as
before, and the operator says so once per job; what its agents do is in docs/security.md.
Which of the two a job is, once known, does not change while the operator runs. What the
operator reads back and shows (the agents' progress, goodput and checkpoint reports, the
straggler verdict, the members) it takes only with the same MAC, for a job of the first kind:
a report a stranger wrote is ignored (and logged), never shown in the job's status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kelastic.operator import checkpoint, goodput, jobsecret
from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import PublishMembership

__all__ = ["StoreClient"]

log = logging.getLogger(__name__)

_Arg = TypeVar("_Arg")
_Result = TypeVar("_Result")


@dataclass
class _Conn:
    lock: threading.Lock
    store: Any = None
    down_until: float = 0.0
    reported: bool = False  # an outage was logged and its end is not yet
    down_since: float | None = None  # monotonic start of the current "not reachable" spell
    next_report: float = 0.0


class StoreClient:
    def __init__(
        self,
        *,
        connect_timeout: float = 3.0,
        retry_after: float = 2.0,
        refresh: float = 5.0,
        max_workers: int = 4,
        report_every: float = 60.0,
        master_key: bytes | None = None,
    ) -> None:
        """``master_key``: the operator's (:mod:`kelastic.operator.masterkey`); without one, a key
        of this client's own (for tests: no Secret made by another process derives from it)."""
        # torch's C++ side logs each failed connect with a stack trace (ERROR level), before
        # raising the error we report ourselves. Read once, when torch is first imported.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        self.connect_timeout = connect_timeout
        self.retry_after = retry_after
        self.refresh = refresh
        self.report_every = report_every
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kelastic-store"
        )
        self._conns: dict[str, _Conn] = {}
        self._published: dict[str, tuple[tuple[Any, ...], float]] = {}
        self._guard = threading.Lock()
        self._master_key = master_key if master_key is not None else secrets.token_bytes(32)
        #: Per run id: whether its agents hold the derived secret (False: records go unsigned).
        self._derived: dict[str, bool] = {}
        #: Per run id: the signer its records are read back with (None: unchecked), kept so that
        #: a stranger's records are logged at its rate, not on every read.
        self._signers: dict[str, Any] = {}

    def job_secret(self, uid: str) -> str:
        """The secret of the job ``uid`` (what its Secret holds): derived from the master key."""
        return jobsecret.derived_value(self._master_key, uid)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._conns.clear()

    def warm_up(self) -> None:
        """Import the control protocol (and torch) in the pool now rather than on the first call."""
        self._pool.submit(_import_control)

    def forget(self, run_id: str) -> None:
        """Drop what is remembered about a job (it was deleted)."""
        self._published.pop(run_id, None)
        self._derived.pop(run_id, None)
        self._signers.pop(run_id, None)

    async def publish(self, action: PublishMembership) -> bool:
        """Publish ``action``'s membership unless the store already has it. True if published now."""
        key = (action.endpoint, action.store_id, action.nodes, action.min_nodes, action.max_nodes)
        last = self._published.get(action.run_id)
        if last is not None and last[0] == key and time.monotonic() - last[1] < self.refresh:
            return False
        ok = await self._call(action.endpoint, self._publish, action)
        if ok:
            self._published[action.run_id] = (key, time.monotonic())
        return bool(ok)

    async def connect(self, endpoint: str) -> bool:
        """Make sure a connection to ``endpoint`` is open (connecting may take seconds). True if it is."""
        return bool(await self._call(endpoint, _noop, None))

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        """The store's view of ``run_id``, or None if the store cannot be reached."""
        return await self._call(endpoint, self._read, run_id)

    async def _call(self, endpoint: str, fn: Callable[[Any, _Arg], _Result], arg: _Arg) -> _Result | None:
        """``fn(store, arg)`` in the pool on ``endpoint``'s connection; None if the store is down."""
        with self._guard:
            conn = self._conns.setdefault(endpoint, _Conn(threading.Lock()))
        if time.monotonic() < conn.down_until:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._blocking, endpoint, conn, fn, arg)
        except RuntimeError:  # the pool was shut down while the operator stops
            return None

    def _blocking(
        self, endpoint: str, conn: _Conn, fn: Callable[[Any, _Arg], _Result], arg: _Arg
    ) -> _Result | None:
        with conn.lock:
            if time.monotonic() < conn.down_until:
                return None
            try:
                if conn.store is None:
                    from kelastic.agent.rendezvous import control

                    conn.store = control.connect(endpoint, timeout=self.connect_timeout)
                result = fn(conn.store, arg)
            except Exception as exc:  # the store is remote and may be gone: never let it escape
                conn.store = None
                conn.down_until = time.monotonic() + self.retry_after
                self._report(endpoint, conn, exc)
                return None
            if conn.reported:
                log.info("rendezvous store %s reachable again", endpoint)
            conn.reported, conn.down_since, conn.next_report = False, None, 0.0
            return result

    def _publish(self, store: Any, action: PublishMembership) -> bool:
        """Publish ``action`` signed with the job's secret, or unsigned for a job whose agents
        hold a secret the master key does not derive (said once per job)."""
        from kelastic.agent.rendezvous import control

        control.publish_membership(
            store,
            action.run_id,
            nodes=list(action.nodes),
            min_nodes=action.min_nodes,
            max_nodes=action.max_nodes,
            job_key=self._job_key(store, action.run_id),
        )
        return True

    def _read(self, store: Any, run_id: str) -> RendezvousView:
        """The job's view from the records its agents signed (any, for a job whose agents hold a
        secret the master key does not derive)."""
        from kelastic.agent.rendezvous import control

        key = self._job_key(store, run_id)
        signer = self._signers.get(run_id)
        if signer is None and key is not None:
            self._signers[run_id] = signer = control.job_signer(key)
        return _read(store, run_id, None if key is None else signer)

    def _job_key(self, store: Any, run_id: str) -> bytes | None:
        """The job's secret as its agents hold it: derived from the master key; None for a job
        whose agents hold another (said once per job; unknown before its first round closed:
        the derived one)."""
        from kelastic.agent.rendezvous import control

        key = self.job_secret(run_id).encode()
        derived = self._derived.get(run_id)
        if derived is None:
            held = control.agents_hold(store, run_id, key)
            if held is False:
                log.warning(
                    "job with uid %s: its agents hold a job secret that the operator's master key does not "
                    "derive (its Secret was made before the operator derived them): its membership and "
                    "bounds stay unsigned in its rendezvous store. Agents started with controlled=1 and "
                    "the secret refuse unsigned records; recreate the job to have them signed "
                    "(docs/security.md)",
                    run_id,
                )
            if held is not None:
                self._derived[run_id] = derived = held
        return None if derived is False else key

    def _report(self, endpoint: str, conn: _Conn, exc: Exception) -> None:
        """One readable line: rate-limited for "not reachable", every time for anything else."""
        now = time.monotonic()
        if not _unreachable(exc):
            log.warning("rendezvous store %s: %s: %s", endpoint, type(exc).__name__, _first_line(exc))
            conn.reported = True
            return
        if conn.down_since is None:
            conn.down_since = now
        if now < conn.next_report:
            return
        conn.next_report = now + self.report_every
        reason = _first_line(exc.__cause__ or exc)
        if not conn.reported:
            log.info(
                "rendezvous store %s not reachable yet (%s); retrying every %g s",
                endpoint,
                reason,
                self.retry_after,
            )
        else:
            log.warning(
                "rendezvous store %s still not reachable after %.0f s (%s)",
                endpoint,
                now - conn.down_since,
                reason,
            )
        conn.reported = True


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be reached (rather than that a call went wrong)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # By name: torch's classes (RendezvousConnectionError, DistNetworkError) without importing torch.
    return any(cls.__name__ in ("RendezvousConnectionError", "DistNetworkError") for cls in type(exc).__mro__)


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch appends C++ stack traces), or its class name."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _noop(store: Any, arg: Any) -> bool:
    return True


def _import_control() -> None:
    try:
        from kelastic.agent.rendezvous import control  # noqa: F401
    except Exception as exc:  # reported when a store is first used
        log.debug("rendezvous control unavailable: %s", exc)


def _read(store: Any, run_id: str, signer: Any) -> RendezvousView:
    from kelastic.agent.rendezvous import control

    status = control.read_status(store, run_id, signer)
    progress = status.progress
    return RendezvousView(
        world_size=int(status.world_size or 0),
        restarts=int(status.restarts or 0),
        members=tuple(status.members or ()),
        step=progress.step if progress is not None else None,
        total=progress.total if progress is not None else None,
        recoveries=tuple((r.node, r.seconds, r.ended) for r in status.recoveries),
        failures=tuple((f.node, f.reason, f.at) for f in status.failures),
        hangs=tuple((h.node, h.ranks, h.seconds, h.at) for h in status.hangs),
        checkpoints=tuple(checkpoint.report(node, record) for node, record in status.checkpoints),
        round=int(status.round or 0),
        standbys=tuple(status.standbys),
        goodputs=tuple(goodput.report(node, record) for node, record in status.goodputs),
        straggler=status.straggler,
    )

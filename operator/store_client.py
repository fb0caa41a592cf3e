"""The operator's side of the rendezvous control protocol, off the event loop.

Publishes each job's expected membership and reads its world size, restarts and
progress through :mod:`kelastic.agent.rendezvous.control`. Store calls block (they
are TCP round trips), so they run in a small thread pool of their own; one
connection per endpoint is kept and used by one thread at a time.

Tolerant of an unreachable store: a failed call returns ``None``/``False``, logs
once per outage, and the endpoint is not retried for ``retry_after`` seconds, so a
dead store neither stalls the operator nor floods the pool. A membership is
republished when it changes, when the store was restarted (``store_id``), and at
least every ``refresh`` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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
    reported: bool = False


class StoreClient:
    def __init__(
        self,
        *,
        connect_timeout: float = 3.0,
        retry_after: float = 2.0,
        refresh: float = 5.0,
        max_workers: int = 4,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.retry_after = retry_after
        self.refresh = refresh
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kelastic-store"
        )
        self._conns: dict[str, _Conn] = {}
        self._published: dict[str, tuple[tuple[Any, ...], float]] = {}
        self._guard = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._conns.clear()

    def warm_up(self) -> None:
        """Import the control protocol (and torch) in the pool now rather than on the first call."""
        self._pool.submit(_import_control)

    def forget(self, run_id: str) -> None:
        """Drop what is remembered about a job (it was deleted)."""
        self._published.pop(run_id, None)

    async def publish(self, action: PublishMembership) -> bool:
        """Publish ``action``'s membership unless the store already has it. True if published now."""
        key = (action.endpoint, action.store_id, action.nodes, action.min_nodes, action.max_nodes)
        last = self._published.get(action.run_id)
        if last is not None and last[0] == key and time.monotonic() - last[1] < self.refresh:
            return False
        ok = await self._call(action.endpoint, _publish, action)
        if ok:
            self._published[action.run_id] = (key, time.monotonic())
        return bool(ok)

    async def connect(self, endpoint: str) -> bool:
        """Make sure a connection to ``endpoint`` is open (connecting may take seconds). True if it is."""
        return bool(await self._call(endpoint, _noop, None))

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        """The store's view of ``run_id``, or None if the store cannot be reached."""
        return await self._call(endpoint, _read, run_id)

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
                if not conn.reported:
                    log.warning(
                        "rendezvous store %s unreachable: %s",
                        endpoint,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    )
                    conn.reported = True
                return None
            if conn.reported:
                log.info("rendezvous store %s reachable again", endpoint)
                conn.reported = False
            return result


def _noop(store: Any, arg: Any) -> bool:
    return True


def _import_control() -> None:
    try:
        from kelastic.agent.rendezvous import control  # noqa: F401
    except Exception as exc:  # reported when a store is first used
        log.debug("rendezvous control unavailable: %s", exc)


def _publish(store: Any, action: PublishMembership) -> bool:
    from kelastic.agent.rendezvous import control

    control.publish_membership(
        store, action.run_id, nodes=list(action.nodes), min_nodes=action.min_nodes, max_nodes=action.max_nodes
    )
    return True


def _read(store: Any, run_id: str) -> RendezvousView:
    from kelastic.agent.rendezvous import control

    status = control.read_status(store, run_id)
    progress = status.progress
    return RendezvousView(
        world_size=int(status.world_size or 0),
        restarts=int(status.restarts or 0),
        members=tuple(status.members or ()),
        step=progress.step if progress is not None else None,
        total=progress.total if progress is not None else None,
        recoveries=tuple((r.node, r.seconds, r.ended) for r in status.recoveries),
        hangs=tuple((h.node, h.ranks, h.seconds, h.at) for h in status.hangs),
    )

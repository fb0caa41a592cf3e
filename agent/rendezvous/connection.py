"""A rendezvous handler's connection to the store, and the background threads that run on clones of it.

:class:`StoreConnection` holds the handler's own store client (``store``; None
while lost), tells a restarted store by its ``incarnation`` token (then the
handler's ``restored`` callback re-establishes its round there), records since
when the store is lost (``lost``, ``lost_since``) and runs the event watcher
(``watcher``) and the keep-alive (``keepalive``) on connections of their own.
Replacing the connection (:meth:`StoreConnection.renew`) starts a new generation
of threads; an older thread, still blocked on a stale connection, exits when it wakes.

Its state is guarded by the handler's lock (shared, reentrant).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from .dial import dial
from .keepalive import KeepAlive
from .protocol import RECONNECT_TIMEOUT, RunKeys, connect_store, new_token, push_event, read_counter
from .settings import RendezvousSettings
from .watcher import EventWatcher

__all__ = ["StoreConnection"]


class StoreConnection:
    """This node's store client and its background threads (see the module docstring).

    ``restored(store)``: called under the lock when ``store`` is a restarted store.
    ``started()``: called under the lock at the first connection (before the
    threads run; it calls :meth:`spawn_threads`). ``lost()``: the watcher lost the
    store (the handler calls :meth:`drop`).
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        keys: RunKeys,
        lock: threading.RLock,
        events: EventWatcher,
        keep: KeepAlive,
        restored: Callable[[dist.TCPStore], None],
        started: Callable[[], None],
        lost: Callable[[], None],
    ) -> None:
        self._s = settings
        self._keys = keys
        self._lock = lock
        self._events = events
        self._keep = keep
        self._restored = restored
        self._started = started
        self._lost_cb = lost
        self.store: dist.TCPStore | None = None
        self._incarnation: str | None = None
        # Set while this node's round is not established in the connected store: the
        # connection is lost, or the store restarted and the round is not restored yet.
        self.lost = threading.Event()
        self.lost_since: float | None = None  # monotonic; when the store was lost
        self._threads: list[threading.Thread] = []
        # Bumped when the background threads are replaced (:meth:`renew`): a thread of
        # an older generation, still blocked on a stale connection, exits when it wakes.
        self._gen = 0

    def get(self, deadline: float) -> dist.TCPStore:
        """The connection, connecting (until ``deadline``) if there is none."""
        with self._lock:
            if self.store is not None:
                return self.store
        # Connected outside the lock: reaching a store that is down takes up to the whole
        # timeout, and the peer link and keep-alive threads take the lock meanwhile. Dialled
        # so that a signal stops the wait and the wait says what it waits for.
        remaining = deadline - time.monotonic()
        try:
            store = dial(
                self._s.host, self._s.port, max(deadline, time.monotonic() + 0.5), max(remaining, 0.5)
            )
        except RendezvousConnectionError as exc:
            raise RendezvousConnectionError(
                f"rendezvous {self._s.run_id}: {exc} (gave up after join_timeout={self._s.join_timeout:g}s)"
            ) from exc.__cause__
        return self.install(store)

    def reattach(self) -> None:
        """After the store was lost: connect again and re-establish this node's round there.

        Run by the event watcher once it reached the store again, so that a member
        whose workers keep running gets its round back without waiting for the agent.
        """
        with self._lock:
            if self.store is not None:
                return
        self.install(connect_store(self._s.host, self._s.port, RECONNECT_TIMEOUT))

    def install(self, store: dist.TCPStore) -> dist.TCPStore:
        """Make ``store`` this node's connection (unless another one was installed meanwhile).

        On a restarted store (a new ``incarnation``) the latest round this node was a
        member of is re-established there (``restored``): a member whose group is
        intact keeps its workers, and one that re-joins leaves a round in which its
        fate can be claimed.
        """
        with self._lock:
            if self.store is not None:
                return self.store
            # A fresh token per connection: one that a handler reused could win again
            # on a restarted store and hide the restart from that very handler.
            got = store.compare_set(self._keys.incarnation, "", new_token())
            incarnation = got.decode() if isinstance(got, bytes) else got
            if self._incarnation is not None and incarnation != self._incarnation:
                self._events.forget_closes()  # rounds of the old store
                self._restored(store)
            self._incarnation = incarnation
            self.store = store
            self.lost.clear()
            self.lost_since = None
            if not self._threads:
                self._started()
        # The store is back: the threads in their reconnect back-off try now, and peers whose
        # link closed while it was away are claimed dead at once (the survivors re-form).
        self._events.retry_now.set()
        self._keep.poke.set()
        try:
            self._keep.claim_suspects(store)
        except dist.DistError:
            pass  # the keep-alive thread claims them
        self._events.bump()
        return store

    def drop(self) -> None:
        """The connection failed: forget it, and remember since when the store is lost."""
        with self._lock:
            self.store = None
            if self.lost_since is None:
                self.lost_since = time.monotonic()
        self.lost.set()
        self._events.bump()

    def spawn_threads(self) -> None:
        """Start the event watcher and the keep-alive thread of the current generation (under the lock)."""
        # Each thread gets its own connection (a store client is not shared across threads).
        assert self.store is not None
        tag = f"{self._s.run_id}/{self._s.node_name}"
        # Read here, not in the thread: every event after the first connection is seen,
        # including the close of a round this node is about to join.
        seq = read_counter(self.store, self._keys.events)
        gen = self._gen

        def current() -> bool:
            return gen == self._gen

        self._events.set_watching(True)
        # torch's stubs lack TCPStore.clone.
        watch = (self.store.clone(), seq, current, self.reattach, self._lost_cb)  # type: ignore[attr-defined]
        beat = (self.store.clone(), current)  # type: ignore[attr-defined]
        self._threads = [
            threading.Thread(
                target=self._events.run, args=watch, name=f"kelastic-rdzv-events {tag}", daemon=True
            ),
            threading.Thread(
                target=self._keep.run, args=beat, name=f"kelastic-rdzv-keepalive {tag}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def renew(self, deadline: float) -> None:
        """Replace the connection and the threads with fresh ones (the old threads exit when they wake)."""
        with self._lock:
            self._gen += 1
            self.store = None
        self.get(deadline)
        with self._lock:
            self.spawn_threads()

    def stop_threads(self) -> bool:
        """Wake and join the threads (the handler set its stop event); False if the store could not be told."""
        self._keep.poke.set()
        self._events.retry_now.set()
        # The watcher blocks in the store: wake it with an event.
        watcher = next((t for t in self._threads if t.name.startswith("kelastic-rdzv-events")), None)
        ok = True
        if watcher is not None and watcher.is_alive():
            with self._lock:
                store = self.store
                if store is not None:
                    try:
                        push_event(store, self._keys, f"bye {self._s.node_name}")
                    except dist.DistError:
                        ok = False
        for thread in self._threads:
            thread.join(timeout=5.0)
        return ok

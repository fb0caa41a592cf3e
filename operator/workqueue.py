"""A per-key work queue for asyncio, with delayed adds and per-key exponential back-off.

What client-go's rate-limited work queue gives a controller, on one event loop:

* :meth:`WorkQueue.add` — process a key soon. Each key has at most one pass running;
  adds that arrive while it runs cause exactly one more pass (they coalesce).
* :meth:`WorkQueue.add_after` — process it after a delay; of several pending delays the
  earliest wins.
* :meth:`WorkQueue.retry` — a pass failed: process the key again after a delay of its
  own, ``base_delay`` doubling with each consecutive failure up to ``max_delay``, so a
  failing key neither spins nor waits for an unrelated trigger.
* :meth:`WorkQueue.forget` — a pass succeeded: the key's back-off starts over.

``process(key)`` is the owner's coroutine. It reports its own failures and calls
:meth:`retry`; anything it lets escape is logged here and retried the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from kelastic.operator.clock import SYSTEM, Clock, Timer

__all__ = ["WorkQueue"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(
        self,
        process: Callable[[K], Awaitable[None]],
        *,
        base_delay: float = 1.0,
        max_delay: float = 60.0,
        describe: Callable[[K], str] = str,
        clock: Clock = SYSTEM,
    ) -> None:
        self._process = process
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._describe = describe
        self._running: dict[K, asyncio.Task[None]] = {}
        self._again: set[K] = set()  # added while their pass ran: one more pass
        self._clock = clock
        self._timers: dict[K, tuple[float, Timer]] = {}  # pending delayed adds: (when, timer)
        self._failures: dict[K, int] = {}  # consecutive failed passes
        self._stopping = False

    @property
    def busy(self) -> bool:
        """Whether a pass of any key is running."""
        return bool(self._running)

    def failures(self, key: K) -> int:
        """Consecutive failed passes of ``key`` (0 after a success or :meth:`forget`)."""
        return self._failures.get(key, 0)

    def add(self, key: K) -> None:
        """Process ``key`` soon; coalesces with a pass already running. Ignored once stopped."""
        if self._stopping:
            return
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.get_running_loop().create_task(
            self._work(key), name=f"work {self._describe(key)}"
        )

    def add_after(self, key: K, delay: float | None) -> None:
        """Process ``key`` after ``delay`` seconds, unless a pending delay ends earlier.
        ``None`` asks for nothing."""
        if delay is None:
            return
        now = self._clock.monotonic()
        when = now + max(delay, 0.05) + 0.01
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= when:
                return
            pending[1].cancel()
        self._timers[key] = (when, self._clock.call_later(when - now, lambda: self._due(key)))

    def retry(self, key: K) -> float:
        """A pass of ``key`` failed: process it again after its back-off; returns the delay."""
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(self.max_delay, self.base_delay * 2.0 ** (failures - 1))
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """A pass of ``key`` succeeded: its next failure waits ``base_delay`` again."""
        self._failures.pop(key, None)

    def discard(self, key: K) -> None:
        """Drop ``key``'s pending delayed add and back-off (what it stands for is gone)."""
        self.forget(key)
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()

    async def stop(self) -> None:
        """Cancel the pending delays and the running passes, and wait for them to end."""
        self._stopping = True
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _due(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def _work(self, key: K) -> None:
        try:
            while True:
                self._again.discard(key)
                try:
                    await self._process(key)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    delay = self.retry(key)
                    log.exception("processing %s failed; retrying in %gs", self._describe(key), delay)
                if key not in self._again:
                    break
        finally:
            self._running.pop(key, None)

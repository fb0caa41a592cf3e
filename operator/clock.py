"""Time, injected: the operator's parts that wait or measure ask a :class:`Clock`.

The work queue (its delays and back-off), the leader elector (the Lease's times and
how long leadership is trusted) and the store sync (its read interval and the pacing
of progress) take a ``clock``; they default to :data:`SYSTEM`, the real one. Tests give
them a :class:`FakeClock`, whose time passes only when the test says so: a test that
proves something did *not* happen in five seconds then takes no five seconds, and a
loaded machine cannot make it pass or fail.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Protocol

__all__ = ["SYSTEM", "Clock", "FakeClock", "SystemClock", "Timer"]


class Timer(Protocol):
    """A callback scheduled by :meth:`Clock.call_later`."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the operator asks of time. ``monotonic`` and ``call_later`` share one time line."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for intervals and deadlines)."""
        ...

    def now(self) -> datetime:
        """The wall-clock time, in UTC (for what is written to the API server)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` on the running event loop after ``delay`` seconds."""
        ...


class SystemClock:
    """The real time: ``time.monotonic``, UTC wall-clock time, asyncio's sleep and timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)


#: The real clock, the default of every part that takes one.
SYSTEM: Clock = SystemClock()


class _FakeTimer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time that stands still until :meth:`advance` or :meth:`run_for` moves it.

    ``monotonic()`` starts at 0; ``now()`` at ``start``. Timers and sleepers due by the
    new time run in the order they are due, each at its own time.
    """

    def __init__(self, start: datetime = datetime(2026, 1, 1, tzinfo=timezone.utc)) -> None:
        self._now = 0.0
        self._start = start
        self._due: list[tuple[float, int, _FakeTimer]] = []
        self._seq = 0

    def monotonic(self) -> float:
        return self._now

    def now(self) -> datetime:
        return self._start + timedelta(seconds=self._now)

    def call_later(self, delay: float, callback: Callable[[], None]) -> _FakeTimer:
        timer = _FakeTimer(self._now + max(0.0, delay), callback)
        heapq.heappush(self._due, (timer.when, self._seq, timer))
        self._seq += 1
        return timer

    async def sleep(self, seconds: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():  # not cancelled meanwhile
                woken.set_result(None)

        self.call_later(seconds, wake)
        await woken

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, running the callbacks due meanwhile (and no event loop:
        a sleeper woken here resumes when its loop next runs)."""
        target = self._now + seconds
        while self._due and self._due[0][0] <= target:
            self._fire()
        self._now = target

    async def run_for(self, seconds: float) -> None:
        """Let ``seconds`` pass with the event loop running: after each timer due meanwhile the
        loop gets a few turns, so a coroutine woken by it goes on to its next wait (another
        sleep, a task it spawns). Work in threads or on sockets is not waited for."""
        target = self._now + seconds
        await _turns()
        while self._due and self._due[0][0] <= target:
            self._fire()
            await _turns()
        self._now = target
        await _turns()

    def _fire(self) -> None:
        when, _, timer = heapq.heappop(self._due)
        self._now = max(self._now, when)
        if not timer.cancelled:
            timer.callback()


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)

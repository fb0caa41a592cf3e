"""The fake clock the operator's tests run on: time moves only when told, timers fire in order."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from kelastic.operator.clock import FakeClock


def test_timers_fire_in_order_each_at_its_time_and_a_cancelled_one_never() -> None:
    clock = FakeClock()
    fired: list[tuple[str, float]] = []
    clock.call_later(2.0, lambda: fired.append(("b", clock.monotonic())))
    clock.call_later(1.0, lambda: fired.append(("a", clock.monotonic())))
    clock.call_later(1.5, lambda: fired.append(("never", clock.monotonic()))).cancel()
    clock.advance(1.9)
    assert fired == [("a", 1.0)] and clock.monotonic() == 1.9
    clock.advance(0.1)
    assert fired == [("a", 1.0), ("b", 2.0)]
    assert clock.now() == datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=2)


def test_run_for_lets_a_sleeping_loop_turn_once_per_interval() -> None:
    async def scenario() -> list[float]:
        clock = FakeClock()
        ticks: list[float] = []

        async def poll() -> None:
            while True:
                await clock.sleep(1.0)
                ticks.append(clock.monotonic())

        task = asyncio.get_running_loop().create_task(poll())
        await clock.run_for(3.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ticks

    assert asyncio.run(scenario()) == [1.0, 2.0, 3.0]

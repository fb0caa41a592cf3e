"""The controller's work queue: coalescing, delayed adds, per-key exponential back-off (on a fake clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kelastic.operator.clock import FakeClock
from kelastic.operator.workqueue import WorkQueue


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def test_adds_while_a_pass_runs_coalesce_into_one_more_pass() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        passes: list[str] = []
        release = asyncio.Event()

        async def process(key: str) -> None:
            passes.append(key)
            if len(passes) == 1:
                await release.wait()

        queue = WorkQueue(process, clock=clock)
        queue.add("a")
        await clock.run_for(0)
        for _ in range(5):
            queue.add("a")  # while the first pass runs
        queue.add("b")  # another key runs at once, beside it
        await clock.run_for(0)
        assert passes == ["a", "b"]
        release.set()
        await clock.run_for(0)
        assert passes == ["a", "b", "a"] and not queue.busy

    run(scenario)


def test_the_earliest_delay_wins() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        seen: list[float] = []

        async def process(key: str) -> None:
            seen.append(clock.monotonic())

        queue = WorkQueue(process, clock=clock)
        queue.add_after("a", 5.0)
        queue.add_after("a", 0.1)  # earlier: replaces the pending 5 s
        queue.add_after("a", 3.0)  # later than the pending one: ignored
        queue.add_after("a", None)  # asks for nothing
        await clock.run_for(10.0)
        assert seen == [pytest.approx(0.11)]  # the delay and the queue's 10 ms of slack
        await queue.stop()

    run(scenario)


def test_back_off_doubles_per_key_up_to_the_cap_and_resets_on_success() -> None:
    async def scenario() -> None:
        async def process(key: str) -> None:
            pass

        queue = WorkQueue(process, base_delay=1.0, max_delay=5.0, clock=FakeClock())
        assert [queue.retry("a") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
        assert queue.retry("b") == 1.0  # keys back off independently
        assert queue.failures("a") == 5
        queue.forget("a")
        assert queue.failures("a") == 0 and queue.retry("a") == 1.0
        queue.discard("a")
        assert queue.failures("a") == 0
        await queue.stop()

    run(scenario)


def test_a_failing_pass_is_retried_without_another_trigger(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        attempts: list[float] = []

        async def process(key: str) -> None:
            attempts.append(clock.monotonic())
            if len(attempts) < 3:
                raise RuntimeError("API server down")

        queue = WorkQueue(process, base_delay=1.0, max_delay=1.5, describe=lambda k: f"job {k}", clock=clock)
        queue.add("a")
        await clock.run_for(60.0)
        # at once, after the first back-off (1 s), after the second (doubled, capped at 1.5 s); then done
        assert attempts == [0.0, pytest.approx(1.01), pytest.approx(2.52)]
        assert "processing job a failed; retrying in 1s" in caplog.text
        await queue.stop()

    run(scenario)


def test_stop_cancels_running_passes_and_pending_delays() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        started = asyncio.Event()
        cancelled: list[str] = []
        processed: list[str] = []

        async def process(key: str) -> None:
            processed.append(key)
            started.set()
            try:
                await clock.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(key)
                raise

        queue = WorkQueue(process, clock=clock)
        queue.add("a")
        queue.add_after("b", 0.05)
        await started.wait()
        await queue.stop()
        await clock.run_for(120.0)  # past b's delay and a's sleep
        assert cancelled == ["a"] and processed == ["a"] and not queue.busy
        queue.add("c")  # ignored once stopped
        assert not queue.busy

    run(scenario)

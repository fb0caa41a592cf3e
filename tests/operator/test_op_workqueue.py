"""The controller's work queue: coalescing, delayed adds, per-key exponential back-off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kelastic.operator.workqueue import WorkQueue


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


async def settle(queue: WorkQueue[str]) -> None:
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not queue.busy:
            return
    raise AssertionError("the queue never went idle")


def test_adds_while_a_pass_runs_coalesce_into_one_more_pass() -> None:
    async def scenario() -> None:
        passes: list[str] = []
        release = asyncio.Event()

        async def process(key: str) -> None:
            passes.append(key)
            if len(passes) == 1:
                await release.wait()

        queue = WorkQueue(process)
        queue.add("a")
        await asyncio.sleep(0.01)
        for _ in range(5):
            queue.add("a")  # while the first pass runs
        queue.add("b")  # another key runs at once, beside it
        await asyncio.sleep(0.01)
        assert passes == ["a", "b"]
        release.set()
        await settle(queue)
        assert passes == ["a", "b", "a"]

    run(scenario)


def test_the_earliest_delay_wins() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        seen: list[float] = []

        async def process(key: str) -> None:
            seen.append(loop.time())

        queue = WorkQueue(process)
        start = loop.time()
        queue.add_after("a", 5.0)
        queue.add_after("a", 0.1)  # earlier: replaces the pending 5 s
        queue.add_after("a", 3.0)  # later than the pending one: ignored
        queue.add_after("a", None)  # asks for nothing
        await asyncio.sleep(0.5)
        await settle(queue)
        assert len(seen) == 1 and 0.1 <= seen[0] - start < 0.5
        await queue.stop()

    run(scenario)


def test_back_off_doubles_per_key_up_to_the_cap_and_resets_on_success() -> None:
    async def scenario() -> None:
        async def process(key: str) -> None:
            pass

        queue = WorkQueue(process, base_delay=1.0, max_delay=5.0)
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
        attempts: list[int] = []

        async def process(key: str) -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise RuntimeError("API server down")

        queue = WorkQueue(process, base_delay=0.05, max_delay=0.1, describe=lambda k: f"job {k}")
        queue.add("a")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(attempts) == 3:
                break
        assert len(attempts) == 3
        assert "processing job a failed; retrying in 0.05s" in caplog.text
        await queue.stop()

    run(scenario)


def test_stop_cancels_running_passes_and_pending_delays() -> None:
    async def scenario() -> None:
        started = asyncio.Event()
        cancelled: list[str] = []

        async def process(key: str) -> None:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(key)
                raise

        queue = WorkQueue(process)
        queue.add("a")
        queue.add_after("b", 0.05)
        await started.wait()
        await queue.stop()
        await asyncio.sleep(0.1)
        assert cancelled == ["a"] and not queue.busy
        queue.add("c")  # ignored once stopped
        assert not queue.busy

    run(scenario)

"""The controller's memory of each job between passes: newest body, own writes, expected pods."""

from __future__ import annotations

import asyncio

from kelastic.agent import contract
from kelastic.operator.jobcache import EXPECT_SECONDS, JobCache
from kelastic.operator.kube import ApiError
from kelastic.operator.observed import PodPhase, PodView

KEY = ("ns", "demo")


def _body(rv: str, phase: str) -> dict[str, object]:
    return {"metadata": {"name": "demo", "resourceVersion": rv}, "status": {"phase": phase}}


def test_the_newest_body_wins_whatever_the_order_it_arrives_in() -> None:
    cache = JobCache()
    cache.remember(KEY, _body("10", "Created"))
    cache.wrote(KEY, _body("12", "Running"))  # our status write's answer
    assert cache.is_own_write(KEY, "12") and not cache.is_own_write(KEY, "10")
    cache.remember(KEY, _body("11", "Created"))  # the watch's late event of an older state
    assert (cache.body(KEY) or {})["status"] == {"phase": "Running"}
    cache.remember(KEY, _body("not-a-number", "Failed"))  # unparsable: the watch's order decides
    assert (cache.body(KEY) or {})["status"] == {"phase": "Failed"}
    cache.forget(KEY)
    assert cache.body(KEY) is None and not cache.is_own_write(KEY, "12")


def test_a_created_pod_counts_until_the_watch_shows_it_or_it_expires() -> None:
    now = [100.0]
    cache = JobCache(clock=lambda: now[0])
    created = PodView(
        name="demo-worker-0", uid="u0", role=contract.ROLE_WORKER, index=0, phase=PodPhase.PENDING
    )
    cache.expect(KEY, created)
    pods, expecting = cache.with_expected(KEY, [])
    assert pods == [created] and expecting
    now[0] += 1.0  # the watch delivers it: no longer expected
    pods, expecting = cache.with_expected(KEY, [created])
    assert pods == [created] and not expecting
    cache.expect(KEY, created)
    now[0] += EXPECT_SECONDS + 0.1  # never shown (a watch that broke): not assumed forever
    assert cache.with_expected(KEY, []) == ([], False)
    cache.expect(KEY, created)
    cache.seen(KEY, "demo-worker-0")  # its watch event came (and maybe its deletion too)
    assert cache.with_expected(KEY, []) == ([], False)


def test_a_failed_workers_log_is_read_once() -> None:
    cache = JobCache()
    reads: list[str] = []

    async def read_log(namespace: str, pod: str, container: str | None) -> str:
        reads.append(pod)
        if pod == "demo-worker-1":
            raise ApiError(404, "NotFound", "pod is gone")
        return "Traceback ... exit code 3"

    failed = [
        PodView(
            name=f"demo-worker-{i}", uid=f"u{i}", role=contract.ROLE_WORKER, index=i, phase=PodPhase.FAILED
        )
        for i in range(2)
    ]
    running = PodView(
        name="demo-worker-2", uid="u2", role=contract.ROLE_WORKER, index=2, phase=PodPhase.RUNNING
    )
    for _ in range(3):  # three passes
        pods = asyncio.run(cache.with_failure_logs("ns", [*failed, running], read_log))
    assert reads == ["demo-worker-0", "demo-worker-1"]
    assert [p.message for p in pods] == ["Traceback ... exit code 3", None, None]
